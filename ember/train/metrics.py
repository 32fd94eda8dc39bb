"""Where training numbers go: ``metrics.jsonl`` always, TensorBoard when asked, a log line.

    log = MetricsLog(run_dir, enabled=env.is_main, tensorboard=False)
    log.write({"step": 10, "loss": 3.2, ...})
    log.close()

Only rank 0 writes (``enabled``); other ranks hold a silent logger, so the loop never
branches on the rank. Each record is one JSON line, flushed as written, so a crash loses
nothing already reported. ``peak_flops`` knows the dense bf16 peak of common GPUs, for
MFU; on a device it does not know, MFU is left out rather than guessed.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import torch

from ember.atomic import write_text_atomic
from ember.run import read_metrics

# Dense bf16/fp16 tensor-core peak FLOP/s (vendor datasheets, without sparsity).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12, "4090": 165e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _clean(v):
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    return v


class MetricsLog:
    def __init__(
        self, run_dir: Path, enabled: bool, tensorboard: bool = False, truncate_after: int | None = None
    ):
        """``truncate_after``: on resume, drop records of steps after the checkpoint (they are
        about to be trained again), so the file holds one history."""
        self.enabled = enabled
        path = Path(run_dir) / "metrics.jsonl"
        if enabled and truncate_after is not None and path.exists():
            records = read_metrics(run_dir)
            keep = [r for r in records if isinstance(s := r.get("step", 0), int) and s <= truncate_after]
            write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))
        self.file = open(Path(run_dir) / "metrics.jsonl", "a", encoding="utf-8") if enabled else None
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print(
                    "ember: tensorboard is not installed (pip install 'ember[track]'); logging to "
                    "metrics.jsonl only",
                    file=sys.stderr,
                )
            else:
                self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self.file.flush()
        if self.tb is not None:
            step = record.get("step", 0)
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


class ProgressBar:
    """A rich progress bar over the budget (0..1) with ETA, on rank 0 at a terminal only;
    elsewhere (files, CI, other ranks) it does nothing and the log lines carry the ETA."""

    def __init__(self, enabled: bool, description: str = "training"):
        self.bar = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self.task = self.bar.add_task(description, total=1.0, info="")
            self.bar.start()

    def update(self, progress: float, info: str = "") -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=min(progress, 1.0), info=info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
