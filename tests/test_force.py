"""``--force`` replaces only ember's own output of the same kind (ember/atomic.py: ``check_target``):
for every verb that writes, a target that is the source, holds it, sits inside it, or holds a
foreign file is refused with one line and exit 2, and every byte under the tree stays as it was.
An output path that cannot be created is the same kind of error, and a failed instrument
leaves no empty folder."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from ember.cli import main
from ember.config import load_config
from ember.train.trainer import train


@pytest.fixture(scope="module")
def tree(tiny_data, tmp_path_factory):
    """P/ holding a trained run P/tiny, its HF export P/hf, a foreign folder P/mine (mine.txt)
    and a foreign file P/mine.txt: every case below aims at one of them."""
    root = tmp_path_factory.mktemp("force")
    overrides = [f"data.dir={tiny_data}", "data.val_fraction=0.1", f"run.out_dir={root}", "train.device=cpu"]
    train(load_config("tiny", [*overrides, "train.max_steps=4", "train.eval_every=0", "train.ckpt_every=0"]))
    pytest.importorskip("transformers")
    assert main(["export", str(root / "tiny"), "--to", "hf", str(root / "hf")]) == 0
    (root / "mine").mkdir()
    (root / "mine" / "mine.txt").write_text("keep me")
    (root / "mine.txt").write_text("keep me too")
    return root


def hashes(*roots: Path) -> dict[str, str]:
    """sha256 of every file and a mark for every folder under ``roots``."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            out[str(p)] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def refused(capsys, argv: list[str], *words: str) -> str:
    capsys.readouterr()
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("ember: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    return err


def cases(tree: Path, data: Path) -> list[tuple[str, list[str], str]]:
    """(verb, argv, a word the error says): target = source, holds it, sits inside it, holds a
    foreign file, or is ember's output of another kind."""
    run, hf, mine = tree / "tiny", tree / "hf", tree / "mine"
    tiny = ["tiny", f"data.dir={data}", "data.val_fraction=0.1", "train.device=cpu"]
    train_in = ["train", *tiny, "train.max_steps=1"]
    quantize = ["quantize", str(run), "--scheme", "int8-weight", "--force", "--out"]
    imp = ["import", "hf", str(hf), "--force", "--out"]
    out = []
    for to, file in (("hf", mine), ("pt2", mine / "mine.txt"), ("onnx", tree / "mine.txt")):
        export = ["export", str(run), "--to", to]
        out += [
            (f"export {to}", [*export, str(run), "--force"], "is the source"),
            (f"export {to}", [*export, str(tree), "--force"], "contains the source"),
            (f"export {to}", [*export, str(run / "model" / "x"), "--force"], "is inside the source"),
            (f"export {to}", [*export, str(file), "--force"], "mine.txt"),
        ]
    return out + [
        ("quantize", [*quantize, str(run)], "is the source"),
        ("quantize", [*quantize, str(tree)], "contains the source"),
        ("quantize", [*quantize, str(mine)], "mine.txt"),
        ("quantize", [*quantize, str(hf)], "ember's hf output"),
        ("import", [*imp, str(hf)], "is the source"),
        ("import", [*imp, str(tree)], "contains the source"),
        ("import", [*imp, str(mine)], "mine.txt"),
        ("sweep", ["sweep", *tiny, "--out", str(run)], "ember's run output"),  # the case
        ("sweep", ["sweep", *tiny, "--out", str(mine)], "mine.txt"),
        ("report", ["report", str(run), "--out", str(run)], "is the source"),
        ("report", ["report", str(run), "--out", str(tree)], "contains the source"),
        ("report", ["report", str(run), "--out", str(mine)], "mine.txt"),
        ("report", ["report", str(run), "--out", str(hf)], "ember's hf output"),
        ("bench comm", ["bench", "comm", "--out", str(mine)], "mine.txt"),
        ("bench comm", ["bench", "comm", "--out", str(run)], "ember's run output"),
        ("data prepare", ["data", "prepare", "tiny", f"data.dir={mine}", "--force"], "mine.txt"),
        ("data prepare", ["data", "prepare", "tiny", f"data.dir={run}", "--force"], "ember's run output"),
        ("train", [*train_in, f"run.out_dir={tree}", "run.name=mine"], "mine.txt"),
        ("train", [*train_in, f"run.out_dir={data.parent}", f"run.name={data.name}"], "is the source"),
        (
            "train",
            [*train_in, f"run.out_dir={data.parent.parent}", f"run.name={data.parent.name}"],
            "contains",
        ),
        ("train", [*train_in, f"run.out_dir={data}", "run.name=x"], "is inside the source"),
        (
            "train",
            [*train_in, f"run.out_dir={tree}", "run.name=tiny", f"train.init_from={run}"],
            "is the source",
        ),
    ]


def test_force_never_replaces_a_source_its_parent_or_a_foreign_file(tree, tiny_data, capsys):
    before = hashes(tree, tiny_data)
    verbs = set()
    for verb, argv, word in cases(tree, tiny_data):
        refused(capsys, argv, word)
        verbs.add(verb)
        assert hashes(tree, tiny_data) == before, argv  # byte for byte: nothing deleted, nothing added
    assert len(verbs) == 10


def test_force_replaces_ember_output_of_the_same_kind(tree, tmp_path, capsys):
    out = tmp_path / "again-hf"
    assert main(["export", str(tree / "tiny"), "--to", "hf", str(out)]) == 0
    assert (out / ".ember").read_text() == "hf\n"
    refused(capsys, ["export", str(tree / "tiny"), "--to", "hf", str(out)], "--force")
    assert main(["export", str(tree / "tiny"), "--to", "hf", str(out), "--force"]) == 0
    refused(capsys, ["import", "hf", str(out), "--out", str(out.parent), "--force"], "contains the source")
    for _ in range(2):  # `ember report RUN --out X` writes into X, and again over its own report
        assert main(["report", str(tree / "tiny"), "--out", str(tmp_path / "rep")]) == 0
    rep = tmp_path / "rep"
    assert (rep / "report.md").is_file() and (rep / ".ember").read_text() == "report\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again-hf", "rep"]


