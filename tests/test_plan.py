"""`ember plan`: the bytes predicted per rank (parameters, gradients, optimizer state, the
activations and gradients live at the peak, and the peak) against a live-storage tracker over a
real step, within 10%, for tiny and cpu-quick's model under one process, FSDP2, TP2 and PP2 (the
three layouts of both in one torchrun launch); the predicted parameter shards by hand; the
tracker against a hand count; the CLI's tables and its refusal of an impossible layout."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ember.analysis import plan
from ember.config import load_config
from tests.test_pp import _launch_legs
from tests.test_trainer import _child_env

# cpu-quick's model and batch (d 128, 4 layers, 2 heads, vocabulary 4096, 16 × 256 a micro-batch)
# on the tiny corpus, which the suite prepares anyway
CPU_QUICK = ["model.vocab_size=4096"]
LAYOUTS = {
    "fsdp2": ["parallel.data=fsdp"],
    "tp2": ["parallel.tp=2"],
    "pp2": ["parallel.pp=2", "model.tie_embeddings=false"],
}


def _within(predicted: dict, measured: dict, what: str) -> None:
    for key in plan.COMPONENTS:
        off = plan.difference(predicted[key], measured[key], measured["peak"])
        assert off <= 0.10, (what, key, predicted[key], measured[key])


def _cfg(tiny_cfg, config: str, *overrides):
    data = tiny_cfg().data.dir
    return load_config(config, [f"data.dir={data}", "train.device=cpu", *overrides])


@pytest.mark.parametrize(("config", "extra"), [("tiny", []), ("cpu-quick", CPU_QUICK)])
def test_one_process_prediction_is_within_10_percent(tiny_cfg, config, extra):
    cfg = _cfg(tiny_cfg, config, *extra)
    predicted = plan.predict(cfg, plan.model_config_for(cfg), 1)[0]
    measured = plan.measure_config(cfg)[0]
    assert predicted["params"] == measured["params"] > 0
    _within(predicted, measured, config)


@pytest.mark.slow
def test_fsdp2_tp2_pp2_predictions_are_within_10_percent(tiny_cfg, tmp_path):
    legs = {}
    for config, extra in (("tiny", []), ("cpu-quick", [*CPU_QUICK, "train.micro_batch=8"])):
        for name, layout in LAYOUTS.items():
            overrides = [f"data.dir={tiny_cfg().data.dir}", "train.device=cpu", *extra, *layout]
            legs[f"{config}-{name}"] = {"config": config, "overrides": overrides, "plan": str(tmp_path / f"{config}-{name}.json")}  # fmt: skip # noqa: E501
    _launch_legs(tmp_path, 2, legs)
    for name, leg in legs.items():
        result = json.loads(Path(leg["plan"]).read_text())
        assert len(result["measured"]) == 2
        for predicted, measured in zip(result["predicted"], result["measured"], strict=True):
            _within(predicted, measured, f"{name} rank {predicted['rank']}")


def test_parameter_shards_by_hand():
    """tiny's wq (64 × 64) and w2 (64 × 192), its embedding (512 × 64) and a norm (64,)."""
    shape = plan._local_shape
    assert shape("layers.0.attention.wq.weight", (64, 64), tp=2, shard=1) == (32, 64)  # output rows
    assert shape("layers.0.mlp.w2.weight", (64, 192), tp=2, shard=1) == (64, 96)  # input columns
    assert shape("tok_embeddings.weight", (512, 64), tp=2, shard=1) == (256, 64)  # vocabulary rows
    assert shape("layers.0.attention_norm.weight", (64,), tp=2, shard=1) == (64,)  # whole
    assert shape("layers.0.mlp.w2.weight", (64, 192), tp=1, shard=3) == (22, 192)  # FSDP2: padded chunk
    cfg = load_config("tiny", ["model.vocab_size=512", "model.tie_embeddings=false", "parallel.pp=2"])
    ranks = plan.predict(cfg, cfg.model, 2)
    whole = sum(p.numel() for p in torch.nn.Module.parameters(_gpt(cfg)))
    assert ranks[0]["params"] + ranks[1]["params"] == 4 * whole  # the stages partition the model
    assert ranks[0]["stages"] == [0] and ranks[1]["stages"] == [1]


