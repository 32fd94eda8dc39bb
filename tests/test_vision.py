"""train.task=classify: image classifiers on the language model's trainer (docs/vision.md).

The models are tested in test_vision_models.py, the image sources and loader in test_images.py;
here the task on the loop: an end-to-end run with eval, report and profile; exact resume;
accumulation, precision, compile and SGD; the refusals. Two ranks against one process run in
tests/test_trainer.py's launch (one torchrun start for every parity leg)."""

import contextlib
import importlib.util
import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ember.cli import main
from ember.config import load_config
from ember.errors import ConfigError, EmberError
from ember.run import load_run, read_metrics
from ember.train.layout import check_layout
from ember.train.trainer import Trainer, train

# (find_spec, not importorskip: importing scikit-learn costs every collecting worker 1.5 s)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs ember[vision]")

FAST = ["train.max_steps=12", "train.eval_every=6", "train.log_every=6", "train.warmup_steps=2"]
LAYER = ["model.norm=layernorm", "train.deterministic=true"]  # BatchNorm's statistics are per micro-batch


def ember(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def digits(tmp_path, *overrides):
    return load_config(
        "digits", [f"run.out_dir={tmp_path}", "train.ckpt_every=0", "train.report=false", *FAST, *overrides]
    )


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}


def test_train_eval_report_and_profile_a_cnn_end_to_end(tmp_path):
    """`ember train digits` → best model by val error, `ember eval --split test` (accuracy, its
    interval, confusion matrix, eval.json), `ember report` (curves), `ember analyze profile`."""
    r = ember("train", "digits", f"run.out_dir={tmp_path}", "run.name=cnn", *FAST, "train.max_steps=40",
              "train.eval_every=20")  # fmt: skip
    assert r.returncode == 0, r.stderr
    run = tmp_path / "cnn"
    assert "img/s" in r.stdout and "images/step" in r.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_val_error"] < 0.5 and summary["best_step"] in (20, 40)
    vals = [m for m in read_metrics(run) if "val_accuracy" in m]
    assert [m["step"] for m in vals] == [20, 40]
    assert all(abs(m["val_error"] - (1 - m["val_accuracy"])) < 1e-9 for m in vals)
    assert not (run / "tokenizer.json").exists() and (run / "model-best" / "model.safetensors").is_file()

    r = ember("eval", str(run), "--split", "test")
    assert r.returncode == 0, r.stderr
    result = json.loads((run / "eval.json").read_text())["results"]["test"]
    assert result["images"] == 359 and sum(map(sum, result["confusion"])) == 359
    correct = sum(result["confusion"][i][i] for i in range(10))
    assert result["accuracy"] == pytest.approx(correct / 359)
    lo, hi = result["accuracy_ci95"]
    assert (
        lo < result["accuracy"] < hi and f"{result['accuracy']:.2%}" in r.stdout and "confusion" in r.stdout
    )
    assert result["accuracy"] > 0.5

    # the final weights carry the training images' normalisation: eval's model is the trainer's
    model, tokenizer = load_run(run, images=True)
    assert tokenizer is None and model.std.min() > 0 and model.mean.max() > 0
    with pytest.raises(EmberError, match="image classifier"):
        load_run(run)  # generate, serve, export: a language model only
    assert ember("generate", str(run), "--prompt", "x").returncode == 2

    r = ember("report", str(run))
    assert r.returncode == 0, r.stderr
    plots = {p.name for p in (run / "plots").glob("*.png")}
    assert {"loss.png", "val_accuracy.png", "train_accuracy.png"} <= plots

    r = ember("analyze", str(run), "profile", "--steps", "2")
    assert r.returncode == 0, r.stderr
    profile = json.loads((run / "analysis" / "profile" / "results.json").read_text())
    assert {"data", "forward", "backward", "optimizer"} <= set(profile["split_s"])


def test_data_stats_prints_the_splits_and_class_balance():
    r = ember("data", "stats", "digits")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()[2:5]}
    assert [rows[s][1] for s in ("train", "val", "test")] == ["1169", "269", "359"]


