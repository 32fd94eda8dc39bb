"""Mixture-of-experts feed-forward (``model.mlp=moe``): token-choice top-k routing, dropless.

    cfg = ModelConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, mlp="moe", n_experts=8, top_k=2)
    model = GPT.build(cfg, seed=0)                 # each block's MLP is an MoE
    loss = ce + moe_loss(model)[0]                 # + Σ_layers (moe_aux · balance + moe_z · z-loss)

The math (Mixtral; Shazeer et al. 2017; Fedus et al. 2022 "Switch"; Zoph et al. 2022 "ST-MoE"),
for the N = B·T tokens x (N, C) of a block and E experts:

    logits = x Wr^T                     (N, E)    router, no bias
    p      = softmax(logits)            (N, E)    over *all* experts, in fp32
    w, e   = top_k(p)                   (N, k)    each token's k experts and their probabilities
    w      = w / Σ_k w                  (N, k)    renormalised (Mixtral; HF's MixtralTopKRouter)
    y_n    = Σ_j w_nj · SwiGLU_{e_nj}(x_n)  (+ SwiGLU_shared(x_n) with ``model.shared_expert``)

Dropless: the N·k (token, expert) pairs are sorted by expert (a stable argsort), each expert
multiplies the contiguous rows it got, however many (no capacity factor, no token dropped), and
the rows go back to token order. The experts run as **a loop over experts** on their row
slices, not ``torch._grouped_mm``: in torch 2.13 the grouped matmul is private, wants 16-byte
aligned strides, and its CPU backward fails on the expanded gradients autograd hands it; the
loop is plain matmuls that every device, autocast and FSDP2 support, and it costs one host sync
(the counts) per layer. Weights are stacked per kind, ``w1``/``w3`` (E, hidden, C) and ``w2``
(E, C, hidden), so FSDP2 shards them over experts (dim 0), expert parallelism keeps a slice of
dim 0 (ember/parallel/expert.py), and HF's fused ``gate_up_proj`` is ``cat(w1, w3, dim=1)``.

Auxiliary losses, per layer, kept in ``MoE.stats`` by the forward (so the block's signature,
and every layout that wraps it, stays x -> x) and collected by ``moe_loss(model)``:

    balance = E · Σ_i f_i · P_i,  f_i = (pairs routed to i) / N,  P_i = mean_n p_ni
              (Switch eq. 4-6 as HF's ``load_balancing_loss_func`` computes it for one layer;
              k at a perfectly even load, E·k when every token picks the same experts)
    z       = mean_n logsumexp(logits_n)²   (ST-MoE eq. 5: keeps router logits small)

and the loss adds Σ_layers (moe_aux · balance + moe_z · z) (OLMoE: α=0.01, β=0.001).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ember.config import ModelConfig


def expert_hidden_size(cfg: ModelConfig) -> int:
    """Each expert's SwiGLU width: ``model.mlp_hidden``, else 8d/3 rounded up to 64 (the dense
    SwiGLU's rule, ember/model/gpt.py ``mlp_hidden_size``, so an expert is one dense MLP)."""
    return cfg.mlp_hidden or -(-int(8 * cfg.d_model / 3) // 64) * 64


class Experts(nn.Module):
    """``n`` SwiGLU experts, w2(silu(w1 x) * w3 x) each, stacked: w1, w3 (n, hidden, C), w2 (n, C, hidden).

    ``forward(x, counts)``: x (M, C) rows sorted by expert, ``counts`` (n,) rows per expert;
    returns (M, C) in the same order. Expert parallelism replaces this module's forward, not
    the router's (ember/parallel/expert.py)."""

    def __init__(self, n: int, d_model: int, hidden: int, n_layer: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, d_model))  # gate
        self.w3 = nn.Parameter(torch.empty(n, hidden, d_model))  # up
        self.w2 = nn.Parameter(torch.empty(n, d_model, hidden))  # down
        self.n_layer = n_layer  # for the init of w2

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        # each expert as a dense MLP: N(0, std), the residual projection at std / sqrt(2 n_layer)
        for w in (self.w1, self.w3):
            nn.init.normal_(w, mean=0.0, std=std, generator=generator)
        nn.init.normal_(self.w2, mean=0.0, std=std / math.sqrt(2 * self.n_layer), generator=generator)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        return expert_loop(x, counts, self.w1, self.w3, self.w2)


