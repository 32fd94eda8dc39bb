"""The trainer: exact resume, accumulation, budgets, non-finite guard, outputs, layouts."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ember.config import load_config
from ember.errors import ConfigError, EmberError
from ember.model.gpt import GPT
from ember.run import MARKER, latest_checkpoint, load_weights, read_metrics
from ember.train.trainer import NonFiniteError, Trainer, train

DET = ["train.deterministic=true", "train.precision=fp32"]
DROPOUT = ["model.dropout=0.1"]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def run_dir(cfg) -> Path:
    return Path(cfg.run.out_dir) / cfg.run.name


def _child_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("LOCAL_RANK", None)
    return env


def assert_refused_before_launch(tmp_path, args, message):
    """``ember train tiny ARGS`` exits 2 with ``message``, before torchrun starts, writing nothing.
    In-process, as tests/test_bad_inputs.py runs its table (a torch import per case was most of
    each case's cost): ``ember.cli.main`` returns the exit code, and any launch is an error."""
    import contextlib
    import io
    from unittest import mock

    from ember.cli import main

    out, err = io.StringIO(), io.StringIO()
    launch = mock.patch("ember.cli.subprocess.call", side_effect=AssertionError("torchrun was launched"))
    with launch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", "tiny", f"run.out_dir={tmp_path}", *args])
    assert code == 2 and message in err.getvalue(), err.getvalue()[-2000:]
    assert "launching" not in out.getvalue() and "Traceback" not in err.getvalue()
    assert not list(tmp_path.iterdir())  # nothing written


def test_exact_resume_is_bitwise(tiny_cfg):
    """With dropout, so that the losses after resume depend on the restored RNG state."""
    args = [*DET, *DROPOUT, "train.max_steps=8", "train.ckpt_every=4", "train.keep_last=3"]
    cfg = tiny_cfg(*args)
    train(cfg)
    full = losses(run_dir(cfg))
    assert sorted(full) == list(range(1, 9))
    # stop after step 4: keep only what existed then, and resume to 8
    rd = run_dir(cfg)
    shutil.rmtree(rd / "checkpoints" / "step-000008")
    lines = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
    (rd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines if r["step"] <= 4))
    train(tiny_cfg(*args, "train.resume=auto"))
    resumed = [r for r in read_metrics(rd) if "loss" in r]
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert {r["step"]: r["loss"] for r in resumed} == full  # bitwise equal floats


def test_half_written_checkpoint_is_ignored(tiny_cfg):
    cfg = tiny_cfg(*DET, "train.max_steps=4", "train.ckpt_every=2")
    train(cfg)
    ckpts = run_dir(cfg) / "checkpoints"
    assert latest_checkpoint(ckpts).name == "step-000004"
    (ckpts / "step-000004" / MARKER).unlink()  # as if killed before the commit
    assert latest_checkpoint(ckpts).name == "step-000002"
    (ckpts / "step-000006").mkdir()  # a folder with nothing in it
    assert latest_checkpoint(ckpts).name == "step-000002"


