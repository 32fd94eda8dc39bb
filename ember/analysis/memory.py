"""Memory over one training step: live bytes by category, operation by operation.

    ember analyze RUN memory            # RUN/analysis/memory/: results.json, memory.png

The run's config trains a few steps in a scratch directory (fresh weights: memory does not
depend on their values) and the storage tracker of ``ember plan --measure``
(``ember.analysis.plan.StorageTracker``) records, after every operation of the last step, the
live bytes of parameters, gradients, optimizer state and the rest (activations and
temporaries): the forward's climb, the backward handing activation memory over to gradients,
the optimizer's moments. On CUDA the caching allocator's own history is dumped beside it
(``cuda-snapshot.pickle``, for PyTorch's memory visualiser at https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ember.analysis import write_results
from ember.analysis.plan import measure_config
from ember.parallel.dist import wants_cuda
from ember.report.report import plot_series as plot
from ember.run import run_config

CATEGORIES = ("params", "grads", "optimizer", "activations")


def analyze(run_dir, steps: int = 3) -> dict:
    started = time.perf_counter()
    cfg = run_config(run_dir)
    cuda = wants_cuda(cfg.train.device)
    if cuda:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    [measured] = measure_config(cfg, steps=steps, timeline=True)
    timeline = measured.pop("timeline")
    out = Path(run_dir) / "analysis" / "memory"
    out.mkdir(parents=True, exist_ok=True)
    if cuda:
        torch.cuda.memory._dump_snapshot(str(out / "cuda-snapshot.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)
    every = max(1, len(timeline) // 2000)  # the plot and the file keep at most ~2,000 points
    series = {k: [row[k] for row in timeline[::every]] for k in CATEGORIES}
    results = {"operations": len(timeline), "every": every, **measured, "timeline": series}
    write_results(run_dir, "memory", results, started)
    xs = [i * every for i in range(len(series["params"]))]
    total = [sum(v) / 2**20 for v in zip(*series.values(), strict=True)]
    lines = [("total", xs, total, {"color": "black"})]
    lines += [(k, xs, [b / 2**20 for b in series[k]], {}) for k in CATEGORIES]
    plot(out / "memory.png", lines, "live memory over one training step", "operation", "MiB")
    return {**measured, "operations": len(timeline), "out": str(out)}


def summary(r: dict) -> str:
    """What ``ember analyze RUN memory`` prints: the peak and its parts."""
    mib = lambda b: f"{b / 2**20:,.2f} MiB"  # noqa: E731
    return (f"{r['operations']:,} operations in the tracked step; peak {mib(r['peak'])}: parameters "
            f"{mib(r['params'])}, gradients {mib(r['grads_at_peak'])}, optimizer {mib(r['optimizer'])}, "
            f"activations and temporaries {mib(r['activations_at_peak'])}")  # fmt: skip
