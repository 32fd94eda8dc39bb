"""Pipeline parallel on CPU (gloo, fp32), against one process on the same data: GPipe, 1F1B and
interleaved 1F1B on 2 ranks, PP2 x FSDP2, PP2 x TP2 (with sequence parallel) and interleaved x
FSDP2 on 4, PP2 x FSDP2 x TP2 on 8, each with per-step losses and the evaluation's loss within
1e-5 over 6 steps;
checkpoints move PP2 -> 1 process and 1 process -> PP2; `ember eval` reads the weights a PP run
writes; impossible pipelines fail before launch. One torchrun launch runs several layouts
(tests/legs.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ember.cli import main
from ember.parallel.pipeline import stage_layers
from ember.run import read_metrics
from ember.train.trainer import train
from tests.test_trainer import DET, _child_env, assert_refused_before_launch, losses

BASE = [*DET, "model.tie_embeddings=false", "model.n_layer=4", "train.max_steps=6", "train.ckpt_every=3",
        "train.eval_every=3", "train.micro_batch=2"]  # fmt: skip
PP2 = ["parallel.pp=2"]
FSDP = ["parallel.data=fsdp"]
TWO = {
    "gpipe": [*PP2, "parallel.pp_schedule=gpipe"],
    "1f1b": [*PP2, "parallel.pp_schedule=1f1b"],
    "interleaved": [*PP2, "parallel.pp_schedule=interleaved-1f1b"],  # 2 stages per rank
}
FOUR = {
    "pp2xfsdp2": [*PP2, *FSDP],
    "pp2xtp2-sp": [*PP2, "parallel.tp=2", "parallel.sequence_parallel=true"],
    "interleavedxfsdp2": [*PP2, *FSDP, "parallel.pp_schedule=interleaved-1f1b"],
}
EIGHT = {"pp2xfsdp2xtp2": [*PP2, *FSDP, "parallel.tp=2"]}  # 3-D: 8 processes on the 2 cores, ~25 s


def _launch(tmp_path: Path, nproc: int, legs: dict[str, list[str]], tiny_cfg) -> None:
    common = [f"data.dir={tiny_cfg().data.dir}", "data.val_fraction=0.1", f"run.out_dir={tmp_path}",
              "train.device=cpu", *BASE]  # fmt: skip
    _launch_legs(tmp_path, nproc, {name: [*common, f"run.name={name}", *o] for name, o in legs.items()})


def _launch_legs(tmp_path: Path, nproc: int, legs: dict) -> None:
    """One launch of ``nproc`` ranks, forked by tests/legs.py, running every leg."""
    spec = tmp_path / f"legs-{nproc}.json"
    spec.write_text(json.dumps(legs))
    cmd = [sys.executable, str(Path(__file__).with_name("legs.py")), str(nproc), str(spec)]
    env = _child_env() | {"PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _val(run: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in read_metrics(run) if "val_loss" in r}


def _cut_at_3(run: Path) -> None:
    """Make ``run`` look stopped after its step-3 checkpoint."""
    shutil.rmtree(run / "checkpoints" / "step-000006")
    shutil.rmtree(run / "model", ignore_errors=True)
    (run / "summary.json").unlink(missing_ok=True)
    (run / "metrics.jsonl").write_text("")


def _close(got: dict, want: dict, steps: list[int]) -> None:
    assert sorted(got) == steps, got
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in got), (got, want)


def test_stage_layers_are_contiguous_and_balanced():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert [len(r) for r in stage_layers(12, 8)] == [2, 2, 2, 2, 1, 1, 1, 1]


@pytest.mark.slow
def test_pipeline_layouts_and_checkpoints_match_one_process(tiny_cfg, tmp_path):
    single = tiny_cfg(*BASE, f"run.out_dir={tmp_path}", "run.name=single")
    train(single)
    want, want_val = losses(tmp_path / "single"), _val(tmp_path / "single")
    assert sorted(want) == [1, 2, 3, 4, 5, 6] and sorted(want_val) == [3, 6]

    shutil.copytree(tmp_path / "single", tmp_path / "1-to-pp2")  # saved by 1 process, resumed under PP2
    _cut_at_3(tmp_path / "1-to-pp2")
    _launch(tmp_path, 2, TWO | {"1-to-pp2": [*TWO["interleaved"], "train.resume=auto"]}, tiny_cfg)
    _launch(tmp_path, 4, FOUR, tiny_cfg)
    _launch(tmp_path, 8, EIGHT, tiny_cfg)
    for name in [*TWO, *FOUR, *EIGHT]:
        _close(losses(tmp_path / name), want, [1, 2, 3, 4, 5, 6])
        _close(_val(tmp_path / name), want_val, [3, 6])  # the evaluation's forward, stage to stage
    _close(losses(tmp_path / "1-to-pp2"), want, [4, 5, 6])

    shutil.copytree(tmp_path / "1f1b", tmp_path / "pp2-to-1")  # saved by PP2, resumed by 1 process
    _cut_at_3(tmp_path / "pp2-to-1")
    again = tiny_cfg(*BASE, f"run.out_dir={tmp_path}", "run.name=pp2-to-1", "train.resume=auto")
    train(again)
    _close(losses(tmp_path / "pp2-to-1"), want, [4, 5, 6])

    evals = {}  # `ember eval` on the weights that rank 0 gathered from the stages at the end
    for name in ("single", "pp2xtp2-sp"):
        assert main(["eval", str(tmp_path / name), "--split", "val"]) == 0
        evals[name] = json.loads((tmp_path / name / "eval.json").read_text())["results"]["val"]
    assert evals["single"]["tokens"] == evals["pp2xtp2-sp"]["tokens"] > 0
    assert abs(evals["single"]["loss"] - evals["pp2xtp2-sp"]["loss"]) <= 1e-5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "2", "parallel.pp=2"], "set model.tie_embeddings=false with parallel.pp"),
        (["--nproc", "2", "parallel.pp=2", "model.tie_embeddings=false", "parallel.pp_virtual_stages=2"],
         "= 4 stages, but the model has 2 layers"),
        (["--nproc", "2", "parallel.pp=2", "model.tie_embeddings=false", "train.micro_batch=8"],
         "needs at least as many micro-batches as stages: 1 < 2"),
        (["--nproc", "4", "parallel.pp=2", "model.tie_embeddings=false", "train.micro_batch=2"],
         "leaves 2 data-parallel groups, which shard with FSDP2"),
        (["--nproc", "2", "parallel.pp=2", "model.tie_embeddings=false", "parallel.pp_microbatches=3"],
         "8 rows per step do not split into 3 equal micro-batches"),
        (["--nproc", "3", "parallel.pp=2"], "parallel.pp=2 needs a multiple of 2 ranks, not 3"),
    ],
)  # fmt: skip
def test_impossible_pipelines_fail_before_any_rank_starts(tmp_path, args, message):
    assert_refused_before_launch(tmp_path, args, message)