def test_resume_is_bitwise(tmp_path):
    """A run cut back to its step-6 checkpoint and resumed ends where the unbroken run does:
    every loss and every weight (augmented batches: a pure function of seed and step)."""
    common = [*LAYER, "data.augment=true", "train.ckpt_every=6"]
    train(digits(tmp_path, *common, "run.name=whole"))
    whole, legs = tmp_path / "whole", tmp_path / "legs"
    shutil.copytree(whole, legs)
    for folder in ("checkpoints/step-000012", "model", "model-best"):
        shutil.rmtree(legs / folder)
    (legs / "summary.json").unlink()
    kept = [
        line for line in (legs / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 6
    ]
    (legs / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    train(digits(tmp_path, *common, "run.name=legs", "train.resume=auto"))
    assert losses(legs) == losses(whole) and len(losses(whole)) == 12
    a, _ = load_run(whole, images=True)
    b, _ = load_run(legs, images=True)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("kind", ["mlp", "cnn", "vit"])
def test_accumulation_matches_one_micro_batch(tmp_path, kind):
    """The same global batch of 64 as 1 × 64 or 4 × 16 micro-batches: the same losses (fp32)."""
    common = [*LAYER, f"model.kind={kind}", "train.max_steps=3", "train.eval_every=0"]
    train(digits(tmp_path, *common, "run.name=one"))
    train(digits(tmp_path, *common, "run.name=four", "train.micro_batch=16"))
    one, four = losses(tmp_path / "one"), losses(tmp_path / "four")
    assert sorted(one) == sorted(four) == [1, 2, 3]
    assert all(abs(one[s] - four[s]) <= 1e-5 for s in one), (one, four)


def test_compiled_matches_eager(tmp_path):
    common = [*LAYER, "model.kind=mlp", "train.max_steps=3", "train.eval_every=0"]
    train(digits(tmp_path, *common, "run.name=eager"))
    train(digits(tmp_path, *common, "run.name=compiled", "train.compile=true"))
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert all(abs(eager[s] - compiled[s]) <= 1e-5 for s in eager), (eager, compiled)


def test_mixed_precision_trains_close_to_fp32(tmp_path):
    """Autocast to bf16, and to fp16 with its loss scaler, on the CPU: the same losses to the
    precision's noise."""
    common = ["train.max_steps=3", "train.eval_every=0", "model.kind=mlp", "model.norm=layernorm"]
    train(digits(tmp_path, *common, "run.name=fp32"))
    for precision in ("bf16", "fp16"):
        train(digits(tmp_path, *common, f"run.name={precision}", f"train.precision={precision}"))
        full, half = losses(tmp_path / "fp32"), losses(tmp_path / precision)
        assert all(abs(full[s] - half[s]) <= 0.05 * full[s] for s in full), (precision, full, half)


@pytest.mark.parametrize("optimizer", ["sgd", "muon"])
def test_sgd_and_muon_train_a_classifier(tmp_path, optimizer):
    """SGD (Nesterov momentum; decay on matrices only, AdamW's groups) and Muon (the MLP's hidden
    matrices; AdamW elsewhere) beside AdamW."""
    settings = {
        "sgd": ["train.optimizer=sgd", "train.nesterov=true", "train.lr=0.05"],
        "muon": ["train.optimizer=muon", "train.lr=0.01"],
    }
    steps = ["train.max_steps=30", "train.eval_every=0"]
    cfg = digits(tmp_path, "model.kind=mlp", *settings[optimizer], *steps, f"run.name={optimizer}")
    trainer = Trainer(cfg)
    groups = trainer.optimizer.param_groups
    if optimizer == "sgd":
        assert isinstance(trainer.optimizer, torch.optim.SGD)
        assert all(g["nesterov"] and g["momentum"] == 0.9 for g in groups)
        assert sorted(g["weight_decay"] for g in groups) == [0.0, cfg.train.weight_decay]
    else:
        hidden = [p for g in groups if g.get("use_muon") for p in g["params"]]
        assert hidden and all(p.ndim == 2 for p in hidden)
    trainer.run()
    seen = losses(tmp_path / optimizer)
    assert seen[30] < 0.6 * seen[1], seen


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["model.kind=gpt", "model.norm=layernorm"], "model.kind=mlp, cnn or vit"),
        (["train.seq_len=8"], "train.seq_len=1"),
        (["train.kernels=triton"], "does not take train.kernels"),
        (["model.classes=7"], "model.classes=10"),
        (["data.sources=[mnist:/nowhere]"], "mnist"),
    ],
)
def test_refusals_name_the_fix(tmp_path, overrides, match):
    with pytest.raises(EmberError, match=match):
        Trainer(digits(tmp_path, *overrides))


def test_no_shards_and_no_model_parallel_for_images(tmp_path):
    r = ember("data", "prepare", "digits")
    assert r.returncode == 2 and "images need no preparation" in r.stderr
    for layout in ("parallel.tp=2", "parallel.pp=2"):
        with pytest.raises(ConfigError, match="one device or data parallel"):
            check_layout(digits(tmp_path, layout), 2)


def test_a_language_task_refuses_a_classifier(tiny_cfg):
    with pytest.raises(ConfigError, match="train.task=classify"):
        Trainer(tiny_cfg("model.kind=mlp"))
