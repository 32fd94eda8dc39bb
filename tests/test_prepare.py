"""``ember data prepare`` end to end: shards, manifest, reuse, atomicity, bad input, CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ember.cli import main
from ember.config import load_config
from ember.data.clean import content_digest
from ember.data.loader import TokenDataset
from ember.data.manifest import load_tokenizer, read_manifest
from ember.data.prepare import prepare
from ember.data.shards import read_shard
from ember.data.stats import verify
from ember.errors import DataError, EmberError


def _corpus(root: Path, n: int = 60) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"doc{i:03d}.txt").write_text(f"Document {i}. " + f"def f(x): return x * {i}\n" * (1 + i % 5))
    (root / "dup.txt").write_text((root / "doc001.txt").read_text())  # exact duplicate
    (root / "empty.txt").write_text("")  # too short
    (root / "blob.bin").write_bytes(b"\x00\x01" * 50)  # binary
    return root


def _cfg(tmp_path, *overrides):
    return load_config(
        None,
        [
            f"data.sources=[{tmp_path / 'corpus'}]",
            f"data.dir={tmp_path / 'out'}",
            "data.vocab_size=300",
            "data.val_fraction=0.2",
            *overrides,
        ],
    )


@pytest.fixture
def prepared(tmp_path):
    _corpus(tmp_path / "corpus")
    return prepare(_cfg(tmp_path), log=lambda _: None), tmp_path


def test_shards_hold_every_document_then_eos(prepared):
    result, tmp_path = prepared
    m = result.manifest
    tok = load_tokenizer(result.directory)
    texts = sorted((p.name, p.read_text()) for p in (tmp_path / "corpus").glob("doc*.txt"))
    # the split rules, restated for one folder: documents by (size, digest), every 5th for val
    # (val_fraction 0.2) from a hashed offset; test (no test sources: test_fraction 0.02) the
    # same from what is left, at 0.02 / 0.8 (tests/test_splits.py checks the sampling itself)
    import hashlib
    import math

    def sample(items, fraction, salt):
        order = sorted(items, key=lambda t: (len(t[1].encode()), content_digest(t[1])))
        digests = b"".join(sorted(content_digest(t) for _, t in items))
        u = int.from_bytes(hashlib.blake2b(salt + digests, digest_size=8).digest(), "big") / 2.0**64
        return {
            n
            for i, (n, _) in enumerate(order)
            if math.floor((i + 1) * fraction + u) > math.floor(i * fraction + u)
        }

    val = sample(texts, 0.2, b"val")
    test = sample([t for t in texts if t[0] not in val], 0.02 / 0.8, b"test")
    split_of = {name: "val" if name in val else "test" if name in test else "train" for name, _ in texts}
    expected = {"train": [], "val": [], "test": []}
    for name, text in texts:  # dup.txt sorts after doc*.txt, so the original is the one kept
        expected[split_of[name]].extend(tok.encode(text) + [tok.eos_id])
    assert expected["val"] and expected["test"]
    for split in ("train", "val", "test"):
        got = np.concatenate([read_shard(result.directory / s["name"]) for s in m["splits"][split]["shards"]])
        assert got.dtype == np.uint16
        assert got.tolist() == expected[split]
        assert m["splits"][split]["tokens"] == len(expected[split])
    assert sum(m["splits"][s]["documents"] for s in ("train", "val", "test")) == 60
    assert m["splits"]["val"]["strata"] == [
        {
            "name": str(tmp_path / "corpus"),
            "offset": 0,
            **{k: m["splits"]["val"][k] for k in ("documents", "bytes", "tokens")},
        }
    ]
    assert "hashed share" in m["split_rules"]["test"]
    assert m["cleaning"] == {"documents_in": 62, "too_short": 1, "nontext": 0, "duplicate": 1, "kept": 60}
    src = m["sources"][0]
    assert (src["files"], src["documents"], src["binary_skipped"]) == (63, 62, 1)
    assert m["tokenizer"]["kind"] == "bpe" and m["dtype"] == "uint16"
    assert m["ember_version"] and m["config"]["data"]["vocab_size"] == 300 and m["command"]
    assert verify(result.directory, check_sha256=True) == read_manifest(result.directory)


def test_reuse_force_and_changed_inputs(prepared, capsys):
    result, tmp_path = prepared
    shard = result.directory / "train-000000.bin"
    mtime = shard.stat().st_mtime_ns
    again = prepare(_cfg(tmp_path))
    assert again.reused and "reusing" in capsys.readouterr().out
    assert shard.stat().st_mtime_ns == mtime
    forced = prepare(_cfg(tmp_path), force=True, log=lambda _: None)
    assert not forced.reused and forced.manifest["splits"] == result.manifest["splits"]
    with pytest.raises(DataError, match="different inputs.*--force"):
        prepare(_cfg(tmp_path, "data.vocab_size=320"))
    (tmp_path / "corpus" / "new.txt").write_text("a new document appears")
    with pytest.raises(DataError, match="different inputs"):
        prepare(_cfg(tmp_path))


def test_char_tokenizer_and_multiple_shards(tmp_path):
    _corpus(tmp_path / "corpus")
    r = prepare(
        _cfg(tmp_path, "data.tokenizer=char", "data.vocab_size=40", "data.shard_tokens=1000"),
        log=lambda _: None,
    )
    shards = r.manifest["splits"]["train"]["shards"]
    assert len(shards) > 1 and all(s["n_tokens"] <= 1000 for s in shards)
    assert sum(s["n_tokens"] for s in shards) == r.manifest["splits"]["train"]["tokens"]
    ds = TokenDataset(r.directory, "train")
    assert len(ds) == r.manifest["splits"]["train"]["tokens"]
    assert load_tokenizer(r.directory).kind == "char"


def test_interrupted_prepare_leaves_nothing(tmp_path, monkeypatch):
    _corpus(tmp_path / "corpus")
    import ember.data.prepare as prep

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "write_manifest", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare(_cfg(tmp_path), log=lambda _: None)
    assert sorted(os.listdir(tmp_path)) == ["corpus"]  # no out/, no temp dir


def test_interrupted_rebuild_keeps_the_old_result(prepared, monkeypatch):
    result, tmp_path = prepared
    import ember.data.prepare as prep

    monkeypatch.setattr(prep, "write_manifest", lambda *a: (_ for _ in ()).throw(RuntimeError("crash")))
    with pytest.raises(RuntimeError):
        prepare(_cfg(tmp_path), force=True, log=lambda _: None)
    assert read_manifest(result.directory) == result.manifest
    assert sorted(os.listdir(tmp_path)) == ["corpus", "out"]


def test_stale_temp_dir_from_a_killed_run_is_removed(tmp_path):
    _corpus(tmp_path / "corpus")
    stale = tmp_path / ".out.tmp-999999999"
    (stale / "x").mkdir(parents=True)
    prepare(_cfg(tmp_path), log=lambda _: None)
    assert not stale.exists()


def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    _corpus(tmp_path / "corpus")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    for force in (False, True):
        with pytest.raises(EmberError, match="not an ember data directory"):
            prepare(_cfg(tmp_path), force=force, log=lambda _: None)
    assert (tmp_path / "out" / "precious.txt").read_text() == "keep me"


def test_bad_inputs(tmp_path):
    _corpus(tmp_path / "corpus")
    with pytest.raises(DataError, match="not found"):
        prepare(load_config(None, [f"data.sources=[{tmp_path / 'nope'}]", f"data.dir={tmp_path / 'o'}"]))
    with pytest.raises(DataError, match="empty after cleaning|no training text"):
        prepare(_cfg(tmp_path, "data.min_chars=100000"), log=lambda _: None)
    with pytest.raises(DataError, match="vocab_size=100 is too small"):
        prepare(_cfg(tmp_path, "data.vocab_size=100"), log=lambda _: None)
    with pytest.raises(DataError, match="no document fell into the val split"):  # one document stays in train
        prepare(_cfg(tmp_path, f"data.sources=[{tmp_path / 'corpus' / 'doc001.txt'}]"), log=lambda _: None)
    assert sorted(os.listdir(tmp_path)) == ["corpus"]


def test_tokenizer_mismatch_and_corrupt_shard_detected(prepared):
    result, _ = prepared
    shard = result.directory / "train-000000.bin"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-2])
    with pytest.raises(DataError, match="train-000000.bin"):
        verify(result.directory)
    shard.write_bytes(raw[:-2] + b"\xff\xff")
    with pytest.raises(DataError, match="sha256"):
        verify(result.directory, check_sha256=True)
    shard.write_bytes(raw)
    tok = result.directory / "tokenizer.json"
    tok.write_text(tok.read_text().replace("<|reserved_7|>", "<|reserved_X|>"))
    with pytest.raises(DataError, match="does not match"):
        load_tokenizer(result.directory)


def test_cli_prepare_stats_and_errors(tmp_path, capsys):
    _corpus(tmp_path / "corpus")
    args = [
        f"data.sources=[{tmp_path / 'corpus'}]",
        f"data.dir={tmp_path / 'out'}",
        "data.vocab_size=300",
        "data.val_fraction=0.2",
    ]
    assert main(["data", "prepare", "tiny", *args]) == 0
    assert "splits" in capsys.readouterr().out
    assert main(["data", "stats", str(tmp_path / "out"), "--verify"]) == 0
    assert "verified" in capsys.readouterr().out
    assert main(["data", "stats", str(tmp_path / "out"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "ember-shards"
    assert main(["data", "stats", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ember: error: no manifest.json") and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["data", "prepare", "tiny", "data.sources=[/no/such/dir]"], "not found"),
        (["config", "show", "tiny", "data.vocab_sise=3"], "did you mean data.vocab_size"),
        (["data", "prepare", "no-such-preset"], "no-such-preset"),
        (["train", "tiny", "train.seq_len=128"], "beyond model.max_seq_len"),
        (["train", "tiny", "model.n_head=3"], "does not divide model.d_model"),
        (["train", "tiny", "model.n_kv_head=3"], "does not divide model.n_head"),
        (["train", "tiny", "--nproc", "2", "model.n_head=3"], "does not divide model.d_model"),
    ],
)
def test_cli_errors_exit_2_without_traceback(argv, message, tmp_path, monkeypatch, capsys):
    """In-process, as test_bad_inputs.py runs its table (``ember.cli.main`` returns the exit
    code; a torch import per case was most of each case's cost): ``python -m ember`` itself is
    run by test_every_verb_has_help and, failing, by test_analysis.py. Any launch is an error."""
    from unittest import mock

    monkeypatch.chdir(tmp_path)
    with mock.patch("ember.cli.subprocess.call", side_effect=AssertionError("torchrun was launched")):
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2
    assert os.listdir(tmp_path) == []


def test_every_verb_has_help():
    for argv in (
        ["--help"],
        ["data", "prepare", "--help"],
        ["data", "stats", "--help"],
        ["config", "show", "--help"],
        ["config", "keys", "--help"],
        ["quickstart", "--help"],
    ):
        proc = subprocess.run([sys.executable, "-m", "ember", *argv], capture_output=True, text=True)
        assert proc.returncode == 0 and "usage: ember" in proc.stdout, argv


@pytest.mark.slow
def test_quickstart_runs_end_to_end(tmp_path, capsys):
    """The main job with a tiny budget and corpus: prepare, train, evaluate, report paths."""
    argv = [
        "quickstart",
        "--minutes",
        "0.05",
        "--out",
        str(tmp_path / "runs"),
        "--data-dir",
        str(tmp_path / "py"),
        "data.sources=[embedded:python-docs]",
        "data.vocab_size=600",
        "data.val_fraction=0.1",
        "data.test_bytes=100000",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "quickstart"
    assert str(run / "model") in out and "test bits/byte (validation" in out
    results = json.loads((run / "eval.json").read_text())["results"]
    assert set(results) == {"test", "val"} and f"headline: {results['test']['bpb']:.4f}" in out
    m = read_manifest(tmp_path / "py")
    assert m["splits"]["train"]["tokens"] > 100_000 and m["tokenizer"]["vocab_size"] == 600
    assert (run / "model" / "model.safetensors").is_file()
    assert json.loads((run / "eval.json").read_text())["results"]
    assert (run / "samples.md").read_text().count("## ") == 4
    report = (run / "report.md").read_text()
    assert "plots/loss.png" in report and (run / "plots" / "loss.png").is_file()
    argv[argv.index("0.05")] = "0.01"  # (a step or two is enough to see the run replaced)
    assert main(argv) == 0  # again: data reused, run replaced
    assert "reusing" in capsys.readouterr().out


def test_prepare_memory_does_not_grow_with_the_corpus(tmp_path, monkeypatch):
    """Python-side peak memory (tracemalloc) for a 4x larger corpus stays about the same:
    documents stream through fixed-size batches straight into the shards."""
    import tracemalloc

    import ember.data.prepare as prep

    monkeypatch.setattr(prep, "BATCH_CHARS", 1 << 18)
    line = "for item in range(10):  # a line of code, numbered {}\n"

    def peak(n_files):
        corpus = tmp_path / f"c{n_files}"
        corpus.mkdir()
        for f in range(n_files):
            (corpus / f"{f:04d}.txt").write_text("".join(line.format(f * 1000 + i) for i in range(1000)))
        cfg = load_config(
            None,
            [
                f"data.sources=[{corpus}]",
                f"data.dir={tmp_path / f'o{n_files}'}",
                "data.vocab_size=300",
                "data.tokenizer_train_bytes=300000",
                "data.val_fraction=0.1",
            ],
        )
        tracemalloc.start()
        prepare(cfg, log=lambda _: None)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(40), peak(160)  # ~2 MB and ~9 MB of text
    assert large < 1.3 * small, (small, large)
