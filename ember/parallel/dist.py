"""The process group and the device: who am I, where do I run, and how ranks agree.

    env = init_distributed(cfg.parallel, cfg.train.device)   # reads torchrun's env vars
    print0(f"world size {env.world_size}")                    # prints on rank 0 only
    all_reduce(loss, "avg")                                    # in place, no-op alone

Works unchanged as a single process (no process group is created when WORLD_SIZE is 1 or
unset) and under ``torchrun``/``ember train --nproc N`` (gloo on CPU, nccl on CUDA). The
device mesh has one named dimension per layout > 1: "pp" (pipeline stages), "dp" (what FSDP2
shards over and DDP averages across; "dp_replicate" × "dp_shard" for HSDP) and "tp";
``DistEnv.dp_rank``/``dp_size`` say which rows a rank reads, ``pp_rank`` which stage it runs.
``Watchdog`` turns a collective that fails or times out into an EmberError naming the rank
to blame, the step and what the loop was doing. Launching ranks from a plain process lives here
too: ``torchrun_cmd`` (``ember train --nproc``, ``bench comm``) and ``run_ranks``, which runs one
to the end and raises the ranks' own error lines (``plan --measure``, ``analyze determinism
--nproc``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ember.atomic import process_alive
from ember.errors import ConfigError, EmberError


@dataclass
class DistEnv:
    rank: int
    world_size: int
    device: torch.device
    mesh: object | None = None  # DeviceMesh when world_size > 1: ("pp"?, data dims..., "tp"?)
    tp: int = 1  # ranks that split each block's matrices (tensor parallel)
    dp_mesh: object | None = None  # data parallelism's: 1-D, or ("dp_replicate", "dp_shard") for HSDP
    pp: int = 1  # pipeline stages' ranks: each holds a contiguous range of blocks

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: groups of ranks that see different rows of the batch."""
        return self.world_size // (self.tp * self.pp)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel group (rank = (pp_rank * dp_size + dp_rank) * tp + tp_rank)."""
        return self.rank // self.tp % self.dp_size

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline position: it runs stages pp_rank, pp_rank + pp, ..."""
        return self.rank // (self.world_size // self.pp)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def wants_cuda(name: str) -> bool:
    """Whether ``train.device=name`` runs on CUDA: ``cuda``, or ``auto`` where a GPU is visible."""
    return name == "cuda" or (name == "auto" and torch.cuda.is_available())


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    if wants_cuda(name):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(parallel_cfg, device_name: str = "auto") -> DistEnv:
    """Join the process group described by torchrun's environment (or run alone)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_name, local_rank)
    mesh = dp_mesh = None
    tp, replicas, pp = parallel_cfg.tp, parallel_cfg.dp_replicate, parallel_cfg.pp
    if world_size > 1:
        backend = parallel_cfg.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(
                backend=backend,
                timeout=timedelta(seconds=parallel_cfg.timeout_s),
                device_id=device if device.type == "cuda" else None,
            )
        from torch.distributed.device_mesh import init_device_mesh

        if world_size % (tp * replicas * pp):
            raise ConfigError(f"parallel.pp × dp_replicate × tp = {pp} × {replicas} × {tp} does not divide the {world_size} ranks")  # fmt: skip # noqa: E501
        # rank = (pp_rank * dp + dp_rank) * tp + tp_rank: a tensor-parallel group is tp adjacent
        # ranks (one host), a pipeline stage's ranks a contiguous block of them
        dp = ("dp_replicate", "dp_shard") if replicas > 1 else ("dp",)
        n_dp = world_size // (replicas * tp * pp)
        shape = (replicas, n_dp) if replicas > 1 else (n_dp,)
        names = (*(("pp",) if pp > 1 else ()), *dp, *(("tp",) if tp > 1 else ()))
        shape = (*((pp,) if pp > 1 else ()), *shape, *((tp,) if tp > 1 else ()))
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        dp_mesh = mesh[dp] if len(names) > len(dp) else mesh
    elif tp > 1 or pp > 1:  # so alone tp = pp = 1 (the config checks ge=1)
        raise ConfigError(f"parallel.tp={tp} × parallel.pp={pp} needs {tp * pp} ranks: launch with --nproc {tp * pp}")  # fmt: skip # noqa: E501
    return DistEnv(rank, world_size, device, mesh, tp, dp_mesh, pp)


_ERROR_LINE = re.compile(r"^(ember: error: |[\w.]+(Error|Exception): )")  # a rank's own account of failing


def torchrun_cmd(nproc: int, *args: str, module: str = "ember") -> list[str]:
    """``python -m MODULE ARGS`` (``ember ARGS``) as ``nproc`` ranks on this host, under torchrun
    (which restarts nothing: one rank failing stops the others)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, *args]  # fmt: skip


def run_ranks(nproc: int, *args: str, module: str = "ember", what: str = "the run") -> str:
    """``torchrun_cmd`` run to the end with one thread per rank; its standard output, or an
    EmberError carrying the ranks' own error lines (``ember: error: ...``, an exception's last
    line), which torchrun's closing summary would otherwise bury."""
    import subprocess

    cmd = torchrun_cmd(nproc, *args, module=module)
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode == 0:
        return proc.stdout
    lines = (proc.stdout + proc.stderr).splitlines()
    own = [line for line in lines if _ERROR_LINE.match(line) and not line.startswith("torch.distributed.")]
    shown = list(dict.fromkeys(own))[:6] or lines[-8:]  # (each rank says it: once is enough)
    raise EmberError(f"{what} on {nproc} rank(s) failed (exit {proc.returncode}):\n" + "\n".join(shown))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a plain tensor as it is): reading it takes no collective."""
    return t.to_local() if hasattr(t, "to_local") else t


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def print0(*args, **kwargs) -> None:
    """print on rank 0 only: the one place that knows about ranks and the console."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In place across ranks (no-op alone); ``op`` in sum, max, min, avg."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=getattr(dist.ReduceOp, "SUM" if op == "avg" else op.upper()))  # gloo has no AVG
        if op == "avg":
            t /= dist.get_world_size()
    return t


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# ------------------------------------------------------------------ hangs that explain themselves

