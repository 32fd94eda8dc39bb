"""``ember eval``: the same numbers as the trainer's evaluation, any text, bad runs."""

import json
import shutil

import pytest
import torch

from ember.cli import main
from ember.errors import EmberError
from ember.infer.evaluate import evaluate_run
from ember.run import load_run
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


def test_val_split_matches_the_trainer(run, monkeypatch):
    """With disjoint windows, the eval of the whole val split equals the trainer's LMTask.evaluate
    over the same windows, and every token is scored once; the trainer's evaluation, a row of
    fp32 logits at a time, gives what it gives on the whole batch at once."""
    import numpy as np

    from ember.data.loader import TokenDataset, ValLoader
    from ember.infer.evaluate import score, split_text
    from ember.train.tasks.lm import LMTask

    model, tok = load_run(run)
    data_dir = _data_dir(run)
    tokens, strata = split_text(data_dir, "val")
    n_full = (len(tokens) - 1) // 32
    cut = tokens[: n_full * 32 + 1]  # only full windows: exactly the ValLoader's
    token_bytes = torch.tensor(tok.token_byte_lengths(model.cfg.vocab_size))
    ours = score(model, cut, token_bytes, strata, 32, eos_id=tok.eos_id)
    loader = ValLoader(TokenDataset(data_dir, "val"), 32, 4)
    assert loader.n_windows == n_full
    theirs = LMTask(0.0, token_bytes).evaluate(model, loader, torch.autocast("cpu", enabled=False))
    assert ours["loss"] == pytest.approx(theirs["val_loss"], abs=1e-5)
    assert ours["bpb"] == pytest.approx(theirs["val_bpb"], abs=1e-5)
    assert ours["tokens"] == n_full * 32
    monkeypatch.setattr("ember.train.tasks.lm.EVAL_BYTES", 1)  # one row at a time
    by_row = LMTask(0.0, token_bytes).evaluate(model, loader, torch.autocast("cpu", enabled=False))
    assert by_row == pytest.approx(theirs, rel=1e-6)

    results = evaluate_run(run, splits=["val"])
    r = results["val"]
    m = json.loads((data_dir / "manifest.json").read_text())["splits"]["val"]
    assert r["tokens"] == len(tokens) - 1 == m["tokens"] - 1  # every target token, the tail too
    first = int(token_bytes[int(tokens[0])])  # the first token is context, never a target
    assert r["documents"] == m["documents"] and r["bytes"] == m["bytes"] - first
    tail = 1 if (len(tokens) - 1) % 32 else 0  # a last, shorter window when the split has a rest
    assert r["windows"] == r["windows_total"] == n_full + tail
    assert np.isfinite(r["bpb"]) and r["bpb"] > 0


def _data_dir(run):
    from pathlib import Path

    import yaml

    return Path(yaml.safe_load((run / "config.yaml").read_text())["data"]["dir"])


def test_windows_score_every_target_once():
    from ember.infer.evaluate import windows

    for n, seq_len, stride in [
        (2, 8, 8),
        (9, 8, 8),
        (10, 8, 8),
        (100, 8, 8),
        (100, 8, 3),
        (100, 8, 1),
        (5, 8, 2),
    ]:
        hits = [0] * n
        for start, length, first in windows(n, seq_len, stride):
            assert length == min(seq_len, n - 1) and 0 <= start and start + length <= n - 1
            for j in range(first, length):
                hits[start + 1 + j] += 1
            if stride < seq_len and start > 0:
                assert first == length - stride or start + length == n - 1  # full context for the rest
        assert hits == [0] + [1] * (n - 1), (n, seq_len, stride)


