"""The decoder: one ``GPT`` class that is GPT-2 or Llama-style depending on its ``ModelConfig``.

    cfg = ModelConfig(vocab_size=512, n_layer=2, n_head=4, d_model=64, max_seq_len=128)
    model = GPT.build(cfg, seed=0)                        # meta -> to_empty -> init_weights
    logits = model(torch.randint(0, 512, (2, 16)))        # (2, 16, 512), fp32

Design choices:

- Options are chosen once, in ``__init__``, by constructing the right submodule
  (LayerNorm or RMSNorm, GELU, SwiGLU, ReLU² or mixture-of-experts MLP (moe.py), learned or
  rotary positions, RMSNorm or Identity for qk_norm, SoftCap or Identity for the logits) or by
  storing the right function (``Attention.rotate``, ``Attention.attend``). ``forward`` never reads
  the config.
- Built on meta, materialised by ``to_empty()`` and ``init_weights()`` (DESIGN rule 1). The
  RoPE tables are non-persistent buffers, recomputed by ``init_buffers()`` (which
  ``init_weights()`` calls): after ``to_empty()`` + ``load_state_dict()``, call it.
- Each module initialises what it owns, so what a transformation swaps in (a LoRA wrapper,
  a quantized linear, an MoE) is initialised too: ``init_module(m, std, generator)`` calls
  ``m.init_weights(std, generator)`` where m defines it, else draws N(0, std) (zero bias),
  resets a norm, or recurses into m's children. Residual branches draw ``wo``, ``w2`` at
  std / sqrt(2 * n_layer) (GPT-2 paper, section 2.3), a wrapper of ``wo`` included.
- RoPE uses the rotate-half convention of GPT-NeoX and HF Llama: dimension ``i``
  pairs with ``i + head_dim/2`` (Meta's complex form pairs ``2i`` with ``2i+1``).
  Export to HF is then a renaming, with no permutation of ``wq``/``wk`` rows.
- Head counts are read from the weight shapes (``view(B, T, -1, head_dim)``), so
  tensor parallelism may shard the rows of ``wq, wk, wv`` and the columns of ``wo``.
- Attention is ``F.scaled_dot_product_attention`` (GQA by ``enable_gqa``);
  ``model.set_attention("reference")`` swaps in softmax(QK^T/sqrt(d) + mask) V for tests.
- ``model.causal=false`` (a masked LM, docs/mlm.md) attends with ``full_attention``, no mask;
  ``model.norm_position=post`` builds ``PostNormBlock`` with a norm on the embeddings and none at
  the end; ``model.head=mlm`` puts BERT's transform (ember/model/encoder.py) before a tied,
  biased ``output``. Together they are HF BERT's layout.
- The optional inference cache (the ``KVCache`` protocol below) owns everything about the
  tokens held: positions, storage sized from the keys it receives (a TP shard's heads, a
  wrapped ``wk``) and the attention kernel. Without one, positions are 0 .. T-1 and attention is
  plainly causal; the model knows nothing of padding or per-row lengths.
- ``forward(idx, keep=mask)`` returns only the masked positions' logits: a second argument
  beyond the cache that DESIGN rule 1 allows, because losses that read a few positions (SFT's
  and DPO's replies) would otherwise pay for the head, most of a small model's step, everywhere.
- Tied embeddings share one Parameter; ``to_empty()`` would untie it, so ``GPT.to_empty`` ties again.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ember.config import ModelConfig
from ember.errors import ConfigError
from ember.model.encoder import MLMTransform
from ember.model.mamba import Mamba, scan_flops
from ember.model.moe import MoE

Rope = tuple[Tensor, Tensor]  # (cos, sin), each (1 or B, 1, T, head_dim / 2)


class KVCache(Protocol):
    """What ``GPT.forward(idx, cache)`` needs from an inference cache (ember/infer builds them):
    a forward of T new tokens calls ``extend(T)`` once, then every attention layer calls ``attend``
    once; a model with Mamba layers needs ``recur`` too (``RecurrentCache``, mamba.py)."""

    def extend(self, T: int) -> Tensor:
        """Take T more tokens in every row; their position ids, (T,) or (B, T)."""
        ...

    def attend(self, layer: str, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Hold k, v (B, n_kv_head, T, head_dim) of ``layer``'s new tokens; return the causal
        attention of q (B, n_head, T, head_dim) over the row's held keys, (B, n_head, T, head_dim)."""
        ...


