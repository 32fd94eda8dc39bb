"""Where a training step's time goes: ``torch.profiler`` over a few steps of the run's config.

    ember analyze RUN profile [--steps 3] [--stack]   # RUN/analysis/profile/: trace.json, results.json

The run's config trains in a scratch directory (one step to warm up, then ``--steps`` profiled;
fresh weights: the time of a step does not depend on their values). The trainer labels its
phases (``ember/forward``, ``ember/backward``, ``ember/optimizer``; ``ember/data`` here for the
batch), so the step splits into them; communication is the time of the collectives
(``c10d``/gloo/NCCL operations) inside. Also: the operators by self time (the time in an
operator itself, not in the operators it calls), the Chrome trace (open it in Perfetto,
https://ui.perfetto.dev, or chrome://tracing), and the achieved FLOP/s — the model's training
FLOPs per token (6N + attention, as the trainer counts them) times the tokens, over the wall
time — against the device's matmul peak, measured on the spot with a large matrix product in
the dtype the step computes in (fp32, or autocast's bf16/fp16). On a GPU the operators are
ranked by their kernels' time, on a CPU by CPU time.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ember.analysis import write_results
from ember.atomic import make_dirs
from ember.run import run_config
from ember.train.trainer import scratch_trainer

PHASES = ("ember/data", "ember/forward", "ember/backward", "ember/optimizer")
COMM = ("c10d", "gloo", "nccl", "all_reduce", "allreduce", "all_gather", "reduce_scatter", "broadcast")


def matmul_peak(device: torch.device, size: int = 2048, seconds: float = 1.0, dtype=torch.float32) -> float:
    """FLOP/s of repeated (size × size) @ (size × size) products in ``dtype`` on ``device``."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    (a @ b).sum().item()  # warm up
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        c = a @ b
        n += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    c.sum().item()
    return 2 * size**3 * n / (time.perf_counter() - start)


def analyze(run_dir, steps: int = 3, stack: bool = False, top: int = 15) -> dict:
    from torch.profiler import ProfilerActivity, profile

    started = time.perf_counter()
    cfg = run_config(run_dir)
    with scratch_trainer(cfg, max_steps=steps + 1) as trainer:
        device = trainer.env.device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        batches = trainer.loader.iterate(0)
        trainer.advance(batches)  # warm-up: first-call costs stay out of the profile
        options = {"record_shapes": True, "profile_memory": True, "with_stack": stack}
        with profile(activities=activities, **options) as prof:
            wall = time.perf_counter()
            for _ in range(steps):
                trainer.advance(batches)  # (it labels the batch's wait ember/data)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - wall
        flops = trainer.flops_per_token * cfg.train.batch_tokens * steps
    events = prof.key_averages()
    use_cuda = device.type == "cuda"
    # on a GPU the phases and operators by their kernels' time (the CPU only launches them), else by CPU time
    self_us = (lambda e: e.self_device_time_total) if use_cuda else (lambda e: e.self_cpu_time_total)
    total_us = (lambda e: e.device_time_total) if use_cuda else (lambda e: e.cpu_time_total)
    split = {e.key.split("/")[1]: total_us(e) / 1e6 / steps for e in events if e.key in PHASES}
    comm = sum(e.self_cpu_time_total for e in events if any(k in e.key.lower() for k in COMM))
    split["communication"] = comm / 1e6 / steps
    ops = sorted((e for e in events if not e.key.startswith("ember/")), key=self_us, reverse=True)
    table = [{"op": e.key, "calls": e.count, "self_ms": self_us(e) / 1e3, "total_ms": total_us(e) / 1e3}
             for e in ops[:top]]  # fmt: skip
    # in the dtype of the step's matrix products, at a size that keeps a GPU busy, not waiting on launches
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision, torch.float32)
    peak = matmul_peak(device, size=8192 if use_cuda else 2048, dtype=dtype)
    achieved = flops / wall
    results = {"steps": steps, "step_s": wall / steps, "split_s": split, "top_ops": table,
               "flops_per_step": flops / steps, "achieved_flops": achieved, "matmul_peak_flops": peak,
               "fraction_of_peak": achieved / peak, "device": str(device), "threads": torch.get_num_threads(),
               "peak_dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
    # written only once all is measured: a failed profile leaves no trace.json, no empty folder
    out = make_dirs(Path(run_dir) / "analysis" / "profile")
    prof.export_chrome_trace(str(out / "trace.json"))
    write_results(run_dir, "profile", results, started)
    return {**results, "out": str(out)}


def summary(r: dict) -> str:
    """What ``ember analyze RUN profile`` prints: the step split, the top ten operators, FLOP/s."""
    split = ", ".join(f"{k} {v * 1e3:,.1f} ms" for k, v in r["split_s"].items())
    step = f"{r['steps']} steps of {r['step_s'] * 1e3:,.1f} ms on {r['device']} ({r['threads']} threads)"
    lines = [f"{step}: {split}", f"{'operator':<44} {'calls':>7} {'self ms':>10} {'total ms':>10}"]
    for op in r["top_ops"][:10]:
        lines.append(f"{op['op'][:44]:<44} {op['calls']:>7} {op['self_ms']:>10.1f} {op['total_ms']:>10.1f}")
    peak = f"{r['matmul_peak_flops'] / 1e9:,.2f} GFLOP/s ({r['fraction_of_peak']:.1%})"
    trace = Path(r["out"]) / "trace.json"
    lines.append(f"achieved {r['achieved_flops'] / 1e9:,.2f} GFLOP/s of the model's FLOPs; a large "
                 f"{r['peak_dtype']} matmul here: {peak}; trace: {trace}")  # fmt: skip
    return "\n".join(lines)
