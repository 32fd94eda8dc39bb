"""Tensor parallel and HSDP on CPU (gloo, fp32): every layout's per-step losses equal one
process's within 1e-5 over 5 steps on the same data (TP2 with the Llama layout and GQA, with
the GPT-2 layout and tied embeddings, with Muon, with sequence and loss parallel; compiled
blocks under TP2 against eager; FSDP2 x TP2 and HSDP
2 x 2 on 4 ranks); checkpoints move between layouts (TP2 -> 1 process, 1 -> TP2, TP2 -> DDP2,
FSDP2 x TP2 -> 1) with the same losses; `ember eval` reads the weights a TP run writes; a NaN
weight stops a TP run with the module named, and `ember analyze RUN nonfinite` replays a TP
run's step in one process;
impossible layouts fail before launch. The layouts of one world size run in one torchrun launch
(tests/legs.py)."""

from __future__ import annotations

import shutil

import pytest

from ember.cli import main
from ember.train.trainer import train
from tests.test_trainer import DET, assert_refused_before_launch, losses

GPT2 = ["model.pos=learned", "model.norm=layernorm", "model.mlp=gelu", "model.bias=true",
        "model.tie_embeddings=true", "model.n_kv_head=0"]  # fmt: skip
STEPS = ["train.max_steps=5", "train.eval_every=0"]


