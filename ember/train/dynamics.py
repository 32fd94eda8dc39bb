"""Training dynamics, logged by the trainer every ``train.log_dynamics`` steps (cheap enough to
leave on: one micro-batch observed, one copy of the weights, every N steps).

    metrics.jsonl:  "dyn/update_ratio/layers.3": 1.2e-3, "dyn/attn_entropy/layers.0/h1": 2.1, ...

Per parameter group (``layers.N``, the embedding, the head, the final norm): the weights' RMS,
the RMS of the step's update and their ratio (the size of a step relative to the weights:
~1e-3 is the usual healthy range for AdamW, larger means the learning rate is pushing hard);
per block, the RMS of its output (the residual stream growing with depth) and its kurtosis
(E[(x − μ)⁴]/σ⁴: 3 for a Gaussian, large when a few outlier features dominate, which is what
makes low-bit quantization hard); per layer and head, the entropy of the attention weights in
nats (log T for uniform attention, 0 for attention on one token: heads that collapse show it);
and the largest logit (growing logits are the first sign of the instability z-loss and soft-caps
are for). The attention weights, which the fused kernel never forms, are recomputed from the
same q and k for the observed micro-batch only. The report plots each family per layer.
"""

from __future__ import annotations

import math

import torch

from ember.model.gpt import layer_of


def _rms(t: torch.Tensor) -> float:
    return t.detach().float().pow(2).mean().sqrt().item()


def _kurtosis(t: torch.Tensor) -> float:
    x = t.detach().float().flatten()
    centred = x - x.mean()
    return (centred.pow(4).mean() / centred.pow(2).mean().clamp_min(1e-24).pow(2)).item()  # m4 / m2²


def _observing(attend, sink: list):
    """``attend`` that first records the per-head entropy of the causal softmax of q kᵀ/√d."""

    def observed(q, k, v, dropout_p, *args, **kwargs):
        if not sink:  # the first call of the step's first micro-batch only
            with torch.no_grad(), torch.autocast(q.device.type, enabled=False):  # fp32, also under fp16
                kk = k.repeat_interleave(q.size(1) // k.size(1), dim=1)  # grouped-query heads
                scores = (q.float() @ kk.float().transpose(-2, -1)) / math.sqrt(q.size(-1))
                T, S = scores.shape[-2:]
                mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
                p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
                entropy = -torch.special.xlogy(p, p).sum(-1)  # (B, heads, T); 0 log 0 = 0
                sink.append(entropy.mean(dim=(0, 2)))
        return attend(q, k, v, dropout_p, *args, **kwargs)

    return observed


class Dynamics:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.hooks, self.before, self.values = [], {}, {}
        self.entropy: dict[str, list] = {}
        self.attends: dict[str, object] = {}  # each layer's own attention function, while observed

    def begin(self) -> None:
        """Before the step: keep the weights; observe the first micro-batch's forward."""
        model = self.model
        self.before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        self.values = {}
        for name, block in model.layers.items():
            self.hooks.append(block.register_forward_hook(self._block(f"layers.{name}")))
            attention = block.attention
            self.entropy[name] = []
            if hasattr(attention, "attend"):  # a Mamba layer has no attention weights to observe
                self.attends[name] = attention.attend
                attention.attend = _observing(attention.attend, self.entropy[name])
        self.hooks.append(model.output.register_forward_hook(self._logits))

    def _block(self, name: str):
        def hook(module, args, out):
            if f"dyn/act_rms/{name}" not in self.values:
                self.values[f"dyn/act_rms/{name}"] = _rms(out)
                self.values[f"dyn/act_kurtosis/{name}"] = _kurtosis(out)

        return hook

    def _logits(self, module, args, out) -> None:
        self.values.setdefault("dyn/logit_max", out.detach().max().item())

    def end(self) -> dict[str, float]:
        """After the step: the record's ``dyn/...`` entries."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for name, block in self.model.layers.items():
            if name in self.attends:
                block.attention.attend = self.attends.pop(name)
            for h, e in enumerate(self.entropy[name][0].tolist() if self.entropy[name] else []):
                self.values[f"dyn/attn_entropy/layers.{name}/h{h}"] = e
        weight, update = {}, {}
        for n, p in self.model.named_parameters():
            if n not in self.before:
                continue
            group = layer_of(n)
            weight[group] = weight.get(group, 0.0) + p.detach().float().pow(2).sum().item()
            update[group] = update.get(group, 0.0) + (p.detach() - self.before[n]).float().pow(2).sum().item()
        counts: dict[str, int] = {}
        for n in self.before:
            counts[layer_of(n)] = counts.get(layer_of(n), 0) + self.before[n].numel()
        for group, w in weight.items():
            w_rms, u_rms = math.sqrt(w / counts[group]), math.sqrt(update[group] / counts[group])
            self.values[f"dyn/weight_rms/{group}"] = w_rms
            self.values[f"dyn/update_rms/{group}"] = u_rms
            self.values[f"dyn/update_ratio/{group}"] = u_rms / max(w_rms, 1e-12)
        self.before = {}
        return self.values
