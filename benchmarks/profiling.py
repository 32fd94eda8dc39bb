"""The benchmarks' profile of one call: the kernels the device ran, and the wall time around them.

    kernels, wall, busy = profiled(lambda: generate(), cuda=True)  # [(kernel name, µs)], s, µs
    costliest(kernels, tokens, "a token")                           # the table of the costliest kernels

decode.py, gpu_train.py and serve.py (``--anatomy``) read it as where their time goes: the
device's busy share of the wall, kernels per token or step, and their kinds.
"""

from __future__ import annotations

import time

import torch
from printing import print_table
from torch.profiler import ProfilerActivity, profile


def profiled(fn, cuda: bool) -> tuple[list[tuple[str, float]], float, float]:
    """Run ``fn()`` under torch.profiler: ([(kernel name, µs)] the device ran, wall seconds, µs
    the device was busy). Busy is the union of the kernels' intervals, not their sum: kernels
    launched as programmatic dependents (PDL) start early and wait inside, so their times
    overlap. On a CPU, the top-level aten ops stand in for kernels (a dry run of the plumbing)."""
    # on a GPU only the device's activity: recording every host op too cost ~2.5 µs each on the
    # host (stretching the wall of a host-bound step) and ~50 µs each to read back afterwards
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if cuda:
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        events = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    busy, reach = 0.0, float("-inf")  # the union of [start, end] over the events, in start order
    for start_us, end_us in sorted((e.time_range.start, e.time_range.end) for e in events):
        busy += max(0.0, end_us - max(start_us, reach))
        reach = max(reach, end_us)
    return [(e.name, e.time_range.elapsed_us()) for e in events], wall, busy


def costliest(kernels: list[tuple[str, float]], units: int, unit: str, top: int = 8) -> None:
    """The ``top`` kernels by their summed time: calls and µs per ``unit`` (``units`` of them in
    the profile: tokens, steps) and their share of all the kernels' time."""
    per: dict[str, tuple[int, float]] = {}
    for name, t in kernels:
        n, total = per.get(name, (0, 0.0))
        per[name] = n + 1, total + t
    summed = max(sum(t for _, t in kernels), 1e-9)
    print_table(["kernel", f"calls {unit}", f"µs {unit}", "share"],
                [[name[:70], f"{n / units:.1f}", f"{t / units:.1f}", f"{t / summed:.0%}"]
                 for name, (n, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]])  # fmt: skip