def test_stride_per_stratum_and_eval_json_accumulates(run, tmp_path):
    from ember.infer.evaluate import score, split_text

    model, tok = load_run(run)
    tokens, strata = split_text(_data_dir(run), "val")
    tb = torch.tensor(tok.token_byte_lengths(model.cfg.vocab_size))
    full = score(model, tokens, tb, strata, 32, eos_id=tok.eos_id)
    strided = score(model, tokens, tb, strata, 32, stride=8, eos_id=tok.eos_id)
    assert strided["tokens"] == full["tokens"] and strided["bytes"] == full["bytes"]
    assert strided["loss"] < full["loss"]  # more context per scored token
    # strata split the totals exactly: two strata made by cutting the split in half
    half = [dict(strata[0], name="a"), dict(strata[0], name="b", offset=len(tokens) // 2)]
    parts = score(model, tokens, tb, half, 32, eos_id=tok.eos_id)
    a, b = parts["strata"]["a"], parts["strata"]["b"]
    assert a["tokens"] + b["tokens"] == full["tokens"] and a["bytes"] + b["bytes"] == full["bytes"]
    nats = a["loss"] * a["tokens"] + b["loss"] * b["tokens"]
    assert nats / full["tokens"] == pytest.approx(full["loss"], rel=1e-9)
    capped = score(model, tokens, tb, strata, 32, max_windows=3, eos_id=tok.eos_id)
    assert (capped["windows"], capped["tokens"]) == (3, 3 * 32) and capped["windows_total"] > 3

    (run / "eval.json").unlink(missing_ok=True)
    evaluate_run(run, splits=["val"])
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 50)
    evaluate_run(run, [str(text)])
    record = json.loads((run / "eval.json").read_text())["results"]
    assert set(record) == {"val", str(text)}  # the val result is kept


def test_eval_cli_prints_paths_literally_and_counts(run, tmp_path, capsys):
    corpus = tmp_path / "c"
    corpus.mkdir()
    for name in ("test_a1.py", "test_b2.py", "test_z.py"):
        (corpus / name).write_text(f"# {name}\nimport os\nprint(os.getcwd())\n" * 20)
    glob = str(corpus / "test_[a-c]*.py")
    assert main(["eval", str(run), "--data", glob, "--split", "val", "--stride", "16"]) == 0
    out = capsys.readouterr().out
    assert "test_[a-c]*.py" in out.replace("\n", "")
    r = json.loads((run / "eval.json").read_text())["results"][glob]
    assert r["documents"] == 2 and r["stride"] == 16
    assert main(["eval", str(run), "--split", "val", "--stride", "64"]) == 2  # beyond the window


def test_test_split(run):
    train = evaluate_run(run, splits=["train"], max_windows=4)["train"]
    assert (train["windows"], train["tokens"]) == (4, 4 * 32) and train["windows_total"] > 4
    r = evaluate_run(run, splits=["test"])["test"]
    m = json.loads((_data_dir(run) / "manifest.json").read_text())["splits"]["test"]
    assert r["documents"] == m["documents"] and m["bytes"] - 8 <= r["bytes"] < m["bytes"]


def test_any_source_and_checkpoints(run, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    last = evaluate_run(run, [str(text)], ckpt="last")[str(text)]
    step6 = evaluate_run(run, [str(text)], ckpt="6")[str(text)]
    step12 = evaluate_run(run, [str(text)], ckpt="step-000012")[str(text)]
    assert last["loss"] == pytest.approx(step12["loss"], abs=1e-6)  # final weights = last step
    assert step6["loss"] != pytest.approx(last["loss"], abs=1e-4)
    assert last["bpb"] > 0 and last["documents"] == 1


def test_bad_runs(run, tmp_path):
    with pytest.raises(EmberError, match="does not exist"):
        load_run(tmp_path / "nope")
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    with pytest.raises(EmberError, match="no checkpoint step-000007.*newest: step-000012"):
        load_run(broken, "7")
    cfg = json.loads((broken / "model" / "model_config.json").read_text())
    cfg["vocab_size"] = 100
    (broken / "model" / "model_config.json").write_text(json.dumps(cfg))
    with pytest.raises(EmberError, match="does not match the weights"):
        load_run(broken)
    shutil.rmtree(broken / "model")
    with pytest.raises(EmberError, match="model_config.json not found"):
        load_run(broken)
    assert main(["eval", str(broken)]) == 2


@pytest.mark.parametrize("verb", ["eval", "generate", "load_run"])
def test_damaged_run_files_are_named(run, tmp_path, capsys, verb):
    """A truncated weights file or a model config that is not JSON: an EmberError naming the
    file, from the one loader every verb uses, and exit code 2 at the command line."""

    def load(path):
        if verb == "load_run":
            with pytest.raises(EmberError) as e:
                load_run(path)
            return str(e.value)
        assert main([verb, str(path), *(["--prompt", "def "] if verb == "generate" else [])]) == 2
        return capsys.readouterr().err

    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    weights = broken / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    message = load(broken)
    assert f"cannot load {weights}" in message and "truncated" in message
    weights.write_bytes((run / "model" / "model.safetensors").read_bytes())
    config = broken / "model" / "model_config.json"
    config.write_text(config.read_text()[:-10])  # cut short: not JSON any more
    assert f"{config} is not a valid model config" in load(broken)


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
    # one Sampling checks the options of generate and chat alike, before any weights load
    assert main(["generate", "no-such-run", "--prompt", "a", "--top-p", "2"]) == 2
    assert main(["chat", "no-such-run", "--top-p", "2"]) == 2
    assert capsys.readouterr().err.count("--top-p must be in (0, 1]") == 2


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


def test_document_interval_matches_a_plain_bootstrap():
    import math

    import numpy as np

    from ember.infer.evaluate import document_ci95

    rng = np.random.default_rng(1)
    tokens = rng.integers(50, 500, size=60).astype(float)
    nats = tokens * rng.uniform(1.0, 5.0, size=60)  # documents of very different difficulty
    nbytes = tokens * 3.5
    per_doc = np.stack([nats, tokens, nats, nbytes], axis=1)
    ci = document_ci95(per_doc)
    point = nats.sum() / tokens.sum()
    assert ci["loss_ci95"][0] < point < ci["loss_ci95"][1]
    idx = rng.integers(0, 60, size=(20000, 60))  # the textbook bootstrap: resample documents
    plain = nats[idx].sum(1) / tokens[idx].sum(1)
    assert ci["loss_ci95"] == pytest.approx(list(np.quantile(plain, [0.025, 0.975])), rel=0.02)
    assert ci["bpb_ci95"] == pytest.approx([v / 3.5 / math.log(2) for v in ci["loss_ci95"]], rel=1e-9)
    same = document_ci95(np.tile([[300.0, 100.0, 300.0, 350.0]], (10, 1)))
    assert same["loss_ci95"] == pytest.approx([3.0, 3.0])
    assert document_ci95(per_doc[:1]) == {"loss_ci95": None, "bpb_ci95": None}
