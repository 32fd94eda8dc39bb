"""``ember export --to pt2|aoti|onnx``: the written file, loaded back on its own, gives eager's
logits at three (batch, sequence) shapes; an existing target is refused without --force."""

from __future__ import annotations

import sys

import pytest
import torch

from ember.cli import main
from ember.errors import EmberError
from ember.export.graph import export_graph, load_graph
from ember.run import load_run
from ember.train.trainer import train

TOL = {"pt2": 1e-5, "aoti": 1e-5, "onnx": 1e-4, "onnx-decode": 1e-4}


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory):
    from ember.config import load_config

    out = tmp_path_factory.mktemp("runs")
    overrides = [f"data.dir={tiny_data}", "data.val_fraction=0.1", f"run.out_dir={out}", "train.device=cpu"]
    train(load_config("tiny", [*overrides, "train.max_steps=4"]))
    return out / "tiny"


@pytest.mark.parametrize("target", list(TOL))
def test_graph_matches_eager_at_three_shapes(target, run, tmp_path, capsys):
    if target.startswith("onnx"):
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
    out = tmp_path / f"tiny.{target}"
    assert main(["export", str(run), "--to", target, str(out)]) == 0
    assert "first call" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no staging file left
    model, _ = load_run(run)
    model.eval()
    graph = load_graph(target, out)
    gen = torch.Generator().manual_seed(1)
    for shape in [(1, 1), (3, 17), (2, model.cfg.max_seq_len)]:  # none is the tracing shape (2, 8)
        idx = torch.randint(0, model.cfg.vocab_size, shape, generator=gen)
        with torch.no_grad():
            want, got = model(idx), graph(idx)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= TOL[target], shape


def test_existing_file_is_refused_without_force(run, tmp_path, capsys):
    out = tmp_path / "tiny.pt2"
    out.write_bytes(b"keep me")
    assert main(["export", str(run), "--to", "pt2", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"
    assert main(["export", str(run), "--to", "pt2", str(out), "--force"]) == 2  # not ember's: kept
    assert out.read_bytes() == b"keep me"
    out.unlink()
    assert main(["export", str(run), "--to", "pt2", str(out)]) == 0
    assert main(["export", str(run), "--to", "pt2", str(out), "--force"]) == 0  # its own kind: replaced
    assert isinstance(torch.export.load(str(out)), torch.export.ExportedProgram)
    assert main(["export", str(run), "--to", "pt2", str(tmp_path)]) == 2  # a directory is not a file
    assert main(["export", str(tmp_path / "no-run"), "--to", "pt2", str(tmp_path / "x.pt2")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.pt2"]


def test_onnx_decode_graph_greedy_matches_ember(run, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from ember.export.graph import ort_greedy
    from ember.infer.engine import Engine
    from ember.infer.sampling import Sampling

    out = tmp_path / "tiny.decode.onnx"
    assert main(["export", str(run), "--to", "onnx-decode", str(out)]) == 0
    model, tokenizer = load_run(run)
    model.eval()
    engine = Engine(model, tokenizer)
    for prompt in ["def ", "class Foo", "import os\n"]:
        want = engine.generate([prompt], Sampling(max_new_tokens=16, temperature=0))[0].text
        new = ort_greedy(out, tokenizer.encode(prompt), 16, tokenizer.eos_id)
        assert len(new) > 1 and tokenizer.decode(new) == want, prompt  # steps through the past inputs


def test_onnxruntime_missing_is_an_ember_error(run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    with pytest.raises(EmberError, match="pip install onnx onnxscript onnxruntime"):
        export_graph(run, "onnx", tmp_path / "tiny.onnx")
    assert not any(tmp_path.iterdir())