TWO = {  # name: (model overrides, layout)
    "tp2-llama-gqa": ([], ["parallel.tp=2", "train.compile=true"]),  # compiled blocks against eager
    "tp2-gpt2-tied": (GPT2, ["parallel.tp=2"]),
    "tp2-muon": (["train.optimizer=muon"], ["parallel.tp=2"]),
    "tp2-sp-lp": ([], ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.loss_parallel=true"]),
}
FOUR = {
    "fsdp2xtp2": ([], ["parallel.tp=2", "parallel.data=fsdp"]),
    "hsdp-2x2": (
        [],
        ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.data=fsdp", "train.micro_batch=2"],
    ),
}


LAYOUTS = {
    "single": (1, []),
    "tp2": (2, ["parallel.tp=2"]),
    "ddp2": (2, ["parallel.data=ddp"]),
    "fsdp2xtp2": (4, ["parallel.tp=2", "parallel.data=fsdp"]),
}
MOVES = {f"{a}-to-{b}": (a, b) for a, b in [("tp2", "single"), ("single", "tp2"), ("tp2", "ddp2"), ("fsdp2xtp2", "single")]}  # fmt: skip # noqa: E501
CK = ["train.max_steps=6", "train.ckpt_every=3", "train.eval_every=0", "train.micro_batch=2"]  # (4 ranks)


@pytest.mark.slow
def test_tensor_parallel_matches_one_process_and_checkpoints_move_between_layouts(tiny_cfg, tmp_path):
    """Every parity layout of one world size runs in one torchrun launch (tests/legs.py), beside
    the runs whose checkpoints then move; the moves resume in one more launch or in this
    process: three launches where one per layout and move took seven."""
    from ember.analysis.replay import nonfinite
    from tests.test_pp import _launch_legs

    want = {}
    for model in ([], GPT2, ["train.optimizer=muon"]):
        single = tiny_cfg(*DET, *STEPS, *model, f"run.out_dir={tmp_path}", f"run.name=single-{len(want)}")
        train(single)
        want[tuple(model)] = losses(tmp_path / single.run.name)
    data = tiny_cfg().data.dir
    common = [*DET, f"data.dir={data}", "data.val_fraction=0.1", f"run.out_dir={tmp_path}"]
    common.append("train.device=cpu")

    def moves(nproc: int, side: int, *extra) -> dict:  # moves whose side (0 saved, 1 resumed) has nproc
        return {run: [*common, *CK, f"run.name={run}", *LAYOUTS[ab[side]][1], *extra]
                for run, ab in MOVES.items() if LAYOUTS[ab[side]][0] == nproc}  # fmt: skip

    for nproc, legs in ((2, TWO), (4, FOUR)):
        spec = {name: [*common, *STEPS, f"run.name={name}", *model, *layout] for name, (model, layout) in legs.items()}  # fmt: skip # noqa: E501
        _launch_legs(tmp_path, nproc, spec | moves(nproc, 0))
        for name, (model, _) in legs.items():
            got = losses(tmp_path / name)
            assert sorted(got) == [1, 2, 3, 4, 5], name
            assert all(abs(got[s] - want[tuple(model)][s]) <= 1e-5 for s in got), (name, got, want)
    replayed = nonfinite(tmp_path / "tp2-sp-lp", 3)  # `ember analyze RUN nonfinite` of a TP run, alone
    assert replayed["step"] == 3 and replayed["first_nonfinite"] is None
    for overrides in moves(1, 0).values():
        train(tiny_cfg(*overrides))

    saved = {run: losses(tmp_path / run) for run in MOVES}
    for run in MOVES:  # as if stopped after the step-3 checkpoint
        rd = tmp_path / run
        (rd / "model").rename(rd / "model-saved")  # (the TP run's, read by ember eval below)
        shutil.rmtree(rd / "checkpoints" / "step-000006")
        (rd / "metrics.jsonl").write_text("")
    tp2_sp_lp = [*TWO["tp2-sp-lp"][1], "run.name=tp2-nan", "train.report=false"]
    nan = {"config": "tiny", "nan": "layers.1.attention.wq.weight", "out": str(tmp_path / "nan.txt"),
           "overrides": [*common, *tp2_sp_lp]}  # fmt: skip
    _launch_legs(tmp_path, 2, moves(2, 1, "train.resume=auto") | {"tp2-nan": nan})
    # the non-finite guard replays the step on sharded outputs and logits, and names the module
    assert "step 1: loss or gradient norm is not finite; first non-finite output: layers.1.attention.wq." in (tmp_path / "nan.txt").read_text()  # fmt: skip # noqa: E501
    for overrides in moves(1, 1, "train.resume=auto").values():
        train(tiny_cfg(*overrides))
    for run in MOVES:
        again = losses(tmp_path / run)
        assert sorted(again) == [4, 5, 6], run
        assert all(abs(again[s] - saved[run][s]) <= 1e-5 for s in again), (run, again, saved[run])

    rd = tmp_path / "tp2-to-single"  # the weights the TP run wrote at its end
    shutil.rmtree(rd / "model")
    (rd / "model-saved").rename(rd / "model")
    assert main(["eval", str(rd), "--split", "val"]) == 0 and (rd / "eval.json").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "2", "parallel.tp=2", "model.n_kv_head=1"], "must divide model.n_kv_head (1)"),
        (["--nproc", "3", "parallel.tp=2"], "needs a multiple of 2 ranks, not 3"),
        (["--nproc", "4", "parallel.tp=2"], "set parallel.data=fsdp"),
        (["--nproc", "2", "parallel.tp=2", "train.task=sft"], "not train.task=sft"),
        (["--nproc", "4", "parallel.dp_replicate=2"], "(HSDP when both > 1): set parallel.data=fsdp"),
        (
            ["--nproc", "4", "parallel.data=fsdp", "parallel.dp_shard=3"],
            "= 1 × 1 × 3 × 1 = 3, but there are 4 ranks",
        ),
        (
            ["--nproc", "2", "parallel.tp=2", "parallel.sequence_parallel=true", "model.pos=learned"],
            "needs model.pos=rope",
        ),
        (["--nproc", "4", "parallel.data=fsdp"], "does not split into micro-batches of 4 on 4 rank(s)"),
        (
            ["--nproc", "2", "parallel.tp=2", "parallel.loss_parallel=true", "train.z_loss=1e-4"],
            "set train.z_loss=0",
        ),
        (
            ["--nproc", "6", "parallel.dp_replicate=2", "parallel.tp=2", "parallel.data=fsdp"],
            "multiple of 4 ranks, not 6",
        ),
    ],
)
def test_impossible_layouts_fail_before_any_rank_starts(tmp_path, args, message):
    assert_refused_before_launch(tmp_path, args, message)
