"""What the model benchmarks print besides their numbers: the CPU's name and markdown tables.

    from printing import cpu_model, print_table      # benchmarks/ is sys.path[0] when run as a script

Shared by benchmarks/train_step.py and benchmarks/decode.py, so that their tables look alike
and can be pasted into RESULTS.md as they are.
"""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """A markdown table with columns padded to their widest cell."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for i, r in enumerate([header, *rows]):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def profiled(fn, cuda: bool) -> tuple[list[tuple[str, float]], float]:
    """Run ``fn()`` under torch.profiler: ([(kernel name, µs)] the device ran, wall seconds). On a
    CPU, the top-level aten ops stand in for kernels (a dry run of the plumbing)."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if cuda:
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        events = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    return [(e.name, e.time_range.elapsed_us()) for e in events], wall