def test_sigkill_mid_run_resumes_from_last_commit(tiny_cfg, tmp_path):
    args = [
        "tiny",
        f"data.dir={tiny_cfg().data.dir}",
        "data.val_fraction=0.1",
        f"run.out_dir={tmp_path / 'k'}",
        "train.device=cpu",
        *DET,
        "train.max_steps=30",
        "train.ckpt_every=1",
        "train.eval_every=0",
        "train.report=false",
    ]
    ref = [a for a in args[1:] if not a.startswith(("run.out_dir=", "train.ckpt_every="))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (here, with the one thread of the processes below)
    try:
        train(load_config("tiny", [*ref, f"run.out_dir={tmp_path / 'ref'}", "train.ckpt_every=10"]))
    finally:
        torch.set_num_threads(threads)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ember", "train", *args],
        env=_child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ckpts = tmp_path / "k" / "tiny" / "checkpoints"
    deadline = time.time() + 120
    while latest_checkpoint(ckpts) is None or latest_checkpoint(ckpts).name < "step-000005":
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = latest_checkpoint(ckpts)
    assert killed_at is not None
    done = subprocess.run(
        [sys.executable, "-m", "ember", "train", *args, "train.resume=auto"],
        env=_child_env(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resumed from {killed_at}" in done.stdout
    want, got = losses(tmp_path / "ref" / "tiny"), losses(tmp_path / "k" / "tiny")
    assert sorted(got) == list(range(1, 31))
    assert got == want


def test_accumulation_matches_one_big_micro_batch(tiny_cfg):
    a = tiny_cfg(*DET, "run.name=a", "train.max_steps=3", "train.micro_batch=2", "train.eval_every=0")
    b = tiny_cfg(*DET, "run.name=b", "train.max_steps=3", "train.micro_batch=8", "train.eval_every=0")
    train(a), train(b)
    la, lb = losses(run_dir(a)), losses(run_dir(b))
    assert all(abs(la[s] - lb[s]) <= 1e-6 for s in la), (la, lb)


def test_cpu_gradient_norm_is_float64_accurate_where_torchs_is_not():
    """4 M gradient entries of 0.1 (norm 204.8): torch 2.13's CPU norm, one float32 accumulator,
    is 2.2e-3 off (pytorch#169237); clip_grad_norm's rows-then-float64 norm is within 1e-6, and
    clipping to half of it halves every entry."""
    from ember.train.trainer import clip_grad_norm

    w = torch.nn.Parameter(torch.zeros(4096, 1024))
    w.grad = torch.full_like(w, 0.1)
    b = torch.nn.Parameter(torch.zeros(7))
    b.grad = torch.full_like(b, 0.1)
    exact = math.sqrt((4096 * 1024 + 7) * 0.01)
    total = clip_grad_norm([w, b], max_norm=math.inf)
    assert total.dtype == torch.float32 and abs(total.item() / exact - 1) < 1e-6
    clip_grad_norm([w, b], max_norm=exact / 2)
    assert torch.allclose(w.grad, torch.full_like(w, 0.05), rtol=1e-5)


@pytest.mark.parametrize(
    "budget, expect_steps",
    [(["train.max_steps=7"], 7), (["train.max_steps=0", "train.max_tokens=1000"], 4)],  # 256 tokens/step
)
def test_step_and_token_budgets(tiny_cfg, budget, expect_steps):
    cfg = tiny_cfg(*budget, "train.eval_every=0")
    result = train(cfg)
    assert result["step"] == expect_steps
    assert max(losses(run_dir(cfg))) == expect_steps


def test_time_budget(tiny_cfg):
    cfg = tiny_cfg("train.max_steps=0", "train.max_time=2", "train.eval_every=0")
    result = train(cfg)
    assert result["elapsed_s"] >= 2.0 and result["step"] > 1
    steps = [r["step"] for r in read_metrics(run_dir(cfg)) if "loss" in r]
    assert steps == list(range(1, result["step"] + 1))  # it stopped at the first step past the budget
    step_records = [r for r in read_metrics(run_dir(cfg)) if "loss" in r]
    assert step_records[-2]["elapsed_s"] < 2.0 <= step_records[-1]["elapsed_s"]


def test_no_budget_and_bad_layout_fail_before_work(tiny_cfg):
    with pytest.raises(ConfigError, match="no training budget"):
        Trainer(tiny_cfg("train.max_steps=0"))
    with pytest.raises(ConfigError, match="micro-batches"):
        Trainer(tiny_cfg("train.micro_batch=3"))
    assert not run_dir(tiny_cfg()).exists()
    from ember.train.layout import check_layout  # what `ember train --nproc N` asks first

    with pytest.raises(ConfigError, match="not FSDP yet"):
        check_layout(tiny_cfg("train.lora_rank=4", "parallel.data=fsdp"), 2)
    grpo = tiny_cfg("train.task=grpo", "grpo.data=add-2", "train.seq_len=64", "train.batch_tokens=512")
    check_layout(grpo, 1)  # 8 completions: one group of 8
    with pytest.raises(ConfigError, match="multiple of 16"):
        check_layout(grpo, 2)
    # gpt2-small's 512 rows a step at 64 a micro-batch do not split over 16 ranks: say what does
    with pytest.raises(ConfigError, match=r"or set train\.micro_batch=32 \(32 rows a rank\)"):
        check_layout(load_config("gpt2-small"), 16)
    with pytest.raises(ConfigError, match=r"multiple of seq_len\*micro_batch\*ranks = 768$"):
        check_layout(tiny_cfg("train.micro_batch=3", "train.batch_tokens=384", "train.seq_len=64"), 4)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_stops_and_names_the_module(tiny_cfg, value):
    trainer = Trainer(tiny_cfg("train.max_steps=3"))
    with torch.no_grad():
        trainer.model.layers["1"].attention.wq.weight[0, 0] = value
    with pytest.raises(NonFiniteError, match=r"step 1: .*first non-finite output: layers\.1\.attention\.wq"):
        trainer.run()


def test_a_nonfinite_step_whose_rerun_runs_out_of_memory_still_says_non_finite(tiny_cfg, monkeypatch):
    """The rerun that locates the module is eager; at a compiled step's micro-batch it may not fit
    the device, and the run then stops as non-finite, not as out of memory at that micro-batch."""
    import ember.train.trainer as trainer_module

    def out_of_memory(*_):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 13.18 GiB")

    monkeypatch.setattr(trainer_module, "_find_nonfinite_module", out_of_memory)
    trainer = Trainer(tiny_cfg("train.max_steps=3"))
    with torch.no_grad():
        trainer.model.layers["1"].attention.wq.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"step 1: .*non-finite output: not located \(the eager rerun"):
        trainer.run()


def test_out_of_memory_names_the_micro_batch_and_the_fix(tiny_cfg):
    """A device out of memory (on a GPU: the preset's micro-batch on a smaller card) stops with
    an EmberError that says where and how to fix it, not torch's allocator dump."""
    trainer = Trainer(tiny_cfg("train.max_steps=3", "train.micro_batch=4"))
    real, calls = trainer.task.loss, {"n": 0}

    def hungry(model, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.07 GiB")
        return real(model, batch)

    trainer.task.loss = hungry
    with pytest.raises(EmberError, match=r"out of cpu memory in .* step \d, micro-batch 4 × \d+: `ember"):
        trainer.run()


def test_nonfinite_skip_counts_and_continues(tiny_cfg):
    trainer = Trainer(tiny_cfg("train.max_steps=5", "train.nonfinite=skip", "train.eval_every=0"))
    real = trainer.task.loss
    calls = {"n": 0}

    def flaky(model, batch):
        calls["n"] += 1
        loss, m = real(model, batch)
        return (loss * float("inf") if calls["n"] == 3 else loss), m

    trainer.task.loss = flaky
    result = trainer.run()
    assert trainer.skipped == 1 and result["step"] == 5
    summary = json.loads((trainer.run_dir / "summary.json").read_text())
    assert summary["skipped_steps"] == 1


def test_nonfinite_skip_every_step_still_ends_at_the_budget(tiny_cfg):
    trainer = Trainer(tiny_cfg("train.max_steps=3", "train.nonfinite=skip", "train.eval_every=0"))
    with torch.no_grad():
        trainer.model.layers["0"].mlp.w2.weight.fill_(float("nan"))
    trainer.run()
    assert trainer.skipped == 3 and trainer.step == 3


def test_run_directory_outputs_and_weights(tiny_cfg):
    cfg = tiny_cfg("train.max_steps=10", "train.eval_every=5")
    trainer = Trainer(cfg)
    trainer.run()
    rd = run_dir(cfg)
    for name in (
        "config.yaml",
        "env.json",
        "tokenizer.json",
        "metrics.jsonl",
        "summary.json",
        "model/model.safetensors",
        "model/model_config.json",
        "model/tokenizer.json",
        "model-best/model.safetensors",
    ):
        assert (rd / name).is_file(), name
    records = read_metrics(rd)
    step_rec = next(r for r in records if r.get("step") == 10 and "loss" in r)
    for key in ("tokens", "lr", "grad_norm", "tokens_per_s", "data_s", "fwd_bwd_s", "opt_s", "peak_mem_mb"):
        assert key in step_rec
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [5, 10]
    assert all(
        r["val_bpb"] > 0
        and abs(r["val_ppl"] - torch.tensor(r["val_loss"]).exp().item()) < 1e-3 * r["val_ppl"]
        for r in evals
    )
    # the exported weights reproduce the trained model's logits
    from ember.config import ModelConfig

    model_cfg = ModelConfig(**json.loads((rd / "model" / "model_config.json").read_text()))
    fresh = GPT.build(model_cfg)
    load_weights(fresh, rd / "model")
    x = torch.randint(0, 500, (2, 16))
    trainer.model.eval()
    assert torch.equal(fresh.eval()(x), trainer.model(x))
    # the loss went down
    ls = losses(rd)
    assert ls[10] < ls[1]


def test_refuses_to_overwrite_an_existing_run(tiny_cfg):
    train(tiny_cfg("train.max_steps=2"))
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        Trainer(tiny_cfg("train.max_steps=2"))


# ---------------------------------------------------------------- 2 processes (gloo)


@pytest.mark.slow
def test_two_ranks_match_one_process(tiny_cfg, tmp_path):
    """DDP and FSDP2 on 2 ranks, with AdamW and with Muon, and an image classifier (a CNN, SGD,
    augmented digits), in one torchrun launch (tests/legs.py), each equal to one process. Muon:
    DDP ranks orthogonalise the same averaged gradients; FSDP2
    ranks gather each matrix, orthogonalise it and keep their rows. Then the FSDP2 run's step-3
    checkpoint resumes in one process, with the losses the two ranks had."""
    from tests.test_pp import _launch_legs

    optimizers = {"adamw": ["train.max_steps=6", "train.ckpt_every=3"], "muon": [*MUON, "train.max_steps=4"]}
    common = [*DET, "train.eval_every=0", f"run.out_dir={tmp_path}"]
    want = {}
    for opt, o in optimizers.items():
        single = tiny_cfg(*common, *o, f"run.name=single-{opt}")
        train(single)
        want[opt] = losses(run_dir(single))
    # and an image classifier (train.task=classify, tests/test_vision.py): a CNN with SGD, augmented
    image = [*common, "model.norm=layernorm", "train.optimizer=sgd", "data.augment=true", "train.max_steps=4"]
    train(load_config("digits", [*image, "run.name=single-cnn"]))
    want["cnn"] = losses(tmp_path / "single-cnn")
    common += [f"data.dir={single.data.dir}", "data.val_fraction=0.1", "train.device=cpu"]
    legs = {f"{opt}-{layout}": [*common, *o, f"parallel.data={layout}", f"run.name={opt}-{layout}"]
            for opt, o in optimizers.items() for layout in ("ddp", "fsdp")}  # fmt: skip
    image += ["train.micro_batch=32"]  # a rank's 32 rows
    legs |= {f"cnn-{layout}": {"config": "digits", "overrides": [*image, f"parallel.data={layout}",
             f"run.name=cnn-{layout}"]} for layout in ("ddp", "fsdp")}  # fmt: skip
    _launch_legs(tmp_path, 2, legs)
    for name in legs:
        got, w = losses(tmp_path / name), want[name.split("-")[0]]
        assert sorted(got) == sorted(w) == list(range(1, len(w) + 1)), name
        assert all(abs(got[s] - w[s]) <= 1e-5 for s in w), (name, got, w)

    rd = tmp_path / "adamw-fsdp"  # FSDP2's sharded checkpoint, resumed at world size one
    got = losses(rd)
    shutil.rmtree(rd / "checkpoints" / "step-000006")
    (rd / "metrics.jsonl").write_text("")
    cfg = tiny_cfg(*DET, "train.max_steps=6", "train.ckpt_every=3", "train.eval_every=0", "train.resume=auto")
    cfg.run.out_dir, cfg.run.name = str(tmp_path), "adamw-fsdp"
    train(cfg)
    resumed = losses(rd)
    assert sorted(resumed) == [4, 5, 6]
    assert all(abs(resumed[s] - got[s]) <= 1e-5 for s in resumed), (resumed, got)


def test_keep_last_and_keep_best(tiny_cfg):
    cfg = tiny_cfg("train.max_steps=6", "train.ckpt_every=1", "train.eval_every=2", "train.keep_last=2")
    train(cfg)
    ckpts = run_dir(cfg) / "checkpoints"
    kept = sorted(p.name for p in ckpts.iterdir())
    best = json.loads((ckpts / "step-000006" / "meta.json").read_text())["best_step"]
    assert kept == sorted({f"step-{s:06d}" for s in (5, 6, best)})
    assert all((ckpts / k / MARKER).exists() for k in kept)


def _blocks(trainer) -> list[torch.nn.Module]:
    """The model's blocks as the loop calls them (wrapped by checkpointing or compile)."""
    from ember.parallel.parallelize import unwrap

    return list(unwrap(trainer.model).layers.values())


def _inner_blocks(trainer) -> list[torch.nn.Module]:
    """The model's blocks, inside any checkpoint or compile wrapper."""
    return [getattr(b, "_checkpoint_wrapped_module", getattr(b, "_orig_mod", b)) for b in _blocks(trainer)]


def test_activation_checkpointing_equals_plain(tiny_cfg):
    """Same losses bit for bit, and the path was taken: every block is wrapped, and backward
    ran each block's forward a second time (once per micro-step of every training step)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    a = Trainer(tiny_cfg(*DET, "run.name=plain", "train.max_steps=3", "train.eval_every=0"))
    b = Trainer(
        tiny_cfg(
            *DET,
            "run.name=ac",
            "train.max_steps=3",
            "train.eval_every=0",
            "train.activation_checkpointing=true",
        )
    )
    assert all(isinstance(block, CheckpointWrapper) for block in _blocks(b))
    assert not any(isinstance(block, CheckpointWrapper) for block in _blocks(a))
    calls = {"plain": 0, "ac": 0}
    for name, trainer in (("plain", a), ("ac", b)):
        block = _inner_blocks(trainer)[0]
        # a pre-hook: the recomputation stops early, once it has what backward needs
        block.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    a.run(), b.run()
    assert calls["ac"] - calls["plain"] == 3 * a.grad_accum > 0  # the recomputations
    assert losses(a.run_dir) == losses(b.run_dir)


def test_bf16_autocast_trains_close_to_fp32(tiny_cfg):
    """bf16 matmuls really ran (the block's outputs are bf16), and the losses differ from
    fp32 by rounding only: not at all would mean autocast was ignored."""
    a = Trainer(tiny_cfg("run.name=fp32", "train.max_steps=3", "train.eval_every=0"))
    b = Trainer(tiny_cfg("run.name=bf16", "train.max_steps=3", "train.eval_every=0", "train.precision=bf16"))
    seen = {"fp32": set(), "bf16": set()}
    for name, trainer in (("fp32", a), ("bf16", b)):
        wq = _inner_blocks(trainer)[0].attention.wq
        wq.register_forward_hook(lambda mod, args, out, name=name: seen[name].add(out.dtype))
    a.run(), b.run()
    assert seen == {"fp32": {torch.float32}, "bf16": {torch.bfloat16}}
    la, lb = losses(a.run_dir), losses(b.run_dir)
    assert sorted(la) == sorted(lb) == [1, 2, 3]
    assert all(abs(la[s] - lb[s]) < 0.05 for s in la), (la, lb)
    assert any(la[s] != lb[s] for s in la), "bf16 gave fp32's losses bit for bit"


@pytest.mark.slow
def test_compiled_blocks_match_eager(tiny_cfg):
    """Losses within 1e-4 of eager, and the path was taken: every block is a compiled module
    and dynamo captured graphs while training."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch._dynamo.utils import counters

    a = Trainer(tiny_cfg(*DET, "run.name=eager", "train.max_steps=3", "train.eval_every=0"))
    b = Trainer(
        tiny_cfg(
            "train.precision=fp32",
            "run.name=compiled",
            "train.max_steps=3",
            "train.eval_every=0",
            "train.compile=true",
        )
    )
    assert all(isinstance(block, OptimizedModule) for block in _blocks(b))
    assert not any(isinstance(block, OptimizedModule) for block in _blocks(a))
    a.run()
    torch._dynamo.reset()
    counters.clear()
    b.run()
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    la, lb = losses(a.run_dir), losses(b.run_dir)
    assert sorted(la) == sorted(lb) == [1, 2, 3]
    assert all(abs(la[s] - lb[s]) < 1e-4 for s in la), (la, lb)


def test_explicit_resume_from_an_older_step_is_refused(tiny_cfg):
    train(tiny_cfg("train.max_steps=4", "train.ckpt_every=2", "train.eval_every=0"))
    with pytest.raises(ConfigError, match="older than step-000004"):
        Trainer(tiny_cfg("train.max_steps=6", "train.resume=step-000002"))


def test_resume_keeps_one_history_in_metrics(tiny_cfg):
    cfg = tiny_cfg(*DET, "train.max_steps=6", "train.ckpt_every=3", "train.eval_every=0")
    train(cfg)
    shutil.rmtree(run_dir(cfg) / "checkpoints" / "step-000006")
    train(
        tiny_cfg(*DET, "train.max_steps=6", "train.ckpt_every=3", "train.eval_every=0", "train.resume=auto")
    )
    steps = [r["step"] for r in read_metrics(run_dir(cfg)) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert (run_dir(cfg) / "config.yaml").exists() and (
        run_dir(cfg) / "config-resume-step-000003.yaml"
    ).exists()


@pytest.mark.parametrize("resume", ["never", "auto"])
def test_metrics_without_a_committed_checkpoint_are_refused_not_appended_to(tiny_cfg, resume):
    args = ["train.max_steps=6", "train.eval_every=0"]  # train.ckpt_every=0: one checkpoint, at the end
    trainer = Trainer(tiny_cfg(*args))
    real, calls = trainer.task.loss, []

    def killed_in_step_3(model, batch):
        calls.append(1)
        if len(calls) > 2 * trainer.grad_accum:
            raise KeyboardInterrupt
        return real(model, batch)

    trainer.task.loss = killed_in_step_3
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    rd = trainer.run_dir
    assert [r["step"] for r in read_metrics(rd)] == [1, 2] and latest_checkpoint(rd / "checkpoints") is None
    before = {p: p.read_bytes() for p in rd.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="no committed checkpoint.*delete that folder to start over"):
        Trainer(tiny_cfg(*args, f"train.resume={resume}"))
    assert {p: p.read_bytes() for p in rd.rglob("*") if p.is_file()} == before


def test_resume_with_a_changed_config_names_each_key(tiny_cfg, tmp_path):
    args = ["train.max_steps=4", "train.eval_every=0", "train.resume=auto"]
    cfg = tiny_cfg(*args)
    train(cfg)
    rd = run_dir(cfg)
    before = {p: p.read_bytes() for p in rd.rglob("*") if p.is_file()}
    shutil.copytree(cfg.data.dir, tmp_path / "same-data")
    fixed = {
        "model.n_layer": "3",
        "run.seed": "7",
        "train.batch_tokens": "512",
        "train.seq_len": "16",
        "train.optimizer": "muon",
        "data.dir": str(tmp_path / "same-data"),
        "data.sampling": "epoch",
    }
    overrides = [f"{k}={v}" for k, v in fixed.items()]
    with pytest.raises(ConfigError) as e:  # the opt-in does not cover these
        Trainer(tiny_cfg(*args, *overrides, "train.max_steps=8", "train.resume_allow_changes=true"))
    message = str(e.value)
    assert all(f"{key} " in message for key in [*fixed, "train.max_steps"]), message
    assert "another run.name" in message and "delete" not in message
    # one at a time, each is named
    for key, value in fixed.items():
        with pytest.raises(ConfigError, match=rf"differs from .*config\.yaml: {key} .*cannot change"):
            Trainer(tiny_cfg(*args, f"{key}={value}"))
    tokenizer = rd / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + "\n")  # as if the run had been trained with another one
    with pytest.raises(ConfigError, match="tokenizer sha256 .*cannot change"):
        Trainer(tiny_cfg(*args))
    tokenizer.write_bytes(before[tokenizer])
    # a longer budget is a safe change, but only when asked for
    with pytest.raises(ConfigError, match=r"train\.max_steps 4 → 8\. .*train\.resume_allow_changes=true"):
        Trainer(tiny_cfg(*args, "train.max_steps=8"))
    assert {p: p.read_bytes() for p in rd.rglob("*") if p.is_file()} == before  # nothing was written
    result = train(tiny_cfg(*args, "train.max_steps=8", "train.resume_allow_changes=true"))
    assert result["step"] == 8 and sorted(losses(rd)) == list(range(1, 9))


def test_resuming_a_finished_run_changes_nothing(tiny_cfg):
    args = ["train.max_steps=4", "train.eval_every=2"]
    cfg = tiny_cfg(*args)
    train(cfg)
    rd = run_dir(cfg)
    before = {p: p.read_bytes() for p in rd.rglob("*") if p.is_file()}
    again = train(tiny_cfg(*args, "train.resume=auto"))
    assert {p: p.read_bytes() for p in rd.rglob("*") if p.is_file()} == before
    assert again == json.loads((rd / "summary.json").read_text()) and again["step"] == 4


def test_keep_best_exports_the_best_weights_with_the_default_checkpoint_cadence(tiny_cfg):
    from safetensors.torch import load_file

    trainer = Trainer(tiny_cfg(*DET, "train.max_steps=6", "train.eval_every=2"))
    assert trainer.cfg.train.ckpt_every == 0 and trainer.cfg.train.keep_best
    val_losses, at_best = iter([3.0, 1.0, 2.0]), {}

    def scripted(model, val_loader, autocast):  # the best evaluation is the middle one, step 4
        loss = next(val_losses)
        if loss == 1.0:
            at_best.update({k: v.clone() for k, v in model.state_dict().items()})
        return {"val_loss": loss, "val_ppl": math.exp(loss), "val_bpb": loss}

    trainer.task.evaluate = scripted
    trainer.run()
    rd = trainer.run_dir
    assert json.loads((rd / "summary.json").read_text())["best_step"] == 4
    best = load_file(str(rd / "model-best" / "model.safetensors"))
    last = load_file(str(rd / "model" / "model.safetensors"))
    assert all(torch.equal(best[k], at_best[k]) for k in best)
    assert not all(torch.equal(best[k], last[k]) for k in best)
    # with checkpoints only at the end, there is no checkpoint of step 4 to keep
    assert sorted(p.name for p in (rd / "checkpoints").iterdir()) == ["step-000006"]


def test_no_validation_split_trains_without_eval(tiny_data, tmp_path):
    from ember.config import load_config
    from ember.data.prepare import prepare

    cfg = load_config(
        "tiny",
        [
            f"data.dir={tmp_path / 'noval'}",
            "data.val_fraction=0",
            "train.max_steps=2",
            f"run.out_dir={tmp_path / 'runs'}",
            "train.device=cpu",
        ],
    )
    prepare(cfg, log=lambda _: None)
    result = train(cfg)
    assert result["step"] == 2 and "val_loss" not in result


def test_bits_per_byte_counts_text_only(tiny_cfg):
    trainer = Trainer(tiny_cfg("train.max_steps=1"))
    result = trainer.task.evaluate(trainer.model, trainer.val_loader, trainer.autocast)
    # recompute by hand: CE on targets that stand for bytes, over those bytes
    nats = nbytes = 0.0
    tb = trainer.task.token_bytes
    with torch.no_grad():
        for x, y in trainer.val_loader:
            ce = torch.nn.functional.cross_entropy(
                trainer.model(x).flatten(0, 1), y.flatten(), reduction="none"
            )
            mask = tb[y.flatten()] > 0
            nats += ce[mask].sum().item()
            nbytes += tb[y.flatten()].sum().item()
    assert abs(result["val_bpb"] - nats / nbytes / math.log(2)) < 1e-6


# ---------------------------------------------------------------- Muon and per-group learning rates

MUON = ["train.optimizer=muon", "train.embed_lr=0.005"]


def test_muon_exact_resume_is_bitwise(tiny_cfg):
    args = [*DET, *MUON, *DROPOUT, "train.max_steps=8", "train.ckpt_every=4", "train.eval_every=0"]
    cfg = tiny_cfg(*args)
    train(cfg)
    rd = run_dir(cfg)
    full = losses(rd)
    assert sorted(full) == list(range(1, 9))
    shutil.rmtree(rd / "checkpoints" / "step-000008")
    (rd / "metrics.jsonl").write_text("")
    train(tiny_cfg(*args, "train.resume=auto"))
    assert losses(rd) == {s: full[s] for s in (5, 6, 7, 8)}  # bitwise equal floats
    # what came back: Muon's momenta; the peaks are the config's, even when it changed
    changed = ["train.max_steps=9", "train.muon_lr=0.03", "train.resume_allow_changes=true"]
    trainer = Trainer(tiny_cfg(*args, "train.resume=auto", *changed))
    momenta = [s["momentum_buffer"] for s in trainer.optimizer.state.values() if "momentum_buffer" in s]
    assert len(momenta) == 2 * 7 and all(m.abs().sum() > 0 for m in momenta)  # 7 matrices per block
    peaks = {g["role"]: g["peak_lr"] for g in trainer.optimizer.param_groups}
    assert peaks == {"hidden": 0.03, "embed": 0.005, "vector": 0.003}


def test_each_group_follows_the_schedule_from_its_own_peak(tiny_cfg):
    trainer = Trainer(tiny_cfg(*MUON, "train.max_steps=3", "train.eval_every=0"))
    trainer.run()
    t = trainer.cfg.train
    assert t.warmup_steps == 5  # the last step (index 2) is in warmup: multiplier 3/5
    groups = {g["role"]: g for g in trainer.optimizer.param_groups}
    assert {r: g["peak_lr"] for r, g in groups.items()} == {"hidden": 0.02, "embed": 0.005, "vector": t.lr}
    for g in groups.values():
        assert g["lr"] == pytest.approx(g["peak_lr"] * 3 / 5, rel=1e-12)
    assert [g["use_muon"] for g in groups.values()] == [True, False, False]
    logged = [r for r in read_metrics(trainer.run_dir) if "loss" in r]
    assert logged[-1]["lr"] == pytest.approx(t.lr * 3 / 5, rel=1e-12)  # the log shows train.lr's


def test_checkpoint_of_the_nested_optimizer_format_still_loads(tmp_path):
    """Checkpoints written before pipeline parallel keyed optimizer state by param-group position;
    they load into the name-keyed (flat) form that ember writes now, values unchanged."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ember.config import load_config
    from ember.model.gpt import GPT
    from ember.train.checkpoint import _rng_state, load_checkpoint
    from ember.train.optim import build_optimizer

    cfg = load_config("tiny", ["model.vocab_size=512"])

    def model_and_optimizer(seed):
        torch.manual_seed(seed)
        model = GPT.build(cfg.model)
        return model, build_optimizer(model, cfg.train, torch.device("cpu"))

    model, opt = model_and_optimizer(0)
    model(torch.randint(0, 512, (2, 8))).sum().backward()
    opt.step()
    folder = tmp_path / "step-000001"
    model_sd, optim_sd = get_state_dict(model, opt)  # the nested form, as before
    assert "param_groups" in optim_sd and isinstance(optim_sd["param_groups"], list)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder), no_dist=True)
    torch.save(_rng_state(), folder / "rng-rank0.pt")
    (folder / "meta.json").write_text('{"step": 1}')
    (folder / MARKER).write_text("{}")

    fresh, fresh_opt = model_and_optimizer(1)
    load_checkpoint(folder, fresh, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"])
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in fresh_opt.param_groups]
