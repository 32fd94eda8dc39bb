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
