"""Optimizers (AdamW, Muon for the hidden matrices, or SGD), their parameter groups, and the
learning-rate schedule.

    optimizer = build_optimizer(model, cfg.train, device)    # train.optimizer: adamw | muon | sgd
    lr = lr_at(step, progress, cfg.train, peak=group["peak_lr"])   # progress in [0, 1]

Parameters fall into five roles (docs/muon.md has the table): ``hidden`` (block matrices, and a
mixture of experts' stacks, each expert's matrix on its own: AdamW with decay, or Muon), ``head``
(untied), ``embed`` (and a tied head), ``vector`` (norms, biases, Mamba's A_log, LoRA's A) and
``lora_b`` (LoRA's B at ``train.lr × train.lora_plus``: LoRA+, Hayou et al. 2024, B starts at
zero and learns faster with a larger rate). Roles whose settings coincide share one group, so
the default AdamW run keeps its two groups, numbers and checkpoints; each group's peak
is ``group["peak_lr"]``.

Design choices:

- ``torch.optim.AdamW``: ``fused=True`` on CUDA (one kernel per update), ``foreach=True`` on CPU;
  ``torch.optim.SGD`` (``train.momentum``, ``train.nesterov``) alike, with the same groups.
- ``Muon`` is written out here by hand, AdamW for its non-matrix groups included: the
  optimizer is a subject of study in this lab, so its every line should be readable and
  changeable; and ``torch.optim.Muon`` (torch >= 2.9) takes matrices only and always runs
  Newton–Schulz in bf16. ``tests/test_optim.py`` checks ours against it.
- Muon's update scale is Keller Jordan's ``max(1, rows/cols) ** 0.5`` (the "original" of
  ``torch.optim.Muon``), so ``muon_lr`` is about 0.02, not AdamW-sized. Newton–Schulz runs in
  fp32 on the CPU (exact resume and rank parity hold to the bit) and bf16 on CUDA, where
  same-shape matrices are updated as one stack (``Muon._muon_stack``) and the AdamW groups
  use torch's fused kernel: per parameter, the step's launches cost 26% on an H200.
- Under FSDP2 a matrix is a DTensor sharded on dim 0, and orthogonalising a shard is not
  orthogonalising the matrix: each rank gathers the full momentum-updated matrix, runs
  Newton–Schulz on it (every rank the same), and keeps its own rows of the result.
- The schedule is a pure function of (step, progress): warmup is counted in steps, the
  decay in the fraction of the budget used, so the same config works for a step, token or
  wall-clock budget, and resuming needs no scheduler state beyond the step and progress.
"""

from __future__ import annotations

import math

import torch
from torch.optim.adamw import adamw

# Keller Jordan (2024), "Muon": a quintic p(x) = a x + b x^3 + c x^5 chosen for a steep slope
# at 0, so 5 steps lift small singular values near 1 (to roughly 0.7..1.2, not exactly 1).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

EXPERT_STACKS = ("w1", "w2", "w3")  # model/moe.py's (experts, rows, cols): one matrix per expert
ROLES = ("hidden", "head", "embed", "vector", "lora_b")  # the order of the groups


def orthogonalize(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximately U Vᵀ for G = U S Vᵀ, by ``steps`` quintic Newton–Schulz iterations:

        X₀ = G / ‖G‖_F,   A = X Xᵀ,   X ← a X + (b A + c A²) X

    Each step maps every singular value σ to p(σ) and leaves U, V alone. Dividing by the
    Frobenius norm (≥ the spectral norm) puts all σ in [0, 1] first. A wide X (rows ≤ cols)
    keeps the Gram matrix A at the small side, so a tall G is transposed and back. ``g`` may
    be a stack (n, rows, cols) of same-shape matrices: one batched chain (``baddbmm``) for all."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    batched = x.dim() == 3
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) if batched else x.norm()
    x = x / norm.clamp_min(1e-7)
    mm = torch.baddbmm if batched else torch.addmm
    for _ in range(steps):
        gram = x @ x.mT  # (r, r), r = min(rows, cols); (n, r, r) batched
        # addmm scales, multiplies and adds in one kernel, rounding once: in bf16 on a GPU
        # that halves the error of the step against fp32 (benchmarks/muon_gpu.py)
        poly = mm(gram, gram, gram, beta=b, alpha=c)  # b A + c A²
        x = mm(x, poly, x, beta=a)  # a X + (b A + c A²) X
    if tall:
        x = x.mT
    return x.to(g.dtype)


