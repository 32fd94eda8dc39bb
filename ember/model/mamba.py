"""Mamba (Gu and Dao 2023): a selective state-space mixer, ``model.mixer=mamba`` or an ``M`` in
``model.pattern`` (hybrids of attention and Mamba layers).

    cfg = ModelConfig(vocab_size=256, n_layer=2, d_model=64, mixer="mamba", pos="none", mlp="none",
                      norm="rmsnorm", bias=False)
    logits = GPT.build(cfg, seed=0)(torch.randint(0, 256, (2, 16)))    # (2, 16, 256)

Per channel d of the inner width (expand * d_model) and state index n (d_state of them), with
Δ, B, C computed from the input at every step (what makes the SSM *selective*):

    h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t u_t          h: (B, d_inner, d_state), A = -exp(A_log) < 0
    y_t = C_t · h_t + D u_t                         then y * silu(z), out_proj

(zero-order hold for A, Euler for B, as the paper's reference code). docs/mamba.md has the
math, the shapes and a measurement.

Design choices:

- **The scan is written twice, by hand**: ``sequential_scan`` (the recurrence, one step per
  token: the reference, and the decode step) and ``chunked_scan`` (within chunks of ``CHUNK``
  steps, every state at once by a doubling scan over the steps' affine maps; across chunks, the
  state carried by a short loop). The tests hold them equal within 1e-5 in fp32, forward and
  backward. By hand because the scan is what ember studies, and mamba-ssm's CUDA kernels do
  not run on the CPU machines ember is developed on.
- **Parameters are named as HF's ``MambaMixer``** (``in_proj``, ``conv1d``, ``x_proj``,
  ``dt_proj``, ``A_log``, ``D``, ``out_proj``), so that export to ``MambaForCausalLM`` is a
  renaming; dt_rank = ceil(d_model / 16), as Mamba-130m (no config key of its own).
- **The recurrence runs in fp32** whatever the autocast dtype (the paper's reference does the
  same: a state carried over thousands of steps in bf16, 8 bits of mantissa, drifts).
- **Inference state lives in the cache**, under the layer's id: the depthwise convolution's
  last d_conv - 1 inputs (B, d_inner, d_conv - 1) and the SSM state (B, d_inner, d_state). The
  cache calls the layer's ``mix`` on the rows it knows (``RecurrentCache.recur``: the engine's
  batch, or the paged server's sequences split out of its packed row). A prefill runs the
  chunked scan from zeros and stores the final states; each decode step is one recurrence step.
  Left pads (the engine's ragged batches) are zeroed before the convolution and before the scan,
  so a padded row's state equals its state alone (nothing flows in from a zero input and a zero
  state).
- This module does not import ember.model.gpt (gpt.py imports it): it initialises itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ember.config import ModelConfig
from ember.errors import ConfigError

CHUNK = 16  # steps per chunk of chunked_scan (docs/mamba.md: the measured choice)
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4  # Δ at init: log-uniform in [DT_MIN, DT_MAX] (Mamba-130m)

State = tuple[Tensor, Tensor]  # (conv (B, d_inner, d_conv - 1), ssm (B, d_inner, d_state))
Scan = Callable[..., tuple[Tensor, Tensor]]
Mix = Callable[[Tensor, State | None, Tensor | None], tuple[Tensor, State]]  # Mamba.mix


class RecurrentCache(Protocol):
    """What a Mamba layer needs of ``GPT.forward``'s cache (beside attention's ``KVCache``): as
    ``attend`` runs attention over the keys the cache holds, ``recur`` runs the layer's ``mix``
    over the rows the cache knows, each from the state it holds for that row."""

    def recur(self, layer: str, x: Tensor, mix: Mix) -> Tensor:
        """``mix``'s output for the new tokens ``x`` (B, T, C), calling ``mix(rows, state, pads)``
        with each row's state before them (None: zeros) and which of them are left pads ((B, T)
        bool, or None), and keeping the state it returns as ``layer``'s. engine.py's cache calls
        it once on the whole batch; the paged cache once per group of packed sequences."""
        ...


def dt_rank(d_model: int) -> int:
    """Rank of Δ's projection: ceil(d_model / 16) (Mamba's "auto", HF's ``time_step_rank``)."""
    return math.ceil(d_model / 16)


# ------------------------------------------------------------------ the two scans


