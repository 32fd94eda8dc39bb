"""Tensor parallel and HSDP on CPU (gloo, fp32): every layout's per-step losses equal one
process's within 1e-5 over 5 steps on the same data (TP2 with the Llama layout and GQA, with
the GPT-2 layout and tied embeddings, with Muon, with sequence parallel; FSDP2 x TP2 and HSDP
2 x 2 on 4 ranks); a TP
checkpoint resumes on one process with the same losses and its weights are read by `ember
eval`; impossible layouts fail before launch."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from ember.train.trainer import train
from tests.test_trainer import DET, _child_env, _torchrun, losses, run_dir

GPT2 = ["model.pos=learned", "model.norm=layernorm", "model.mlp=gelu", "model.bias=true",
        "model.tie_embeddings=true", "model.n_kv_head=0"]  # fmt: skip
STEPS = ["train.max_steps=5", "train.eval_every=0"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "nproc", "model", "layout"),
    [
        ("tp2-llama-gqa", 2, [], ["parallel.tp=2"]),
        ("tp2-gpt2-tied", 2, GPT2, ["parallel.tp=2"]),
        ("tp2-muon", 2, ["train.optimizer=muon"], ["parallel.tp=2"]),
        ("fsdp2xtp2", 4, [], ["parallel.tp=2", "parallel.data=fsdp"]),
        ("tp2-sp", 2, [], ["parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("hsdp-2x2", 4, [], ["parallel.dp_replicate=2", "parallel.data=fsdp", "train.micro_batch=2"]),
    ],
)
def test_tensor_parallel_matches_one_process(tiny_cfg, tmp_path, name, nproc, model, layout):
    single = tiny_cfg(*DET, *STEPS, *model, "run.name=single")
    train(single)
    want = losses(run_dir(single))
    got = _torchrun(tmp_path, name, *STEPS, *model, *layout, data_dir=single.data.dir, nproc=nproc)
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), (got, want)


@pytest.mark.slow
def test_a_tp_checkpoint_resumes_on_one_process_and_its_weights_evaluate(tiny_cfg, tmp_path):
    data_dir = tiny_cfg().data.dir
    ck = ["train.max_steps=6", "train.ckpt_every=3", "train.eval_every=0"]
    got = _torchrun(tmp_path, "tp", *ck, "parallel.tp=2", data_dir=data_dir)
    rd = tmp_path / "tp"
    shutil.rmtree(rd / "checkpoints" / "step-000006")
    (rd / "metrics.jsonl").write_text("")
    cfg = tiny_cfg(*DET, *ck, "train.resume=auto")
    cfg.run.out_dir, cfg.run.name = str(tmp_path), "tp"
    train(cfg)
    resumed = losses(rd)
    assert sorted(resumed) == [4, 5, 6]
    assert all(abs(resumed[s] - got[s]) <= 1e-5 for s in resumed), (resumed, got)
    r = subprocess.run([sys.executable, "-m", "ember", "eval", str(rd), "--split", "val"], env=_child_env(),
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0 and (rd / "eval.json").is_file(), r.stderr[-2000:]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "2", "parallel.tp=2", "model.n_kv_head=1"], "must divide model.n_kv_head (1)"),
        (["--nproc", "3", "parallel.tp=2"], "needs a multiple of 2 ranks, not 3"),
        (["--nproc", "4", "parallel.tp=2"], "set parallel.data=fsdp"),
        (["--nproc", "2", "parallel.tp=2", "train.task=sft"], "not train.task=sft"),
        (["--nproc", "4", "parallel.dp_replicate=2"], "HSDP, a form of FSDP2: set parallel.data=fsdp"),
        (
            ["--nproc", "2", "parallel.tp=2", "parallel.sequence_parallel=true", "model.pos=learned"],
            "needs model.pos=rope",
        ),
        (["--nproc", "4", "parallel.data=fsdp"], "does not split into micro-batches of 4 on 4 rank(s)"),
        (
            ["--nproc", "6", "parallel.dp_replicate=2", "parallel.tp=2", "parallel.data=fsdp"],
            "multiple of 4 ranks, not 6",
        ),
    ],
)
def test_impossible_layouts_fail_before_any_rank_starts(tmp_path, args, message):
    cmd = [sys.executable, "-m", "ember", "train", "tiny", f"run.out_dir={tmp_path}", *args]
    r = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert "launching" not in r.stdout and "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())  # nothing written