def mlp_hidden_size(cfg: ModelConfig) -> int:
    """The MLP width: ``cfg.mlp_hidden``, or 4*d (GELU, ReLU²), or 8d/3 rounded up to 64 (SwiGLU,
    which has three matrices instead of two, so this keeps the parameter count of 4*d)."""
    if cfg.mlp_hidden:
        return cfg.mlp_hidden
    if cfg.mlp in ("gelu", "relu2"):
        return 4 * cfg.d_model
    return -(-int(8 * cfg.d_model / 3) // 64) * 64


@torch.no_grad()
def block_linears(
    model: nn.Module, types: tuple[type, ...] = (nn.Linear,)
) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) for every linear inside ``model.layers`` whose exact type is in
    ``types``: what the transformations applied from outside (quantize, QAT, LoRA) swap."""
    return [
        (parent, name, child)
        for parent in model.layers.modules()
        for name, child in parent.named_children()
        if type(child) in types
    ]


def grow_vocab(state: dict[str, Tensor], vocab_size: int, known: int) -> dict[str, Tensor]:
    """``state`` with its embedding and head at ``vocab_size`` rows: rows below ``known`` (the
    old tokenizer's ids) kept, every row from ``known`` on the mean of those (the tokens a
    fine-tune adds, and padding rows, which never trained). Hewitt (2021) argues for the mean:
    a new token then starts with the average logit, not a random one that could dominate."""
    out = dict(state)
    for name in ("tok_embeddings.weight", "output.weight"):
        if name in state:
            w = state[name][:known]
            out[name] = torch.cat([w, w.mean(0, keepdim=True).expand(vocab_size - known, -1)])
    return out


def init_module(module: nn.Module, std: float, generator: torch.Generator | None = None) -> None:
    """Initialise ``module`` and what it holds (the contract is in the module docstring)."""
    if hasattr(module, "init_weights"):
        module.init_weights(std, generator)
    elif isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std, generator=generator)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif hasattr(module, "reset_parameters"):  # norms: ones, zeros
        module.reset_parameters()
    elif [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
        raise TypeError(f"{type(module).__name__} holds tensors but defines no init_weights(std, generator)")
    else:  # a container: its children in order
        for child in module.children():
            init_module(child, std, generator)


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


# ------------------------------------------------------------------ positions


class LearnedPositions(nn.Module):
    """GPT-2: a learned vector per position, added to the token embeddings."""

    def __init__(self, max_seq_len: int, d_model: int) -> None:
        super().__init__()
        self.wpe = nn.Embedding(max_seq_len, d_model)

    def forward(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Rope | None]:
        return x + self.wpe(positions), None  # positions (T,) or (B, T) broadcast over B


class RotaryPositions(nn.Module):
    """RoPE (Su et al. 2021): leaves x alone and hands the attention layers the
    cos/sin tables for positions start .. start + T - 1."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        # RoFormer eq. 15: pair i turns by angle pos * theta^(-2i/head_dim). Computed in fp32 the
        # way Meta's and HF's Llama code do, so imported checkpoints give the same logits bit for
        # bit (fp64 tables differ by ~3e-7, which moves logits by ~5e-6).
        device = self.cos.device
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        positions = torch.arange(self.cos.size(0), dtype=torch.float32, device=device)
        angles = torch.outer(positions, 1.0 / self.theta**exponent)  # (max_seq_len, head_dim / 2)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        self.init_buffers()

    def forward(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Rope | None]:
        # (T, hd/2) -> (1, T, hd/2), or (B, T, hd/2) -> (B, 1, T, hd/2): broadcast over heads
        return x, (self.cos[positions].unsqueeze(-3), self.sin[positions].unsqueeze(-3))