def expert_loop(x: Tensor, counts: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    """x (M, C) sorted by expert, counts (n,): each expert's SwiGLU on its rows, (M, C)."""
    outs = []
    for e, rows in enumerate(x.split(counts.tolist())):  # (counts[e], C): the rows expert e got
        if rows.numel():
            h = F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())  # (counts[e], hidden)
            outs.append(h @ w2[e].t())
    return torch.cat(outs) if outs else x.new_zeros(0, x.size(-1))  # (M, C)


class MoE(nn.Module):
    """Router + ``n_experts`` SwiGLU experts (+ a shared one); see the module docstring."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = expert_hidden_size(cfg)
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.aux_weight, self.z_weight = cfg.moe_aux, cfg.moe_z
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.d_model, hidden, cfg.n_layer)
        self.shared = Experts(1, cfg.d_model, hidden, cfg.n_layer) if cfg.shared_expert else None
        self.dropout = nn.Dropout(cfg.dropout)
        self.stats: dict[str, Tensor] | None = None  # the last forward's losses and load

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        nn.init.normal_(self.router.weight, mean=0.0, std=std, generator=generator)
        for experts in (self.experts, self.shared):
            if experts is not None:
                experts.init_weights(std, generator)

    def idle_params(self) -> int:
        """Parameters a token does not use: the n_experts - top_k experts it was not routed to."""
        per_expert = sum(math.prod(w.shape[1:]) for w in (self.experts.w1, self.experts.w3, self.experts.w2))
        return (self.n_experts - self.top_k) * per_expert

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (N, C) -> router logits (N, E) fp32, weights (N, k), expert ids (N, k)."""
        logits = self.router(x).float()  # (N, E)
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (N, k), by descending probability
        return logits, weights / weights.sum(dim=-1, keepdim=True), experts

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        x = x.reshape(B * T, C)  # (N, C)
        logits, weights, experts = self.route(x)
        flat = experts.flatten()  # (N*k,): pair j is token j // k
        order = flat.argsort(stable=True)  # the pairs sorted by expert
        counts = torch.bincount(flat, minlength=self.n_experts)  # (E,)
        y = self.experts(x[order // self.top_k], counts)  # (N*k, C), sorted by expert
        y = y[order.argsort()].view(B * T, self.top_k, C)  # back to token order
        out = (y * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)  # (N, C)
        if self.shared is not None:
            out = out + self.shared(x, counts.new_full((1,), B * T))
        self.stats = aux_stats(logits, counts, self.n_experts)
        return self.dropout(out.view(B, T, C))


def aux_stats(logits: Tensor, counts: Tensor, n_experts: int) -> dict[str, Tensor]:
    """One layer's ``balance`` and ``z`` losses (module docstring) and ``load``, the share of
    the (token, expert) pairs each expert got, (E,), detached (what the report draws)."""
    N = logits.size(0)
    probs = logits.softmax(dim=-1)  # (N, E)
    f = counts.float() / N  # sums to k
    balance = n_experts * (f * probs.mean(dim=0)).sum()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    return {"balance": balance, "z": z, "load": (counts.float() / counts.sum()).detach()}


def moe_loss(model: nn.Module) -> tuple[Tensor | float, dict[str, Tensor]]:
    """Σ_layers (moe_aux · balance + moe_z · z) of the last forward of ``model``, and per-layer
    metrics: ``moe_balance.L``, ``moe_z.L`` and ``moe_load.L.e`` (L counts the MoE layers in
    order; a DDP/FSDP/checkpoint wrapper is looked through). (0.0, {}) for a model without MoE."""
    total: Tensor | float = 0.0
    metrics: dict[str, Tensor] = {}
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.stats is not None]
    for i, moe in enumerate(layers):
        stats, moe.stats = moe.stats, None  # the graph is the loss's now
        total = total + moe.aux_weight * stats["balance"] + moe.z_weight * stats["z"]
        metrics[f"moe_balance.{i}"] = stats["balance"].detach()
        metrics[f"moe_z.{i}"] = stats["z"].detach()
        metrics |= {f"moe_load.{i}.{e}": share for e, share in enumerate(stats["load"])}
    return total, metrics
