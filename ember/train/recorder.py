"""Every tensor of a step in view: module outputs in the forward, the gradients at module
outputs and the parameter gradients in the backward, in the order they are computed.

    with Recorder(model, keep=False) as rec:   # the first non-finite tensor and what came before
        loss = task.loss(model, batch)[0]; loss.backward()
    rec.first                                  # {"phase", "name", "tensor": stats, "before": ...}

The trainer's non-finite guard names the culprit with it (``train.nonfinite=stop``); the
instruments ``ember analyze RUN nonfinite`` and ``ember analyze CONFIG determinism``
(``ember.analysis.replay``) replay steps under it. It lives below both: a set of hooks on any
``nn.Module``, nothing of the trainer's.
"""

from __future__ import annotations

import math

import torch

from ember.parallel.dist import local

# (tensors are read through ``local``: a DTensor's shard, no collective in a hook that one rank
# stops calling once it has found its first non-finite tensor, which would leave the others waiting)


def stats(t: torch.Tensor) -> dict:
    t = local(t).detach().float()
    finite = t[torch.isfinite(t)]
    return {"shape": list(t.shape), "nonfinite": int((~torch.isfinite(t)).sum()),
            "absmax": finite.abs().max().item() if finite.numel() else math.nan,
            "mean": finite.mean().item() if finite.numel() else math.nan}  # fmt: skip


class Recorder:
    """Module outputs (forward), gradients at module outputs and parameter gradients (backward),
    in order, as ``(phase, name, tensor)``; ``keep`` clones them (for
    comparing runs), else only the first non-finite one and what came before it are kept."""

    def __init__(self, model: torch.nn.Module, keep: bool, backward: bool = True):
        self.keep, self.backward, self.events, self.first = keep, backward, [], None
        self.previous: dict | None = None  # statistics of the tensor seen before the current one
        self.handles = []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_hook(self._forward(name or "<model>")))
        for name, p in model.named_parameters() if backward else ():
            if p.requires_grad:  # after each backward has added to p.grad
                self.handles.append(p.register_post_accumulate_grad_hook(self._grad(name)))

    def _see(self, phase: str, name: str, t, fed: dict | None = None) -> None:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return
        if self.keep:
            self.events.append((phase, name, t.detach().clone()))
        elif self.first is None and not torch.isfinite(local(t)).all():
            self.first = {"phase": phase, "name": name, "tensor": stats(t), "before": fed or self.previous}
        self.previous = {"phase": phase, "name": name, **stats(t)} if not self.keep else None

    def _forward(self, name: str):
        def hook(module, args, out):
            t = out[0] if isinstance(out, tuple) else out
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            fed = {"phase": "forward", "name": f"{name} (its input)", **stats(x)} if x is not None and x.is_floating_point() and not self.keep else None  # fmt: skip # noqa: E501
            self._see("forward", name, t, fed)
            if self.backward and isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g: self._see("backward", name, g))

        return hook

    def _grad(self, name: str):
        return lambda p: self._see("parameter gradient", name, p.grad)

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
