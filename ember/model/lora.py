"""LoRA and QLoRA: low-rank adapters on frozen linears, the frozen base optionally in NF4.

    apply_lora(model, rank=8, alpha=16)                 # swaps the targeted linears, freezes the rest
    print(lora_summary(model))                          # "LoRA r=8: 73,728 trainable of ... (5.1%)"
    trainable, total = lora_counts(model)               # the same, as numbers
    with adapters_disabled(model): ref = model(idx)     # the base model, no second copy (DPO's reference)
    merge_lora(model)                                   # fold B·A into the weights: plain nn.Linear again
    ember.export.peft.save_peft(model, "adapter/")      # PEFT's format (file I/O lives in export/)

**LoRA** (Hu et al. 2021): ``y = x Wᵀ + b + (α / r) · dropout(x) Aᵀ Bᵀ``, W frozen, A (r × in)
PEFT's Kaiming-uniform (a = √5), B (out × r) zero, so training starts from the base model
exactly; ``merge_lora`` folds ``(α / r) B A`` into W (same logits, tested to 1e-5). **QLoRA**
(Dettmers et al. 2023): the frozen W in 4-bit NormalFloat (``NF4Linear``), blocks of 64 scaled
by their absolute maximum onto the 16 quantiles of a standard normal, the maxima themselves int8
in blocks of 256 (double quantization); the forward dequantizes and runs an fp32 ``linear``.
docs/sft.md ("LoRA and QLoRA") has the derivation, the measured figures and the PEFT layouts.

Written by hand, not with PEFT and bitsandbytes: adapters are what ember teaches (DESIGN), and
bitsandbytes has no CPU kernels for this machine. ``save_peft`` writes PEFT's format for both
``to_hf`` layouts (GPT-2's fused ``c_attn`` as one adapter of rank 3r), so
``PeftModel.from_pretrained`` on ember's exported base gives the adapted logits within 1e-5
(tests/test_lora.py). ``lora_state_dict`` holds only the adapters; both layer classes define
``init_weights(std, generator)``, so a wrapped meta model comes out whole (DESIGN rule 1).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ember.errors import EmberError
from ember.model.gpt import block_linears, init_module

DEFAULT_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")  # attention and MLP projections
# The NF4 code book as bitsandbytes and the QLoRA paper publish it (appendix E).
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)  # fmt: skip


def nf4_code_book(offset: float = 0.9677083) -> Tensor:
    """The code book built as the paper defines it: 8 positive levels at the normal quantiles of
    ``linspace(offset, 0.5, 9)`` and 7 negative ones at those of ``linspace(offset, 0.5, 8)``,
    an exact zero, all divided by the largest (``offset`` = (1 − 1/(2·15) + 1 − 1/(2·16)) / 2)."""
    ndtri = torch.special.ndtri
    positive = ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).sort().values
    return (values / values.abs().max()).float()


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is stored in NF4 (see the module docstring)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, block: int = 64, double_quant: bool = True):
        super().__init__()
        out_features, in_features = weight.shape
        if block % 2 or weight.numel() % block:
            raise EmberError(
                f"NF4: a {tuple(weight.shape)} weight does not split into blocks of {block}; "
                "give an even nf4_block that divides in_features * out_features (64 for ember's shapes)"
            )
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.double_quant = double_quant
        self.register_buffer("code", torch.tensor(NF4_CODE, device=weight.device))
        self.quantize_(weight)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

    @torch.no_grad()
    def quantize_(self, weight: Tensor) -> None:
        """Store ``weight`` (out, in) as NF4 codes and block maxima (replacing what was held)."""
        w = weight.detach().float().reshape(-1, self.block)  # (blocks, block)
        absmax = w.abs().amax(dim=1).clamp(min=1e-12)  # (blocks,)
        bounds = (self.code[1:] + self.code[:-1]) / 2  # a value takes the level whose interval holds it
        q = torch.bucketize(w / absmax[:, None], bounds).to(torch.uint8).reshape(-1)
        self.register_buffer("codes", (q[0::2] | (q[1::2] << 4)).contiguous())  # two 4-bit levels a byte
        if self.double_quant:  # QLoRA §3: the block maxima in 8 bits, blocks of 256, around their mean
            mean = absmax.mean()
            groups = F.pad(absmax - mean, (0, (-absmax.numel()) % 256)).reshape(-1, 256)
            scale = groups.abs().amax(dim=1).clamp(min=1e-12) / 127  # (groups,), one fp32 a group
            self.register_buffer("absmax_q", torch.round(groups / scale[:, None]).to(torch.int8))
            self.register_buffer("absmax_scale", scale)
            self.register_buffer("absmax_mean", mean)
        else:
            self.register_buffer("absmax", absmax)

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        """A fresh N(0, std) weight, quantized (``init_module``'s contract: a meta-built QLoRA
        model can be materialised with ``to_empty`` + ``init_weights``)."""
        self.code.copy_(torch.tensor(NF4_CODE))  # to_empty() left it uninitialised too
        weight = torch.empty(self.out_features, self.in_features, device=self.codes.device)
        nn.init.normal_(weight, mean=0.0, std=std, generator=generator)
        self.quantize_(weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def block_absmax(self) -> Tensor:
        if not self.double_quant:
            return self.absmax
        n = self.out_features * self.in_features // self.block
        return (self.absmax_q.float() * self.absmax_scale[:, None]).reshape(-1)[:n] + self.absmax_mean

    def dequantize(self) -> Tensor:
        """The fp32 weight (out, in) these codes stand for."""
        q = torch.stack([self.codes & 15, self.codes >> 4], dim=-1).reshape(-1, self.block)
        w = self.code[q.long()] * self.block_absmax()[:, None]
        return w.reshape(self.out_features, self.in_features)

    def storage_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for n, b in self.named_buffers() if n != "code")

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(
            x, self.dequantize().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        )


class _FrozenLoRA(torch.autograd.Function):
    """``x Wᵀ (+ b) + s · (x Aᵀ) Bᵀ`` for a frozen W, with the backward written out so that the
    two gradients of x (through W and through A) land in one buffer: ``addmm(g W, s · g B, A)``
    instead of two (…, in) tensors and their sum, as autograd would make them. Under autocast
    the forward's products run in its dtype (bf16) and the backward, which autocast does not
    reach, casts its operands to the same one; each gradient leaves in its input's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, A: Tensor, B: Tensor, scale: float):
        x2 = x.reshape(-1, x.size(-1))
        h = (x2 @ A.t()) * scale  # (M, r)
        y = torch.addmm(F.linear(x2, weight, bias), h, B.t())
        ctx.save_for_backward(x2, h, weight, A, B)
        ctx.scale, ctx.x_dtype = scale, x.dtype
        return y.view(*x.shape[:-1], y.size(-1))

    @staticmethod
    def backward(ctx, grad: Tensor):
        x2, h, weight, A, B = ctx.saved_tensors
        dt = h.dtype  # the forward's compute dtype (without autocast every .to below is a no-op)
        g = grad.reshape(-1, grad.size(-1)).to(dt)
        gh = g @ B.to(dt)  # (M, r): the gradient of h
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.addmm(g @ weight.to(dt), gh, A.to(dt), alpha=ctx.scale)
            grad_x = grad_x.view(*grad.shape[:-1], -1).to(ctx.x_dtype)
        grad_A = ((gh.t() @ x2.to(dt)) * ctx.scale).to(A.dtype) if ctx.needs_input_grad[3] else None
        grad_B = (g.t() @ h).to(B.dtype) if ctx.needs_input_grad[4] else None
        return grad_x, None, None, grad_A, grad_B, None