def _orthogonalize_any(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """``orthogonalize`` for a plain tensor, or for a DTensor shard: gather, orthogonalise the
    whole matrix on every rank, keep this rank's part."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(update, DTensor):
        return orthogonalize(update, steps, dtype)
    full = orthogonalize(update.full_tensor(), steps, dtype)
    mesh = update.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, update.placements)  # Replicate → Shard: a local slice


class Muon(torch.optim.Optimizer):
    """Muon (MomentUm Orthogonalized by Newton–Schulz) on the groups with ``use_muon=True``,
    AdamW on the others.

    Muon, per matrix W (rows × cols) with gradient G:

        B ← μ B + (1 − μ) G                    momentum (an EMA: Newton–Schulz normalises,
        M = (1 − μ) G + μ B  (Nesterov) or B    so the 1 − μ factor changes nothing)
        W ← W (1 − lr·wd) − lr · max(1, rows/cols)^½ · NS₅(M)

    AdamW (Loshchilov & Hutter), decoupled decay, bias-corrected moments. ``ns_dtype`` None
    means fp32 on the CPU, bf16 on CUDA. ``batched`` None means CUDA's road, False the CPU's:

    - batched: each set of same-shape plain matrices is stacked, and its momentum, one
      Newton–Schulz chain (``baddbmm``) and the weight update run on the stack, a dozen
      launches per shape (gpt2-small: 3 shapes, 72 matrices); the AdamW groups go through
      torch's fused AdamW kernel (``torch.optim.adamw.adamw``, fused), which takes a
      skipped step off its count as ``torch.optim.AdamW(fused=True)`` does. On an H200,
      gpt2-small's Muon step took 15.4 ms more than fused AdamW's (26% fewer tokens/s) on
      the per-parameter road, whose tiny launches grow with the parameters (2,000 or so).
    - per parameter, in fp32 on the CPU: every run keeps its bits there (a stack's fp32
      ``bmm`` may round differently from ``mm``), and a skipped step still counts in AdamW's
      bias correction."""

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        ns_dtype: torch.dtype | None = None,
        batched: bool | None = None,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            use_muon=True,
        )
        super().__init__(params, defaults)
        self.ns_dtype, self.batched = ns_dtype, batched
        for group in self.param_groups:
            bad = [tuple(p.shape) for p in group["params"] if p.ndim not in (2, 3)]
            if group["use_muon"] and bad:
                raise ValueError(f"Muon orthogonalises matrices (or stacks of them); got shapes {bad[:3]}")

    @torch.no_grad()
    def step(self, closure=None):
        """One update. ``self.found_inf``, when set (a 0-dim float tensor on the device, as
        ``torch.optim.AdamW(fused=True)`` reads it), skips the update on the device where it
        is nonzero, with no host sync: every new moment and weight is computed, then kept
        only where ``found_inf`` is 0 (``torch.where``; NaN never leaks in)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        found = None if found_inf is None else found_inf.bool()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            plain = not any(hasattr(p, "device_mesh") for p in params)  # DTensors: per parameter
            batched = plain and (params[0].device.type == "cuda" if self.batched is None else self.batched)
            if group["use_muon"]:
                self._muon(group, params, found, batched)
            elif batched:
                self._fused_adamw(group, params, found_inf)
            else:
                self._adamw(group, params, found)
        return loss

    def _muon(self, group: dict, params: list, found, batched: bool) -> None:
        dtype = self.ns_dtype or (torch.bfloat16 if params[0].device.type == "cuda" else torch.float32)
        for p in params:
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
        stacks: dict[tuple, list] = {}
        for p in params:
            key = (tuple(p.shape), p.dtype) if batched and p.ndim == 2 else id(p)
            stacks.setdefault(key, []).append(p)
        for same in stacks.values():
            if len(same) > 1:
                self._muon_stack(group, same, found, dtype)
            else:
                self._muon_one(group, same[0], found, dtype)

    def _muon_one(self, group: dict, p, found, dtype) -> None:
        """The update of one matrix (or one stack of experts, each matrix on its own)."""
        buf = self.state[p]["momentum_buffer"]
        orth = lambda m: _orthogonalize_any(m, group["ns_steps"], dtype)  # noqa: E731
        new_buf, new = _muon_update(group, p, p.grad, buf, orth)
        _commit(buf, new_buf, found)
        _commit(p, new, found)

    def _muon_stack(self, group: dict, params: list, found, dtype) -> None:
        """``_muon_one`` for same-shape matrices at once, on their stack: the same arithmetic
        element by element, one Newton–Schulz chain (``baddbmm``) instead of one per matrix."""
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        buf, weight = torch.stack(bufs), torch.stack(params)
        orth = lambda m: orthogonalize(m, group["ns_steps"], dtype)  # noqa: E731
        new_buf, new = _muon_update(group, weight, torch.stack([p.grad for p in params]), buf, orth)
        torch._foreach_copy_(bufs, _kept(buf, new_buf, found).unbind(0))
        torch._foreach_copy_(params, _kept(weight, new, found).unbind(0))

    def _adamw(self, group: dict, params: list, found) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in params:
            g = p.grad
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(g)
                state["exp_avg_sq"] = torch.zeros_like(g)
            state["step"] += 1
            step = state["step"].item()  # a CPU tensor: no device sync
            exp_avg = state["exp_avg"].lerp(g, 1 - beta1)
            exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul_(g, g, value=1 - beta2)
            bias1, bias2 = 1 - beta1**step, 1 - beta2**step
            denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(eps)
            new_p = p.mul(1 - lr * wd).addcdiv_(exp_avg, denom, value=-lr / bias1)
            for old, new in ((state["exp_avg"], exp_avg), (state["exp_avg_sq"], exp_avg_sq), (p, new_p)):
                _commit(old, new, found)

    def _fused_adamw(self, group: dict, params: list, found_inf) -> None:
        """The same AdamW in torch's fused kernel: all the group's tensors in a few launches."""
        for p in params:
            state = self.state[p]
            if not state:
                state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
            step = state.get("step")
            if step is None or step.device != p.device:  # the fused kernel reads it on the device
                state["step"] = torch.zeros((), device=p.device) if step is None else step.to(p.device)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            fused=True,
            found_inf=found_inf,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def _muon_update(group: dict, weight, grad, buf, orthogonalize_fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Muon's arithmetic (the class docstring) on one matrix or a stack of same-shape ones:
    the new momentum buffer and the new weight, neither committed yet."""
    lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
    new_buf = buf.lerp(grad, 1 - mu)
    moment = grad.lerp(new_buf, mu) if group["nesterov"] else new_buf
    rows, cols = weight.shape[-2:]
    scale = lr * max(1.0, rows / cols) ** 0.5
    return new_buf, weight.mul(1 - lr * wd).add_(orthogonalize_fn(moment), alpha=-scale)


def _kept(old: torch.Tensor, new: torch.Tensor, found) -> torch.Tensor:
    """``new``, or ``old`` where the step is skipped (``found``, on the device; NaN never leaks)."""
    return new if found is None else torch.where(found, old, new)


def _commit(old: torch.Tensor, new: torch.Tensor, found) -> None:
    """``old ← new``, or keep ``old`` where the step is skipped."""
    old.copy_(_kept(old, new, found))


# ---------------------------------------------------------------- groups


def param_role(name: str, p: torch.Tensor, embeddings: set[int]) -> str:
    """'embed', 'hidden', 'head' or 'vector' for the parameter called ``name``. LoRA adapters
    take the vector role: AdamW at train.lr without decay (PEFT's usual setting), never Muon,
    whose orthogonalized update is made for full weight matrices. A table that trains only some
    rows (``row_mask``: LoRA's chat tokens) takes the embedding role: no decay moves the rest."""
    if id(p) in embeddings or hasattr(p, "row_mask"):  # an embedding, or a head training rows
        return "embed"
    if ".lora_" in name:
        return "lora_b" if ".lora_B" in name else "vector"
    parts = name.split(".")
    if parts[-1] == "A_log":  # Mamba's decay rates: a table, not a map (mamba-ssm keeps it from decay)
        return "vector"
    if "layers" in parts and (p.ndim == 2 or (p.ndim == 3 and parts[-1] in EXPERT_STACKS)):
        return "hidden"
    return "head" if p.ndim >= 2 else "vector"


def param_groups(model: torch.nn.Module, train_cfg) -> list[dict]:
    """One group per distinct setting of the four roles (see the module docstring); every
    group carries ``peak_lr`` and ``role`` (e.g. 'hidden+head' when two roles share it)."""
    t = train_cfg
    muon = t.optimizer == "muon"
    settings = {
        "hidden": {
            "peak_lr": t.muon_lr if muon else t.lr,
            "weight_decay": t.muon_weight_decay if muon else t.weight_decay,
        },
        "head": {"peak_lr": t.head_lr or t.lr, "weight_decay": t.weight_decay},
        "embed": {"peak_lr": t.embed_lr or t.lr, "weight_decay": 0.0},
        "vector": {"peak_lr": t.lr, "weight_decay": 0.0},
        "lora_b": {"peak_lr": t.lr * t.lora_plus, "weight_decay": 0.0},
    }
    for role, s in settings.items():
        if muon:
            s["use_muon"] = role == "hidden"
    groups: dict[tuple, dict] = {}
    for role in ROLES:
        key = tuple(sorted(settings[role].items()))
        group = groups.setdefault(key, {"params": [], "roles": [], **settings[role]})
        group["roles"].append(role)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    by_role = {role: groups[tuple(sorted(settings[role].items()))] for role in ROLES}
    used = set()
    for name, p in model.named_parameters():
        if p.requires_grad:
            used.add(role := param_role(name, p, embeddings))
            by_role[role]["params"].append(p)
    out = []
    for group in groups.values():
        if group["params"]:
            roles = [r for r in group.pop("roles") if r != "lora_b" or r in used]  # names as before LoRA+
            out.append({**group, "role": "+".join(roles), "lr": group["peak_lr"]})
    return out


def build_optimizer(model: torch.nn.Module, train_cfg, device: torch.device) -> torch.optim.Optimizer:
    t = train_cfg
    if t.optimizer == "muon":
        return Muon(
            param_groups(model, t),
            lr=t.muon_lr,
            momentum=t.muon_momentum,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
        )
    kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
    if t.optimizer == "sgd":  # (the seeds' baseline: decay on matrices only, as AdamW's groups)
        groups = param_groups(model, t)
        return torch.optim.SGD(groups, lr=t.lr, momentum=t.momentum, nesterov=t.nesterov, **kind)
    if len({type(p) for p in model.parameters()}) > 1:  # tensor parallel: DTensors beside plain
        kind = {"foreach": False}  # tensors, which one multi-tensor kernel cannot take together
    return torch.optim.AdamW(param_groups(model, t), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **kind)


# ---------------------------------------------------------------- schedule


def lr_at(step: int, progress: float, train_cfg, peak: float | None = None) -> float:
    """Learning rate for optimizer step ``step`` (0-based) at ``progress`` of the budget, for a
    group whose peak is ``peak`` (default ``train.lr``)."""
    peak = train_cfg.lr if peak is None else peak
    floor = peak * train_cfg.min_lr_ratio
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
