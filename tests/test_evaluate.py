"""``ember eval``: the same numbers as the trainer's evaluation, any text, bad runs."""

import json
import shutil

import pytest

from ember.cli import main
from ember.errors import EmberError
from ember.infer.evaluate import evaluate_run, load_model
from ember.train.trainer import train


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory):
    from ember.config import load_config

    out = tmp_path_factory.mktemp("runs")
    cfg = load_config(
        "tiny",
        [
            f"data.dir={tiny_data}",
            "data.val_fraction=0.1",
            f"run.out_dir={out}",
            "train.device=cpu",
            "train.max_steps=12",
            "train.eval_every=6",
            "train.ckpt_every=6",
        ],
    )
    train(cfg)
    return out / "tiny"


def test_val_split_matches_the_trainer(run):
    summary = json.loads((run / "summary.json").read_text())
    results = evaluate_run(run, ckpt="last", max_windows=32, batch_size=4)  # the trainer's eval settings
    ((name, r),) = results.items()
    assert name.startswith("val")
    assert abs(r["val_loss"] - summary["val_loss"]) < 1e-5
    assert abs(r["val_bpb"] - summary["val_bpb"]) < 1e-5
    assert json.loads((run / "eval.json").read_text())["results"] == results


def test_any_source_and_checkpoints(run, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    last = evaluate_run(run, [str(text)], ckpt="last")[str(text)]
    step6 = evaluate_run(run, [str(text)], ckpt="6")[str(text)]
    step12 = evaluate_run(run, [str(text)], ckpt="step-000012")[str(text)]
    assert last["val_loss"] == pytest.approx(step12["val_loss"], abs=1e-6)  # final weights = last step
    assert step6["val_loss"] != pytest.approx(last["val_loss"], abs=1e-4)
    assert last["val_bpb"] > 0


def test_bad_runs(run, tmp_path):
    with pytest.raises(EmberError, match="does not exist"):
        load_model(tmp_path / "nope")
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    with pytest.raises(EmberError, match="no checkpoint step-000007.*newest: step-000012"):
        load_model(broken, "7")
    cfg = json.loads((broken / "model" / "model_config.json").read_text())
    cfg["vocab_size"] = 100
    (broken / "model" / "model_config.json").write_text(json.dumps(cfg))
    with pytest.raises(EmberError, match="does not match the weights"):
        load_model(broken)
    shutil.rmtree(broken / "model")
    with pytest.raises(EmberError, match="no model/model_config.json"):
        load_model(broken)
    assert main(["eval", str(broken)]) == 2


def test_generate_cli(run, capsys):
    assert (
        main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    )
    greedy = capsys.readouterr().out
    assert greedy.startswith("---\ndef ")
    assert (
        main(
            [
                "generate",
                str(run),
                "--prompt",
                "def ",
                "--max-new-tokens",
                "8",
                "--temperature",
                "0",
                "--json",
            ]
        )
        == 0
    )
    (record,) = json.loads(capsys.readouterr().out)
    assert greedy.strip() == ("---\ndef " + record["text"]).strip()  # streamed text = batch text
    assert main(["generate", str(run)]) == 2
    assert main(["generate", str(run), "--prompt", "x" * 400, "--max-new-tokens", "8"]) == 2
    assert "max_seq_len" in capsys.readouterr().err


def test_chat_cli(run):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "ember", "chat", str(run), "--max-new-tokens", "5", "--temperature", "0"],
        input="def \nclass \n\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") == 3  # two turns, then the empty line ends the loop