class LoRALinear(nn.Module):
    """``base(x) + (alpha / rank) · dropout(x) Aᵀ Bᵀ`` over a frozen ``base`` (nn.Linear or NF4Linear)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base, self.rank, self.alpha = base, rank, alpha
        self.in_features, self.out_features = base.in_features, base.out_features
        device = next(itertools.chain(base.parameters(), base.buffers())).device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.enabled = True  # False: the base alone (``adapters_disabled``)
        self.reset_adapters()

    @torch.no_grad()
    def reset_adapters(self, generator: torch.Generator | None = None) -> None:
        """A as PEFT draws it (Kaiming-uniform, a = √5: U(±1/√in)), B = 0, so B A = 0 at the start."""
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(self.lora_B)

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        """``init_module``'s contract: the base as the plain linear would be, then the adapters, so
        that a model built on meta, LoRA-wrapped, then ``to_empty`` + ``init_weights`` works."""
        init_module(self.base, std, generator)
        self.reset_adapters(generator)

    def forward(self, x: Tensor) -> Tensor:
        if not self.enabled:
            return self.base(x)
        base = self.base
        frozen = type(base) is nn.Linear and not any(p.requires_grad for p in base.parameters())
        if frozen and (isinstance(self.dropout, nn.Identity) or not self.training):
            return _FrozenLoRA.apply(x, base.weight, base.bias, self.lora_A, self.lora_B, self.scale)
        y = self.base(x)
        # the scale on the narrow (…, r) side, and the add inside B's matmul (addmm): no extra
        # passes over the (…, out) output, forward or backward
        h = F.linear(self.dropout(x), self.lora_A) * self.scale
        return torch.addmm(y.flatten(0, -2), h.flatten(0, -2), self.lora_B.t()).view_as(y)

    def merged_weight(self) -> Tensor:
        base = (
            self.base.dequantize() if isinstance(self.base, NF4Linear) else self.base.weight.detach().float()
        )
        return base + self.scale * (self.lora_B.detach().float() @ self.lora_A.detach().float())

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, base={type(self.base).__name__}"


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    return ((n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear))


def apply_lora(
    model: nn.Module,
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    targets: Sequence[str] = DEFAULT_TARGETS,
    nf4: bool = False,
    nf4_block: int = 64,
    double_quant: bool = True,
) -> nn.Module:
    """Freeze every parameter and swap each nn.Linear inside ``model.layers`` whose attribute
    name is in ``targets`` for a ``LoRALinear`` (its base in NF4 when ``nf4``: QLoRA). In place."""
    if rank < 1:
        raise EmberError(f"LoRA rank {rank}: give a rank of at least 1")
    for p in model.parameters():
        p.requires_grad_(False)
    linears = block_linears(model)
    names = {name for _, name, _ in linears}
    found = [(parent, name, child) for parent, name, child in linears if name in targets]
    missing = [] if tuple(targets) == DEFAULT_TARGETS else sorted(set(targets) - names)  # GPT-2 has no w3
    if missing or not found:
        raise EmberError(
            f"LoRA targets {missing or list(targets)} match no linear layer; the blocks' linears are "
            f"{', '.join(sorted(names))}"
        )
    for parent, name, linear in found:
        base = NF4Linear(linear.weight, linear.bias, nf4_block, double_quant) if nf4 else linear
        setattr(parent, name, LoRALinear(base, rank, alpha, dropout))
    return model


def lora_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; an NF4 weight counts as the in·out numbers it stands for."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    total += sum(m.out_features * m.in_features for m in model.modules() if isinstance(m, NF4Linear))
    return trainable, total


def lora_summary(model: nn.Module) -> str:
    """One line for the log: ``"LoRA r=8: 73,728 trainable of 1,450,000 parameters (5.08%)"``."""
    trainable, total = lora_counts(model)
    rank = next((layer.rank for _, layer in lora_layers(model)), 0)
    return f"LoRA r={rank}: {trainable:,} trainable of {total:,} parameters ({trainable / total:.2%})"


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model for the duration: every adapter off (DPO's reference, no copy held)."""
    layers = [m for _, m in lora_layers(model)]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m in layers:
            m.enabled = True


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every ``LoRALinear`` by a plain nn.Linear holding W + (α / r) B A. In place."""
    for name, layer in list(lora_layers(model)):
        parent, _, attr = name.rpartition(".")
        bias = layer.base.bias is not None
        merged = nn.Linear(layer.in_features, layer.out_features, bias=bias, device=layer.lora_A.device)
        merged.weight.copy_(layer.merged_weight())
        if bias:
            merged.bias.copy_(layer.base.bias)
        setattr(model.get_submodule(parent), attr, merged)
    return model


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapters alone: {"layers.0.attention.wq.lora_A": ..., ...}."""
    return {n: p.detach() for n, p in model.named_parameters() if ".lora_" in n}


def load_lora_state_dict(model: nn.Module, state: dict[str, Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = sorted(set(lora_state_dict(model)) - set(state))
    unknown = sorted(set(state) - set(params))
    if missing or unknown:
        raise EmberError(f"adapters do not fit this model: missing {missing[:3]}, unknown {unknown[:3]}")
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t)
