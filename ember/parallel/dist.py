"""The process group and the device: who am I, where do I run, and how ranks agree.

    env = init_distributed(cfg.parallel, cfg.train.device)   # reads torchrun's env vars
    print0(f"world size {env.world_size}")                    # prints on rank 0 only
    all_reduce(loss, "avg")                                    # in place, no-op alone

Works unchanged as a single process (no process group is created when WORLD_SIZE is 1 or
unset) and under ``torchrun``/``ember train --nproc N`` (gloo on CPU, nccl on CUDA). The
1-D device mesh is what FSDP2 shards over; DDP uses the same group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ember.errors import ConfigError


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: object | None = None  # torch.distributed.DeviceMesh when world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


_ENV: DistEnv | None = None


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(parallel_cfg, device_name: str = "auto") -> DistEnv:
    """Join the process group described by torchrun's environment (or run alone)."""
    global _ENV
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_name, local_rank)
    mesh = None
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

        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    _ENV = DistEnv(rank, world_size, local_rank, device, mesh)
    return _ENV


def destroy_distributed() -> None:
    global _ENV
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _ENV = None


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def print0(*args, **kwargs) -> None:
    """print on rank 0 only: the one place that knows about ranks and the console."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In place across ranks (no-op alone); ``op`` in sum, max, min, avg."""
    if dist.is_available() and dist.is_initialized():
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op == "avg":
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            t /= dist.get_world_size()
        else:
            dist.all_reduce(t, op=ops[op])
    return t


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