def apply_rotary(x: Tensor, rope: Rope) -> Tensor:
    """Rotate x (B, heads, T, head_dim): dimension i pairs with i + head_dim/2 (rotate-half)."""
    cos, sin = rope  # (1 or B, 1, T, head_dim / 2), broadcast over heads
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotate_qk(q: Tensor, k: Tensor, rope: Rope | None) -> tuple[Tensor, Tensor]:
    assert rope is not None
    return apply_rotary(q, rope), apply_rotary(k, rope)


def keep_qk(q: Tensor, k: Tensor, rope: Rope | None) -> tuple[Tensor, Tensor]:
    return q, k


# ------------------------------------------------------------------ attention


def causal_mask(t_q: int, t_k: int, device: torch.device) -> Tensor:
    """(t_q, t_k) bool, True where a query may look. The queries are the last t_q of the
    t_k positions (bottom-right aligned), as when decoding after a cache."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=t_k - t_q)


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, mask: Tensor | None = None) -> Tensor:
    """q (B, n_head, T, hd); k, v (B, n_kv_head, S, hd) -> (B, n_head, T, hd). ``mask``
    (B, 1, T, S) bool, True where a query may look, replaces the causal mask when given."""
    gqa = q.size(1) != k.size(1)  # query head h reads key/value head h // (n_head / n_kv_head)
    if mask is None and q.size(-2) == k.size(-2):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)
    if mask is None and q.size(-2) == 1:  # one new query after a cache sees every key: no mask to build
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, enable_gqa=gqa)
    if mask is None:
        mask = causal_mask(q.size(-2), k.size(-2), q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


def full_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, mask: Tensor | None = None) -> Tensor:
    """Bidirectional (``model.causal=false``, BERT): every query sees every key, unless ``mask``."""
    gqa = q.size(1) != k.size(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float, mask: Tensor | None = None
) -> Tensor:
    """The formula, for tests: softmax(Q K^T / sqrt(hd) + mask) V, the causal mask by default."""
    n_rep = q.size(1) // k.size(1)
    k = k.repeat_interleave(n_rep, dim=1)  # (B, n_head, S, hd)
    v = v.repeat_interleave(n_rep, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, n_head, T, S)
    if mask is None:
        mask = causal_mask(q.size(-2), k.size(-2), q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = F.dropout(scores.softmax(dim=-1), p=dropout_p)
    return weights @ v  # (B, n_head, T, hd)


def full_reference_attention(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float, mask: Tensor | None = None
) -> Tensor:
    """The formula with no mask: a bidirectional model's ``set_attention("reference")``."""
    everything = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device)
    return reference_attention(q, k, v, dropout_p, everything if mask is None else mask)


def kernel_attention(flash: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, dropout_p: float,
                     mask: Tensor | None = None) -> Tensor:  # fmt: skip
    """``flash`` (ember.kernels.attention) where it applies, training's causal square without
    dropout; SDPA for the rest (a mask, a query after a cache)."""
    if dropout_p or mask is not None or q.size(-2) != k.size(-2):
        return sdpa_attention(q, k, v, dropout_p, mask)
    return flash(q, k, v, causal=True)


def kernel_rotate(rope_qk: Callable[..., tuple[Tensor, Tensor]], q: Tensor, k: Tensor, rope: Rope | None):
    assert rope is not None
    return rope_qk(q, k, *rope)  # one kernel for q and k (ember.kernels.rope)


KERNELS = ("torch", "triton")
ATTENTION: dict[str, Callable[..., Tensor]] = {
    "sdpa": sdpa_attention,
    "reference": reference_attention,
}
FULL_ATTENTION: dict[str, Callable[..., Tensor]] = {  # model.causal=false
    "sdpa": full_attention,
    "reference": full_reference_attention,
}


