"""Tokens/s, peak memory and MFU per parallel layout, at world sizes 1, 2 and 4.

    .venv/bin/python benchmarks/parallel.py                                   # CPU, cpu-quick, gloo
    .venv/bin/python benchmarks/parallel.py --layouts single ddp2 tp2 fsdp2xtp2
    .venv/bin/python benchmarks/parallel.py --layouts single-untied pp2xfsdp2xtp2    # 3-D, 8 ranks
    python benchmarks/parallel.py --config gpt2-small --device cuda --steps 30  # GPU: MFU per layout

Each layout is one `ember train CONFIG --nproc N ...` run of ``--steps`` steps on the same
global batch (the config's, or ``--batch-tokens``), each rank at one torch thread on a CPU.
The figures are rank 0's, from its metrics.jsonl: the median tokens/s of the steps after the
first ``--warmup`` (the whole job's tokens per second, every rank together), the peak memory
of rank 0 (CPU: its peak resident set, so the ~300 MiB of the Python process and torch are
in it; CUDA: the caching allocator's peak), and MFU on a GPU ember knows the peak of.

On the 2-core CPU this is a record, not a target: two cores shared by up to four ranks, so more
ranks cannot be faster; what it shows is what each layout costs in communication and memory
for the same work. The GPU command is the one to run when a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from printing import cpu_model, print_table

PP = ["parallel.pp=2", "model.tie_embeddings=false"]
LAYOUTS = {  # name: (ranks, overrides)
    "single": (1, []),
    "ddp2": (2, ["parallel.data=ddp"]),
    "fsdp2": (2, ["parallel.data=fsdp"]),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "ddp4": (4, ["parallel.data=ddp"]),
    "fsdp4": (4, ["parallel.data=fsdp"]),
    "hsdp2x2": (4, ["parallel.data=fsdp", "parallel.dp_replicate=2"]),
    "fsdp2xtp2": (4, ["parallel.data=fsdp", "parallel.tp=2"]),
    "tp4": (4, ["parallel.tp=4"]),
    # pipeline parallel needs an untied head (it lives on the last stage, the embedding on the first)
    "single-untied": (1, ["model.tie_embeddings=false"]),
    "pp2": (2, ["parallel.pp=2", "model.tie_embeddings=false"]),
    "pp2-gpipe": (2, [*PP, "parallel.pp_schedule=gpipe"]),
    "pp2-interleaved": (2, [*PP, "parallel.pp_schedule=interleaved-1f1b"]),
    "pp2xfsdp2": (4, [*PP, "parallel.data=fsdp"]),
    "pp2xtp2": (4, [*PP, "parallel.tp=2"]),
    "pp2xfsdp2xtp2": (8, [*PP, "parallel.tp=2", "parallel.data=fsdp"]),
}


def run(name: str, args, out: Path) -> dict:
    nproc, layout = LAYOUTS[name]
    cmd = [sys.executable, "-m", "ember", "train", args.config, "--nproc", str(nproc), f"run.out_dir={out}",
           f"run.name={name}", f"train.max_steps={args.steps}", "train.max_time=0", "train.eval_every=0",
           "train.ckpt_every=0", f"train.device={args.device}", *layout, *args.overrides]  # fmt: skip
    if args.batch_tokens:
        cmd.append(f"train.batch_tokens={args.batch_tokens}")
    cmd.append(f"train.micro_batch={args.micro_batch}")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    env.pop("LOCAL_RANK", None)
    start = time.perf_counter()
    print("+", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, env=env)  # its log as it goes: a run stopped at a limit still shows its steps
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"name": name, "ranks": nproc, "error": f"exit {proc.returncode} (its output is above)"}
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "tokens_per_s" in r][args.warmup :]
    if not steps:
        return {"name": name, "ranks": nproc, "error": f"no step past the first {args.warmup} was logged"}
    return {
        "name": name,
        "ranks": nproc,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
        "peak_mem_mb": max(r["peak_mem_mb"] for r in steps),
        "mfu": statistics.median(r["mfu"] for r in steps) if "mfu" in steps[0] else None,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="cpu-quick")
    parser.add_argument("--device", default="cpu")
    every = [k for k in LAYOUTS if k not in ("tp4", "pp2xfsdp2xtp2")]
    parser.add_argument("--layouts", nargs="+", default=every, choices=list(LAYOUTS),
                        help="default: all but tp4 (cpu-quick has 2 heads) and the 8-rank 3-D")  # fmt: skip
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per forward (splits on 4 ranks)")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="the global batch (0: the config's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides")
    args = parser.parse_args()
    print(f"{args.config} on {args.device} ({cpu_model()}); {args.steps} steps, median after {args.warmup}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts:
            results.append(run(name, args, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    singles = [r for r in results if r["name"] in ("single", "single-untied") and "error" not in r]
    base = singles[0]["tokens_per_s"] if singles else None  # (the PP rows: against the untied model)
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["name"], str(r["ranks"]), "failed: " + r["error"][:80], "", "", ""])
            continue
        vs = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else ""
        tok, mem = f"{r['tokens_per_s']:,.0f}", f"{r['peak_mem_mb']:,.0f}"
        rows.append([r["name"], str(r["ranks"]), tok, vs, mem, mfu])
    print_table(["layout", "ranks", "tokens/s", "vs single", "rank-0 peak MiB", "MFU"], rows)
    if any("error" in r for r in results):
        sys.exit(1)  # (the table above says which layout, and why)


if __name__ == "__main__":
    main()
