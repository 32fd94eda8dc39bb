"""The model card that `ember export --to hf` writes: Hub front matter, and every figure equal to
what the run's own files say (summary, eval results, data manifest), none typed by hand."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from ember.cli import main
from ember.data.manifest import read_manifest
from ember.infer.evaluate import evaluate_run, evaluate_task
from ember.run import load_run


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory):
    from ember.config import load_config
    from ember.train.trainer import train

    out = tmp_path_factory.mktemp("runs")
    overrides = [f"data.dir={tiny_data}", "data.val_fraction=0.1", f"run.out_dir={out}", "train.device=cpu"]
    train(load_config("tiny", [*overrides, "train.max_steps=6", "train.eval_every=3"]))
    run = out / "tiny"
    evaluate_run(run, splits=["test"], max_windows=8)
    evaluate_task(run, "add-2", n=4)
    return run


def card(folder):
    text = (folder / "README.md").read_text(encoding="utf-8")
    _, front, body = text.split("---\n", 2)
    return yaml.safe_load(front), body


def test_the_card_says_what_the_run_files_say(run, tmp_path):
    assert main(["export", str(run), "--to", "hf", str(tmp_path / "hf")]) == 0
    front, body = card(tmp_path / "hf")
    assert front["library_name"] == "transformers" and front["pipeline_tag"] == "text-generation"
    assert front["license"] == "other" and "LlamaForCausalLM" in front["tags"]
    manifest = read_manifest(yaml.safe_load((run / "config.yaml").read_text())["data"]["dir"])
    specs = [s["spec"] for s in manifest["sources"] + manifest["test_sources"]]
    assert front["datasets"] == specs and front["metrics"] == ["accuracy", "bits_per_byte", "perplexity"]

    model, _ = load_run(run)
    summary = json.loads((run / "summary.json").read_text())
    results = json.loads((run / "eval.json").read_text())["results"]
    test, task = results["test"], results["task:add-2"]
    lo, hi = test["bpb_ci95"]
    expected = [
        f"A {model.num_params():,}-parameter `LlamaForCausalLM`",
        f"| layers × width | {model.cfg.n_layer} × {model.cfg.d_model} |",
        f"| steps | {summary['step']:,} |",
        f"| tokens | {summary['tokens']:,} |",
        f"| last train loss | {summary['loss']:.4f} |",
        f"| best validation loss | {summary['best_val_loss']:.4f} (step {summary['best_step']}) |",
        f"{test['bpb']:.4f} bits/byte [{lo:.4f}, {hi:.4f}], perplexity {test['ppl']:.2f}",
        f"{test['documents']:,} documents, {test['tokens']:,} tokens, {test['bytes']:,} bytes",
        f"accuracy {task['accuracy']:.1%}",
        "| test | {documents:,} | {bytes:,} |".format(**manifest["splits"]["test"]),
        'AutoModelForCausalLM.from_pretrained("hf")',
    ]
    for line in expected:
        assert line in body, line


def test_an_imported_run_gets_a_card_that_says_what_is_not_recorded(run, tmp_path):
    imported = tmp_path / "imported"  # what `ember import` writes: weights and config, no history
    imported.mkdir()
    for name in ("config.yaml", "tokenizer.json"):
        shutil.copy(run / name, imported / name)
    shutil.copytree(run / "model", imported / "model")
    assert main(["export", str(imported), "--to", "hf", str(tmp_path / "hf")]) == 0
    front, body = card(tmp_path / "hf")
    assert front["datasets"] == [] and front["metrics"] == []
    assert "## Training\n\nNot recorded" in body and "## Evaluation\n\nNot evaluated yet" in body


def test_a_summary_missing_its_figures_says_so_instead_of_failing():
    """A damaged or older summary.json (no step, tokens or loss) still makes a card."""
    from ember.export.card import _training

    train = {"task": "lm", "optimizer": "adamw", "lr": 1e-3, "batch_tokens": 4096, "seq_len": 64}
    train["precision"] = "fp32"
    text = _training({"train": train}, {"elapsed_s": "?", "best_val_loss": 2.5}, {})
    assert "| steps | not recorded |" in text and "| last train loss | not recorded |" in text
    assert "| wall time | not recorded |" in text and "2.5000 (step ?)" in text
