"""Layouts applied to a single-device model, from outside, in one fixed order.

    model = parallelize(model, env, cfg)

Order (each step needs the one before it):

1. tensor parallel           — not yet: lands with the TP capability;
2. activation checkpointing  — wrap each block, so backward recomputes its activations;
3. compile                   — ``torch.compile`` per block (the blocks are identical, so one
                               graph is reused; a whole-model compile would retrace more);
4. data parallel             — FSDP2 ``fully_shard`` on every block then the root, with a
                               mixed-precision policy when not fp32; or DDP on the whole.

The model keeps its parameter names through all of it (the checkpoint wrapper and compile
strip their prefixes from state dicts), so checkpoints move between layouts.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=True)


def apply_compile(model: torch.nn.Module) -> None:
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True)


def apply_fsdp(model: torch.nn.Module, mesh, precision: str) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh}
    if precision in PARAM_DTYPES:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=PARAM_DTYPES[precision], reduce_dtype=torch.float32
        )
    for block in model.layers.values():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def parallelize(model: torch.nn.Module, env, cfg) -> torch.nn.Module:
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.train.compile:
        apply_compile(model)
    if env.distributed:
        if cfg.parallel.data == "fsdp":
            return apply_fsdp(model, env.mesh, cfg.train.precision)
        return apply_ddp(model, env.device)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPT inside a DDP wrapper (FSDP2 keeps the module itself)."""
    return model.module if hasattr(model, "module") and not hasattr(model, "layers") else model
