"""AdamW with the usual parameter groups, and the learning-rate schedule.

    optimizer = build_optimizer(model, cfg.train, device)
    lr = lr_at(step, progress, cfg.train)   # progress = fraction of the budget used, in [0, 1]

Design choices:

- Weight decay applies to matrices only: norms, biases and embeddings (and the output head
  when it is tied to the embedding) are not decayed, as in GPT-2/nanoGPT and Llama recipes.
- ``fused=True`` on CUDA (one kernel for the whole update), ``foreach=True`` on CPU.
- The schedule is a pure function of (step, progress): warmup is counted in steps, the
  decay in the fraction of the budget used, so the same config works for a step, token or
  wall-clock budget, and resuming needs no scheduler state beyond the step and progress.
"""

from __future__ import annotations

import math

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and id(p) not in embeddings else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: torch.nn.Module, train_cfg, device: torch.device) -> torch.optim.AdamW:
    kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(
        param_groups(model, train_cfg.weight_decay),
        lr=train_cfg.lr,
        betas=(train_cfg.beta1, train_cfg.beta2),
        eps=train_cfg.eps,
        **kind,
    )


def lr_at(step: int, progress: float, train_cfg) -> float:
    """Learning rate for optimizer step ``step`` (0-based) at ``progress`` of the budget."""
    peak, floor = train_cfg.lr, train_cfg.lr * train_cfg.min_lr_ratio
    if step < train_cfg.warmup_steps:
        return peak * (step + 1) / train_cfg.warmup_steps
    p = min(max(progress, 0.0), 1.0)
    if train_cfg.schedule == "constant":
        return peak
    if train_cfg.schedule == "linear":
        return peak + (floor - peak) * p
    if train_cfg.schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * p))
    # wsd: stable at peak, then linear decay over the last decay_fraction of the budget
    start = 1.0 - train_cfg.decay_fraction
    if p <= start:
        return peak
    return peak + (floor - peak) * (p - start) / train_cfg.decay_fraction