class Attention(nn.Module):
    """Self-attention, causal or (``model.causal=false``) bidirectional, with optional GQA, RoPE and
    qk_norm. A bidirectional layer attends with ``full_attention`` and never takes a KV cache
    (the engine refuses such a model: each new token would change every earlier key's context)."""

    def __init__(self, cfg: ModelConfig, layer_id: str) -> None:
        super().__init__()
        self.layer_id = layer_id  # the key a KV cache files this layer under
        self.head_dim = cfg.d_model // cfg.n_head
        n_kv_head = cfg.n_kv_head or cfg.n_head
        d, hd = cfg.d_model, self.head_dim
        self.wq = nn.Linear(d, cfg.n_head * hd, bias=cfg.bias)
        self.wk = nn.Linear(d, n_kv_head * hd, bias=cfg.bias)
        self.wv = nn.Linear(d, n_kv_head * hd, bias=cfg.bias)
        self.wo = nn.Linear(cfg.n_head * hd, d, bias=cfg.bias)
        # qk_norm (OLMo 2, Qwen3): RMSNorm over each head's vector, before RoPE.
        self.q_norm = nn.RMSNorm(hd, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(hd, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.rotate = rotate_qk if cfg.pos == "rope" else keep_qk
        self.causal = cfg.causal  # picks the attention function here and in set_attention/set_kernels
        self.attend = sdpa_attention if cfg.causal else full_attention
        self.attn_dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_layer = cfg.n_layer  # for the init of wo

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        for module in (self.wq, self.wk, self.wv, self.q_norm, self.k_norm):
            init_module(module, std, generator)
        init_module(self.wo, std / math.sqrt(2 * self.n_layer), generator)  # writes to the residual stream

    def forward(self, x: Tensor, rope: Rope | None, cache: KVCache | None = None) -> Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_head, T, hd)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv_head, T, hd)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv_head, T, hd)
        q, k = self.rotate(self.q_norm(q), self.k_norm(k), rope)
        if cache is None:
            y = self.attend(q, k, v, self.attn_dropout if self.training else 0.0)  # (B, n_head, T, hd)
        else:
            y = cache.attend(self.layer_id, q, k, v)  # (B, n_head, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, n_head * hd)
        return self.resid_dropout(self.wo(y))


# ------------------------------------------------------------------ MLP and block


class GeluMLP(nn.Module):
    """GPT-2: w2(gelu(w1 x)), GELU's tanh approximation (``gelu_new`` in GPT-2 and HF), so that
    GPT-2 checkpoints match exactly; ``model.gelu=erf`` the exact GELU of BERT (HF ``gelu``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = mlp_hidden_size(cfg)
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.n_layer = cfg.n_layer  # for the init of w2
        self.approximate = {"tanh": "tanh", "erf": "none"}[cfg.gelu]  # model.gelu=erf: BERT's exact GELU

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        init_module(self.w1, std, generator)
        init_module(self.w2, std / math.sqrt(2 * self.n_layer), generator)  # writes to the residual stream

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.w2(F.gelu(self.w1(x), approximate=self.approximate)))  # (B, T, hidden) in


class ReluSquaredMLP(GeluMLP):
    """w2(relu(w1 x)^2), GPT-2's MLP with the squared ReLU of Primer (So et al. 2021) in place of
    GELU, which the modded-nanogpt speedruns adopted; as cheap as GELU, sparser, and it trains
    faster at small scale."""

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.w2(F.relu(self.w1(x)).square()))  # (B, T, hidden) inside


class SoftCap(nn.Module):
    """cap * tanh(z / cap): logits stay within +-cap but keep their order and, well inside the
    cap, their values (Gemma 2; modded-nanogpt). Keeps early training from overconfident
    logits."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = cap

    def forward(self, z: Tensor) -> Tensor:
        return self.cap * torch.tanh(z / self.cap)


