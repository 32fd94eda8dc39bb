"""``ember analyze RUN INSTRUMENT``: instruments that read a run directory and write their
results into ``RUN/analysis/<instrument>/`` (``results.json`` and plots).

    model, cfg = load_for_analysis(run_dir, ckpt="last")   # float64 optional, reference attention
    names = ckpt_names(run_dir, "all")                     # every committed checkpoint, then last
    x, y = windows(cfg, n=16, seed=0)                      # seeded training windows of the run's data

Instruments: ``profile`` (torch.profiler, the step's phases, achieved FLOP/s: profile.py),
``grads`` (per-example gradients, the gradient noise scale, example influence: grads.py),
``hessian`` (top eigenvalues by Lanczos on Hessian-vector products, the trace by Hutchinson,
sharpness across checkpoints: curvature.py), ``memory`` (live bytes by category over a step:
memory.py), ``nonfinite`` and ``determinism`` (a step replayed with every tensor checked; two
runs compared tensor by tensor: replay.py), ``lens`` (each layer through the head: lens.py);
and the trainer's ``train.log_dynamics`` (dynamics.py). Each is checked against a slow exact
computation on a tiny model (tests/test_analysis.py), and each renders its own result as the
lines ``ember analyze`` prints (``summary(result) -> str``).
The model runs with the reference attention (plain matmuls and softmax), which ``torch.func``
transforms and double backward take on every device; the fused kernels are for training.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from ember.data.loader import TokenDataset
from ember.errors import EmberError
from ember.run import checkpoint_steps, load_run, run_config


def load_for_analysis(run_dir: Path, ckpt: str = "last", dtype: torch.dtype = torch.float32):
    """The run's model (train mode off, reference attention, ``dtype``) and config."""
    model, _ = load_run(run_dir, ckpt=ckpt)
    return model.set_attention("reference").to(dtype).eval(), run_config(run_dir)


def ckpt_names(run_dir: Path, spec: str) -> list[str]:
    """``--ckpt``: ``last``, ``best``, ``all`` (every committed checkpoint, then ``last`` if no
    checkpoint holds the final weights) or a list of steps/names, as ``load_run`` takes them."""
    if spec != "all":
        return [c.strip() for c in spec.split(",") if c.strip()]
    found = [(s, p.name) for s, p, done in checkpoint_steps(Path(run_dir) / "checkpoints") if done]
    summary = Path(run_dir) / "summary.json"
    final = json.loads(summary.read_text()).get("step") if summary.is_file() else None
    return [name for _, name in found] + ([] if final in {s for s, _ in found} else ["last"])


def windows(cfg, n: int, seed: int = 0, split: str = "train", seq_len: int | None = None):
    """``n`` windows of ``seq_len`` (default the run's) + 1 tokens at seeded random offsets of the
    split: inputs and next-token targets, (n, T) each."""
    T = seq_len or cfg.train.seq_len
    data = TokenDataset(cfg.data.dir, split)
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        shard = data.shards[int(rng.integers(len(data.shards)))]
        if len(shard) <= T + 1:
            raise EmberError(f"a {split} shard of {cfg.data.dir} is shorter than a window of {T + 1} tokens")
        start = int(rng.integers(len(shard) - T - 1))
        rows.append(torch.from_numpy(np.asarray(shard[start : start + T + 1], dtype=np.int64)))
    idx = torch.stack(rows)
    return idx[:, :-1], idx[:, 1:]


def write_results(run_dir: Path, name: str, results: dict, started: float) -> Path:
    """``RUN/analysis/<name>/results.json`` with the seconds the instrument took."""
    out = Path(run_dir) / "analysis" / name
    out.mkdir(parents=True, exist_ok=True)
    results = {**results, "seconds": round(time.perf_counter() - started, 2)}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return out
