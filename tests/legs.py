"""Several runs in one launch of N ranks (a launch costs seconds of start-up; a tiny run, less):
``python tests/legs.py N LEGS.json``. The file maps names to the overrides of the ``tiny``
preset (a training run each), to ``{"config": ..., "overrides": [...]}`` (a training run of
another preset), or to ``{"config": ..., "overrides": [...], "plan": OUT}``: ``ember plan``'s
prediction and its measurement of a few steps, which rank 0 writes to OUT as JSON, or to
``{"config": ..., "overrides": [...], "nan": PARAMETER, "out": OUT}``: a run whose PARAMETER
holds a NaN on every rank, whose NonFiniteError rank 0 writes to OUT. Each run builds its own
mesh in the one process group; a run that fails stops the launch.

The ranks are forked from this process after torch and ember are imported (4 s of CPU a
process on the 2-core machine), with the environment torchrun would give them (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): what the tests compare is the layouts, and
``ember train --nproc`` keeps its own torchrun tests (test_grpo, test_mamba,
test_hangs). One rank failing kills the others; a rank dies with this process (PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

from ember.config import load_config
from ember.parallel.dist import barrier, destroy_distributed, get_rank
from ember.train.trainer import NonFiniteError, Trainer


def run_legs(legs: dict) -> None:
    try:
        for leg in legs.values():
            if isinstance(leg, list):
                Trainer(load_config("tiny", ["train.report=false", *leg])).run()
            elif "nan" in leg:
                trainer = Trainer(load_config(leg["config"], leg["overrides"]))
                weight = trainer.model.get_parameter(leg["nan"])
                with torch.no_grad():
                    (weight.to_local() if hasattr(weight, "to_local") else weight)[0, 0] = float("nan")
                try:
                    trainer.run()
                    raise AssertionError(f"{leg['nan']} held a NaN and the run did not stop")
                except NonFiniteError as e:
                    if get_rank() == 0:
                        Path(leg["out"]).write_text(str(e), encoding="utf-8")
            elif "plan" not in leg:
                Trainer(load_config(leg["config"], leg["overrides"])).run()
            else:
                from ember.analysis import plan

                cfg = load_config(leg["config"], leg["overrides"])
                world = int(os.environ.get("WORLD_SIZE", "1"))
                predicted = plan.predict(cfg, plan.model_config_for(cfg), world)
                measured = plan.measure_config(cfg, steps=5)  # the lowest of 3 tracked steps
                if get_rank() == 0:
                    with open(leg["plan"], "w", encoding="utf-8") as f:
                        json.dump({"predicted": predicted, "measured": measured}, f)
            barrier()
    finally:
        destroy_distributed()


def fork_ranks(nproc: int, legs: dict) -> int:
    """Fork ``nproc`` ranks that run ``legs``; 0 if every rank exits 0."""
    with socket.socket() as s:  # a free port for rank 0's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    children = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:  # the rank
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the launcher
            ids = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc}
            os.environ.update(
                {k: str(v) for k, v in ids.items()}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
            )
            code = 0
            try:
                run_legs(legs)
            except BaseException:  # noqa: BLE001 (reported, then the exit code says it)
                print(f"[rank{rank}]: {traceback.format_exc()}", file=sys.stderr, flush=True)
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children[pid] = rank
    failed = 0
    while children:
        pid, status = os.waitpid(-1, 0)
        children.pop(pid, None)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = 1
            time.sleep(1.0)  # let the others print what they saw, then stop them
            for other in children:
                os.kill(other, signal.SIGKILL)
    return failed


if __name__ == "__main__":
    sys.exit(fork_ranks(int(sys.argv[1]), json.loads(open(sys.argv[2], encoding="utf-8").read())))