def sequential_scan(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                    h: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The recurrence, one token at a time. u, dt (batch, T, d_inner); A (d_inner, d_state);
    B, C (batch, T, d_state); h the state before the first token, (batch, d_inner, d_state), or
    None for zeros. Returns y (batch, T, d_inner), without D u, and the state after the last."""
    if h is None:
        h = u.new_zeros(u.size(0), u.size(2), A.size(1))
    ys = []
    for t in range(u.size(1)):
        decay = torch.exp(dt[:, t, :, None] * A)  # (batch, d_inner, d_state)
        h = decay * h + (dt[:, t] * u[:, t])[:, :, None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))  # (batch, d_inner)
    return torch.stack(ys, dim=1), h


def chunked_scan(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                 h: Tensor | None = None, chunk: int = CHUNK) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``sequential_scan``'s result, ``chunk`` tokens at a time. Step t maps a state h to
    a_t h + x_t (a_t = exp(Δ_t A), x_t = Δ_t B_t u_t), and two steps compose into one of the
    same form: (a_t, x_t) after (a_s, x_s) is (a_t a_s, a_t x_s + x_t). Within a chunk, log2(chunk)
    rounds of that composition, every position at once, give each position the map from the
    chunk's start to itself (Hillis and Steele 1986, the doubling scan; Blelloch 1990 for
    scans of such pairs): then h_t = a_t h_0 + x_t for all t together. The state after the
    chunk starts the next one: T / chunk steps of Python instead of T.

    Only products of decays (<= 1) are formed, never exp(-cumsum), which overflows fp32 once the
    decays add up; the masked (t, s) form of Mamba-2's SSD would cost chunk times the work here,
    because Mamba-1's decay differs per (channel, state) (docs/mamba.md)."""
    batch, T, d_inner = u.shape
    if h is None:
        h = u.new_zeros(batch, d_inner, A.size(1))
    ys = []
    for start in range(0, T, chunk):
        span = slice(start, start + chunk)
        a = torch.exp(dt[:, span, :, None] * A)  # (batch, L, d_inner, d_state): each step's decay
        x = (dt[:, span] * u[:, span])[..., None] * B[:, span, None, :]  # (batch, L, d_inner, d_state)
        k = 1
        while k < a.size(1):  # now (a, x)[t] is the map over steps t - k + 1 .. t; double it
            x = x + a * F.pad(x[:, :-k], (0, 0, 0, 0, k, 0))  # the earlier half's x carried through a_t
            a = a * F.pad(a[:, :-k], (0, 0, 0, 0, k, 0), value=1.0)
            k *= 2
        states = x + a * h[:, None]  # (batch, L, d_inner, d_state): h_t for every t of the chunk
        ys.append(torch.einsum("btdn,btn->btd", states, C[:, span]))  # (batch, L, d_inner)
        h = states[:, -1]
    return torch.cat(ys, dim=1), h


SCANS: dict[str, Scan] = {"chunked": chunked_scan, "sequential": sequential_scan}


# ------------------------------------------------------------------ the mixer


class Mamba(nn.Module):
    """The Mamba mixer of one layer: in_proj to (x, z); causal depthwise conv and SiLU on x;
    Δ, B, C from x (x_proj, then dt_proj and softplus for Δ); the selective scan; gate by
    silu(z); out_proj. ``forward(x, rope, cache)`` as ``Attention``'s (rope ignored: Mamba
    needs no positions, its recurrence is ordered)."""

    def __init__(self, cfg: ModelConfig, layer_id: str) -> None:
        super().__init__()
        self.layer_id = layer_id  # the key a cache files this layer's state under
        d_inner, rank = cfg.expand * cfg.d_model, dt_rank(cfg.d_model)
        self.d_inner, self.d_state, self.rank = d_inner, cfg.d_state, rank
        self.in_proj = nn.Linear(cfg.d_model, 2 * d_inner, bias=cfg.bias)  # [x | z]
        # the convolution's weight (d_inner, 1, d_conv) as HF's; applied by F.conv1d on the state + x
        self.conv1d = nn.Conv1d(d_inner, d_inner, cfg.d_conv, groups=d_inner, padding=cfg.d_conv - 1)
        self.x_proj = nn.Linear(d_inner, rank + 2 * cfg.d_state, bias=False)  # [Δ low rank | B | C]
        self.dt_proj = nn.Linear(rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(d_inner, cfg.d_state))
        self.D = nn.Parameter(torch.empty(d_inner))
        self.out_proj = nn.Linear(d_inner, cfg.d_model, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.scan: Scan = chunked_scan  # set_scan(model, "sequential") for the reference
        self.n_layer = cfg.n_layer  # for the init of out_proj

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        """Mamba's init (the paper's reference code, HF's ``init_mamba_weights``): A = -(1..d_state)
        per channel (S4D-real), D = 1, Δ's bias the softplus-inverse of a log-uniform draw in
        [1e-3, 1e-1], dt_proj's weight uniform within ±rank^-0.5, the convolution as PyTorch's
        default (uniform within ±1/sqrt(d_conv)), zero conv bias; the projections N(0, std),
        out_proj at std / sqrt(2 * n_layer) (it writes to the residual stream)."""
        device = self.A_log.device
        for linear, s in ((self.in_proj, std), (self.x_proj, std),
                          (self.out_proj, std / math.sqrt(2 * self.n_layer))):  # fmt: skip
            nn.init.normal_(linear.weight, std=s, generator=generator)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        bound = 1 / math.sqrt(self.conv1d.weight.size(-1))
        nn.init.uniform_(self.conv1d.weight, -bound, bound, generator=generator)
        nn.init.zeros_(self.conv1d.bias)
        nn.init.uniform_(self.dt_proj.weight, -(self.rank**-0.5), self.rank**-0.5, generator=generator)
        r = torch.rand(self.d_inner, generator=generator, device=device)
        dt = torch.exp(r * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)).clamp(min=DT_FLOOR)
        self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt) = log(exp(dt) - 1)
        A = torch.arange(1, self.d_state + 1, dtype=torch.float32, device=device)
        self.A_log.copy_(torch.log(A).expand(self.d_inner, -1))
        self.D.fill_(1.0)

    def forward(self, x: Tensor, rope: object = None, cache: RecurrentCache | None = None) -> Tensor:
        y = self.mix(x)[0] if cache is None else cache.recur(self.layer_id, x, self.mix)
        return self.resid_dropout(y)

    def mix(self, x: Tensor, state: State | None = None, pads: Tensor | None = None) -> tuple[Tensor, State]:
        """The layer on rows x (batch, T, C) from ``state`` (None: zeros), ``pads`` (batch, T) bool
        marking left pads or None; the output (batch, T, C) and the state after the last token."""
        batch, T, _ = x.shape
        xs, z = self.in_proj(x).chunk(2, dim=-1)  # (batch, T, d_inner) each
        xs = xs.transpose(1, 2)  # (batch, d_inner, T)
        if pads is not None:  # a pad enters as zero: as if the row started at its first real token
            xs = xs.masked_fill(pads[:, None], 0.0)
        k = self.conv1d.weight.size(-1)
        if state is None:
            conv_state, h = xs.new_zeros(batch, self.d_inner, k - 1), None
        else:
            conv_state, h = state
        window = torch.cat([conv_state.to(xs.dtype), xs], dim=-1)  # (batch, d_inner, k - 1 + T)
        u = F.silu(F.conv1d(window, self.conv1d.weight, self.conv1d.bias, groups=self.d_inner))
        u = u.transpose(1, 2)  # (batch, T, d_inner)
        if pads is not None:
            u = u.masked_fill(pads[:, :, None], 0.0)
        dt, B, C = self.x_proj(u).split([self.rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt).float())  # (batch, T, d_inner), Δ > 0
        A = -torch.exp(self.A_log.float())  # (d_inner, d_state)
        # the recurrence in fp32 (module docstring); one step of it to decode a token after a prefill
        scan = sequential_scan if state is not None and T == 1 else self.scan
        y, h = scan(u.float(), dt, A, B.float(), C.float(), h)  # (batch, T, d_inner)
        y = y + u.float() * self.D.float()
        y = (y * F.silu(z.float())).to(x.dtype)
        return self.out_proj(y), (window[:, :, window.size(-1) - (k - 1) :], h)


def set_scan(model: nn.Module, kind: str) -> nn.Module:
    """Every Mamba layer of ``model`` scans with ``"chunked"`` (the default) or ``"sequential"``."""
    if kind not in SCANS:
        raise ConfigError(f"unknown scan {kind!r}; choose one of {', '.join(SCANS)}")
    for module in model.modules():
        if isinstance(module, Mamba):
            module.scan = SCANS[kind]
    return model


def scan_flops(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of one layer's scan beyond its matmuls: about 9 * d_inner * d_state
    (Mamba paper, section 3.3.2: discretise, update, read out)."""
    return 9 * cfg.expand * cfg.d_model * cfg.d_state