@pytest.mark.parametrize("where", ["file", "proc"])
def test_an_output_path_that_cannot_be_created_is_one_line(tree, tiny_data, tmp_path, capsys, where):
    base = tree / "mine.txt" if where == "file" else Path("/proc/ember-no-such")
    run, hf = tree / "tiny", tree / "hf"
    tiny = ["tiny", f"data.dir={tiny_data}", "data.val_fraction=0.1", "train.device=cpu"]
    before = hashes(tree, tiny_data)
    argvs = [
        ["export", str(run), "--to", "pt2", str(base / "x.pt2")],
        ["export", str(run), "--to", "onnx", str(base / "x.onnx")],
        ["export", str(run), "--to", "hf", str(base / "hf")],
        ["quantize", str(run), "--scheme", "int8-weight", "--out", str(base / "q")],
        ["import", "hf", str(hf), "--out", str(base / "back")],
        ["data", "prepare", "tiny", f"data.dir={base / 'data'}"],
        ["train", *tiny, "train.max_steps=1", f"run.out_dir={base / 'runs'}"],
        ["train", *tiny, "train.max_steps=1", f"data.dir={base / 'data'}"],
        ["sweep", *tiny, "--out", str(base / "sweep")],
        ["report", str(run), "--out", str(base / "report")],
        ["bench", "comm", "--out", str(base / "comm")],
    ]
    for argv in argvs:
        refused(capsys, argv, str(base))
    assert hashes(tree, tiny_data) == before


def test_a_failed_profile_leaves_no_folder(tree, monkeypatch):
    from ember.analysis import profile

    def fail(*args, **kwargs):
        raise RuntimeError("the peak could not be measured")

    monkeypatch.setattr(profile, "matmul_peak", fail)
    with pytest.raises(RuntimeError, match="peak"):
        profile.analyze(tree / "tiny", steps=1)
    assert not (tree / "tiny" / "analysis").exists()