def _gpt(cfg):
    from ember.model.gpt import GPT

    with torch.device("meta"):
        return GPT(cfg.model)


def test_tracker_counts_what_lives_and_frees_what_dies():
    model = torch.nn.Linear(256, 256, bias=False)  # 256 KiB of weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = plan.StorageTracker(model, optimizer)
    with tracker:
        a = torch.ones(1024, 256)  # 1 MiB, kept
        b = torch.ones(2048, 256)  # 2 MiB, dropped
        del b
        c = torch.ones(512, 256)  # 0.5 MiB: the peak was at b
    assert tracker.peak == 2**18 + 2**20 + 2**21
    assert tracker.at_peak == {"params": 2**18, "grads": 0, "optimizer": 0, "activations": 2**20 + 2**21}
    assert tracker.total == 2**18 + 2**20 + 2**19
    del a, c


def test_cli_prints_the_plan_and_refuses_an_impossible_layout(tiny_cfg, tmp_path, capsys):
    data = tiny_cfg().data.dir
    cmd = [sys.executable, "-m", "ember", "plan", "tiny", f"data.dir={data}", "--nproc", "2", "parallel.tp=2",
           "--peak-tflops", "1", "--memory", "0.05"]  # fmt: skip
    r = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "predicted bytes per rank" in r.stdout and "FLOPs per step: 2.144e+08" in r.stdout
    assert "s a step" in r.stdout
    assert "largest micro-batch whose predicted peak fits in 0.05 GiB: train.micro_batch=" in r.stdout
    for memory in (None, 0.05):  # --json (in this process), on a CPU: no memory unless given
        plan.plan_command("tiny", [f"data.dir={data}"], 1, False, 4, True, None, 0.4, memory_gib=memory)
        fits = json.loads(capsys.readouterr().out)["fits"]
        assert fits is None if memory is None else fits["memory_gib"] == 0.05 and fits["micro_batch"] >= 1
    bad = [sys.executable, "-m", "ember", "plan", "tiny", f"data.dir={data}", "--nproc", "3", "parallel.tp=2"]
    r = subprocess.run(bad, env=_child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs a multiple of 2 ranks, not 3" in r.stderr


def test_the_largest_micro_batch_that_fits_a_memory(tiny_cfg):
    """``ember plan --memory``: of the micro-batches that keep the global batch (divisors of a
    rank's rows), the largest whose predicted peak fits; the next larger does not."""
    cfg = _cfg(tiny_cfg, "tiny", "train.batch_tokens=1536", "train.seq_len=64")  # 24 rows: 8 divisors
    model_cfg = plan.model_config_for(cfg)

    def peak(rows):
        trial = _cfg(tiny_cfg, "tiny", "train.batch_tokens=1536", "train.seq_len=64", f"train.micro_batch={rows}")  # fmt: skip # noqa: E501
        return plan.predict(trial, model_cfg, 1)[0]["peak"]

    sizes = [1, 2, 3, 4, 6, 8, 12, 24]
    peaks = [peak(rows) for rows in sizes]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)  # grows with the rows
    budget = (peaks[3] + peaks[4]) / 2  # between two sizes' peaks: the smaller
    assert plan.fitting_micro_batch(cfg, model_cfg, 1, budget) == (sizes[3], peaks[3])
    assert plan.fitting_micro_batch(cfg, model_cfg, 1, peaks[-1]) == (24, peaks[-1])
    assert plan.fitting_micro_batch(cfg, model_cfg, 1, peaks[0] - 1) is None
    pairs = replace(cfg, train=replace(cfg.train, task="dpo"))  # a micro-batch of whole pairs: even
    assert plan.fitting_micro_batch(pairs, model_cfg, 1, (peaks[2] + peaks[3]) / 2) == (sizes[1], peaks[1])