FAULT_ENV = "EMBER_FAULT"  # tests: "RANK:STEP:exit|sleep": that rank exits (code 1) or hangs at STEP
_BEAT_S = 1.0  # a rank writes its heartbeat this often


class Watchdog:
    """Turns a collective that fails or times out (``parallel.timeout_s``, every collective's
    limit) into an EmberError that says which rank is to blame and why.

    Every rank publishes its host and pid in the launcher's key-value store (torchrun's agent
    holds it, so it outlives any rank), and a heartbeat thread writes (time, step) every
    second. The loop names what it is doing (``phase``). When a collective raises, the rank
    reads the others' records: a rank on this host whose process is gone has exited; one not
    heard from for several beats has died or lost its host; one still beating but at an
    earlier step is behind; one beating at this step did not join the collective (stuck, or on
    another code path). The error names this rank, the step, the phase and the verdict per rank,
    so a hang ends in ``parallel.timeout_s`` with a reason instead of a stack of C++ frames;
    torchrun then stops the remaining ranks."""

    def __init__(self, env: DistEnv, timeout_s: float):
        self.env, self.timeout_s, self.step, self.where = env, timeout_s, 0, "start-up"
        self.store = None
        self._stop = threading.Event()
        if not env.distributed:
            return
        from torch.distributed import distributed_c10d

        self.store = distributed_c10d._get_default_store()
        self.store.set(f"ember/pid/{env.rank}", f"{socket.gethostname()} {os.getpid()}")
        self._beat()
        threading.Thread(target=self._beats, name="ember-heartbeat", daemon=True).start()
        self.reported = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        """torchrun stops every rank when one fails, often before the survivors' failed
        collective has raised: say what this rank knows, then go."""
        if self.reported:  # this rank's own error is on its way out: let it print
            return
        self.reported = True
        others = [self._verdict(r, failed=False) for r in range(self.env.world_size) if r != self.env.rank]
        print(f"ember: error: rank {self.env.rank}, step {self.step}: stopped by the launcher (SIGTERM) "
              f"in {self.where}: " + "; ".join(others), file=sys.stderr, flush=True)  # fmt: skip
        os._exit(2)

    def _beat(self) -> None:
        self.store.set(f"ember/beat/{self.env.rank}", f"{time.time()} {self.step}")

    def _beats(self) -> None:
        while not self._stop.wait(_BEAT_S):
            try:
                self._beat()
            except Exception:  # the store is gone: the job is ending
                return

    def at(self, step: int) -> None:
        """Step ``step`` begins (and a test's injected fault, if it names this rank and step)."""
        self.step, self.where = step, "the step's start (the clock all-reduce)"
        if self.store is not None:
            self._beat()  # (a store write: well under a millisecond against a step)
        fault = os.environ.get(FAULT_ENV, "")
        if fault and fault.split(":")[:2] == [str(self.env.rank), str(step)]:
            print(f"ember: injected fault ({FAULT_ENV}={fault})", file=sys.stderr, flush=True)
            if fault.endswith(":exit"):
                os._exit(1)
            time.sleep(10**6)

    def phase(self, where: str) -> None:
        self.where = where

    def stop(self) -> None:
        self._stop.set()
        main = threading.current_thread() is threading.main_thread()
        if self.store is not None and not self.reported and main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def explain(self, e: BaseException) -> EmberError | None:
        """An EmberError for a failed collective, or None when ``e`` is something else."""
        text = str(e)
        comm = isinstance(e, dist.DistError) or any(
            k in text for k in ("gloo", "NCCL", "Timed out", "timed out", "Connection", "connection")
        )
        if self.store is None or not isinstance(e, RuntimeError) or not comm:
            return None
        self.reported = True
        verdicts = [self._verdict(r) for r in range(self.env.world_size) if r != self.env.rank]
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        first = first if len(first) <= 240 else first[:240] + "…"
        return EmberError(
            f"rank {self.env.rank}, step {self.step}: a collective in {self.where} failed "
            f"(parallel.timeout_s={self.timeout_s:g}): {first}. " + "; ".join(verdicts) + ". "
            "The other ranks are stopped; the culprit's own log says what it was doing"
        )

    def _verdict(self, rank: int, failed: bool = True) -> str:
        try:
            host, pid = self.store.get(f"ember/pid/{rank}").decode().split()
            beat, step = self.store.get(f"ember/beat/{rank}").decode().split()
        except Exception:
            return f"rank {rank} never reported (it did not start, or the store is gone)"
        age = time.time() - float(beat)
        if host == socket.gethostname() and not process_alive(int(pid)):
            return f"rank {rank} has exited (pid {pid}, last at step {step})"
        if age > 5 * _BEAT_S:
            return f"rank {rank} has been silent for {age:.0f} s (last at step {step}): it died or its host is unreachable"  # fmt: skip # noqa: E501
        if int(step) < self.step:
            return f"rank {rank} is alive but behind, at step {step}"
        if not failed:
            return f"rank {rank} is alive at step {step}"
        return f"rank {rank} is alive at step {step} but did not join the collective (stuck, or on another code path)"  # fmt: skip # noqa: E501