class SwiGLU(nn.Module):
    """Llama (Shazeer 2020, "GLU Variants"): w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = mlp_hidden_size(cfg)
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)  # gate
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)  # up
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)  # down
        self.dropout = nn.Dropout(cfg.dropout)
        self.n_layer = cfg.n_layer  # for the init of w2

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        for module in (self.w1, self.w3):
            init_module(module, std, generator)
        init_module(self.w2, std / math.sqrt(2 * self.n_layer), generator)  # writes to the residual stream

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))  # (B, T, hidden) inside


MIXERS: dict[str, type[nn.Module]] = {"attention": Attention, "mamba": Mamba}  # model.mixer / model.pattern
MLPS: dict[str, type[nn.Module]] = {  # model.mlp
    "swiglu": SwiGLU,
    "relu2": ReluSquaredMLP,
    "gelu": GeluMLP,
    "moe": MoE,  # ember/model/moe.py
}


def layer_mixers(cfg: ModelConfig) -> list[str]:
    """Each layer's mixer: ``model.pattern`` (A attention, M Mamba) repeated to ``n_layer``, or
    ``model.mixer`` everywhere."""
    if not cfg.pattern:
        return [cfg.mixer] * cfg.n_layer
    letters = (cfg.pattern * cfg.n_layer)[: cfg.n_layer]
    return [{"A": "attention", "M": "mamba"}[c] for c in letters]


class Block(nn.Module):
    """Pre-norm block: x + mixer(norm(x)), then x + mlp(norm(x)); the mixer is attention (named
    ``attention``, whatever it is, so that weight names stay put) and ``model.mlp=none`` has no MLP."""

    def __init__(self, cfg: ModelConfig, layer_id: str, mixer: str = "attention") -> None:
        super().__init__()
        self.attention_norm = make_norm(cfg, cfg.d_model)
        self.attention = MIXERS[mixer](cfg, layer_id)
        has_mlp = cfg.mlp != "none"
        self.mlp_norm = make_norm(cfg, cfg.d_model) if has_mlp else None
        self.mlp = MLPS[cfg.mlp](cfg) if has_mlp else None

    def forward(self, x: Tensor, rope: Rope | None, cache: KVCache | None = None) -> Tensor:
        x = x + self.attention(self.attention_norm(x), rope, cache)
        return x if self.mlp is None else x + self.mlp(self.mlp_norm(x))


class PostNormBlock(Block):
    """Post-norm block (the Transformer of Vaswani et al. 2017, BERT): norm(x + mixer(x)), then
    norm(x + mlp(x)); ``model.norm_position=post``. Same weights and names as ``Block``."""

    def forward(self, x: Tensor, rope: Rope | None, cache: KVCache | None = None) -> Tensor:
        x = self.attention_norm(x + self.attention(x, rope, cache))
        return x if self.mlp is None else self.mlp_norm(x + self.mlp(x))


# ------------------------------------------------------------------ the model


class GPT(nn.Module):
    """Token embedding, positions, ``n_layer`` blocks, final norm, output head: next-token logits
    over the vocabulary, or with ``model.head=score`` one scalar per position (a reward model's
    score, ember/train/tasks/rm.py; never tied to the embedding)."""

    stream_shards = 1  # a later pipeline stage under sequence parallel: its input holds T / tp positions

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ConfigError(
                "model.vocab_size is 0 (take it from the tokenizer); the trainer resolves it, "
                "code that builds a GPT directly must set model.vocab_size"
            )
        self.cfg = cfg
        head_dim = cfg.d_model // cfg.n_head
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        positions = {
            "rope": lambda: RotaryPositions(head_dim, cfg.max_seq_len, cfg.rope_theta),
            "learned": lambda: LearnedPositions(cfg.max_seq_len, cfg.d_model),
            "none": lambda: None,
        }
        self.pos: nn.Module | None = positions[cfg.pos]()  # fmt: skip
        self.dropout = nn.Dropout(cfg.dropout)
        post = cfg.norm_position == "post"  # BERT: embeddings normed, each block's sums normed, no final norm
        self.embed_norm = make_norm(cfg, cfg.d_model) if post else nn.Identity()
        # String keys, so that a pipeline stage can delete the layers it does not run.
        mixers = layer_mixers(cfg)
        block = PostNormBlock if post else Block
        self.layers = nn.ModuleDict({str(i): block(cfg, str(i), mixers[i]) for i in range(cfg.n_layer)})
        self.norm = nn.Identity() if post else make_norm(cfg, cfg.d_model)
        self.transform = MLMTransform(cfg) if cfg.head == "mlm" else nn.Identity()  # BERT's, before output
        vocab = cfg.vocab_size if cfg.head != "score" else 1
        self.output = nn.Linear(cfg.d_model, vocab, bias=cfg.head == "mlm")
        self.softcap = SoftCap(cfg.logit_softcap) if cfg.logit_softcap else nn.Identity()
        self.tie_weights()

    def forward(
        self,
        idx: Tensor,
        cache: KVCache | None = None,
        keep: Tensor | tuple[Tensor, Tensor] | None = None,
        hidden: bool = False,
    ) -> Tensor:
        """idx (B, T) token ids -> logits (B, T, vocab_size) in fp32. With a ``cache``, idx
        continues the sequences it holds, at the positions it gives (a cache is sized to at
        most max_seq_len tokens by whoever builds it: the engine checks prompts). ``keep``, a
        (B, T) bool mask, or a pair of (N,) row and position indices (no host sync: a CUDA graph
        replays it): only those positions' logits, (N, vocab_size) (module docstring).
        ``hidden``: the final norm's output instead of logits, for a loss that fuses the head."""
        T = idx.size(1) if self.tok_embeddings is not None else idx.size(1) * self.stream_shards
        if T > self.cfg.max_seq_len and cache is None:  # a cache gives positions: a packed row may be longer
            raise ConfigError(
                f"a sequence of {T} tokens is longer than model.max_seq_len={self.cfg.max_seq_len}; "
                "shorten the input or use a model with a larger max_seq_len"
            )
        positions = torch.arange(T, device=idx.device) if cache is None else cache.extend(T)  # (T,) or (B, T)
        # a later pipeline stage (ember.parallel.pipeline) has no embedding: idx is the residual
        # stream (B, T, C) the stage before sent; it has positions only as RoPE tables, if any
        x = idx if self.tok_embeddings is None else self.tok_embeddings(idx)
        x, rope = self.pos(x, positions) if self.pos is not None else (x, None)  # (B, T, C)
        x = self.dropout(self.embed_norm(x)) if self.tok_embeddings is not None else x
        eager = cache is not None and getattr(self, "compiled_blocks", False)  # see apply_compile
        with torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext():
            for layer in self.layers.values():
                x = layer(x, rope, cache)
        if self.output is None:  # an earlier pipeline stage: the stream goes on to the next
            return x
        if keep is not None:
            x = x[keep]  # (N, C)
        x = self.transform(self.norm(x))
        if hidden:  # the head is the caller's: a fused linear + loss (train.kernels=triton)
            return x  # (B, T, C) or (N, C)
        return self.softcap(self.output(x).float())  # (B, T, vocab_size) or (N, vocab_size)

    # -- building ---------------------------------------------------------

    @classmethod
    def build(cls, cfg: ModelConfig, device: str | torch.device = "cpu", seed: int | None = None) -> GPT:
        """Construct on the meta device, allocate on ``device``, initialise."""
        with torch.device("meta"):
            model = cls(cfg)
        model.to_empty(device=device)
        model.init_weights(seed)
        return model

    def tie_weights(self) -> None:
        # not a reward model's score head, not a quantized head
        lm_head = self.cfg.head != "score" and isinstance(self.output, nn.Linear)
        if self.cfg.tie_embeddings and lm_head:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device: str | torch.device | None, recurse: bool = True) -> GPT:
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()  # to_empty made a separate tensor for each module that shared one
        return self

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the non-persistent buffers (RoPE tables)."""
        for module in self.modules():
            if isinstance(module, RotaryPositions):
                module.init_buffers()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every child in order at ``init_std`` (see ``init_module``), the tied head
        as the embedding. ``seed`` draws from a private generator; None uses the global RNG."""
        device = self.tok_embeddings.weight.device
        generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
        for module in self.children():
            if module is not self.output or getattr(module, "weight", None) is not self.tok_embeddings.weight:
                init_module(module, self.cfg.init_std, generator)
            elif module.bias is not None:  # model.head=mlm: the tied decoder's own bias
                nn.init.zeros_(module.bias)

    def set_attention(self, kind: str) -> GPT:
        """Use ``"sdpa"`` (default) or ``"reference"`` attention in every layer."""
        if kind not in ATTENTION:
            raise ConfigError(f"unknown attention {kind!r}; choose one of {', '.join(ATTENTION)}")
        for module in self.modules():
            if isinstance(module, Attention):
                module.attend = (ATTENTION if module.causal else FULL_ATTENTION)[kind]
        return self

    def set_kernels(self, kind: str) -> GPT:
        """``"triton"``: ember.kernels' norms, RoPE and attention in every layer, the same
        parameters (``train.kernels``; the fused loss is the task's). ``"torch"``: PyTorch's."""
        if kind not in KERNELS:
            raise ConfigError(f"unknown kernels {kind!r}; choose one of {', '.join(KERNELS)}")
        triton = kind == "triton"
        if triton:
            from ember.kernels import attention, norm, rope
        for module in self.modules():
            if isinstance(module, nn.RMSNorm):
                module.__class__ = norm.RMSNorm if triton else nn.RMSNorm
            elif isinstance(module, nn.LayerNorm):
                module.__class__ = norm.LayerNorm if triton else nn.LayerNorm
            elif isinstance(module, Attention):
                flash = functools.partial(kernel_attention, attention.flash_attention) if triton else None
                module.attend = (flash or sdpa_attention) if module.causal else full_attention
                if module.rotate is not keep_qk:
                    module.rotate = functools.partial(kernel_rotate, rope.rope_qk) if triton else rotate_qk
        return self

    # -- accounting -------------------------------------------------------

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count, a tied weight once. ``non_embedding`` leaves out the lookup
        tables (token and learned position embeddings) but keeps the output head, which
        is a matmul; a tied embedding therefore stays counted, as the head."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once
        if non_embedding:
            tables = [m.weight for m in self.modules() if isinstance(m, nn.Embedding)]
            n -= sum(t.numel() for t in tables if t is not getattr(self.output, "weight", None))
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at context ``seq_len``."""
        # PaLM (Chowdhery et al. 2022) appendix B: 6N + 12·L·H·Q·T, N the non-embedding
        # parameters (matmuls with weights), 12LHQT the attention scores and weighted sums; a
        # Mamba layer's scan instead costs 3x (forward + backward) its forward (ember/model/mamba.py).
        # An MoE token meets only its top_k experts: N counts the active parameters.
        n_head, head_dim = self.cfg.n_head, self.cfg.d_model // self.cfg.n_head
        kinds = [type(layer.attention) for layer in self.layers.values()]
        n_attn, n_mamba = len(kinds) - kinds.count(Mamba), kinds.count(Mamba)
        mixing = 12 * n_attn * n_head * head_dim * seq_len + 3 * n_mamba * scan_flops(self.cfg)
        active = self.num_params(non_embedding=True) - sum(
            m.idle_params() for m in self.modules() if isinstance(m, MoE)
        )
        return 6 * active + mixing


def layer_of(name: str) -> str:
    """The group a parameter is reported under: ``layers.N``, or its top module."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
