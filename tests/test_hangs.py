"""Hangs explain themselves: with two gloo ranks, one that exits and one that hangs at step 3
(injected through EMBER_FAULT), the other stops within parallel.timeout_s plus a margin with an
EmberError naming itself, the step, what it was doing and the culprit's state, and torchrun
leaves no process behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ember.atomic import process_alive
from ember.parallel.dist import FAULT_ENV

TIMEOUT_S = 5


def _alive_under(path) -> list[str]:
    """Command lines of live processes that mention ``path`` (ranks of a finished job)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in line and process_alive(int(pid)):
            out.append(line)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "verdict"),
    [("exit", "rank 1 has exited"), ("sleep", "rank 1 is alive at step 3 but did not join the collective")],
)
def test_a_rank_that_exits_or_hangs_is_named_within_the_timeout(tiny_data, tmp_path, fault, verdict):
    cmd = [sys.executable, "-m", "ember", "train", "tiny", "--nproc", "2", f"data.dir={tiny_data}",
           "data.val_fraction=0.1", f"run.out_dir={tmp_path}", "run.name=hang", "train.device=cpu",
           "train.max_steps=6", "train.eval_every=0", f"parallel.timeout_s={TIMEOUT_S}"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{FAULT_ENV: f"1:3:{fault}"})
    env.pop("LOCAL_RANK", None)
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    failed = "ember: error: rank 0, step 3: a collective in" in out
    # an exit reaches rank 0 as a failed collective or, when torchrun is quicker, as its SIGTERM
    stopped = fault == "exit" and "ember: error: rank 0, step 3: stopped by the launcher (SIGTERM)" in out
    assert failed or stopped, out[-4000:]
    assert verdict in out and (stopped or f"parallel.timeout_s={TIMEOUT_S}" in out), out[-4000:]
    assert took < 60, took  # start-up of two ranks (~10 s) + the timeout + margin, not forever
    assert _alive_under(tmp_path) == []
