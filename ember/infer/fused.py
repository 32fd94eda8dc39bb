"""A batch-1 decode step in ember's own kernels: five launches a block.

    engine = Engine(model, tokenizer, graphs=True, kernels="triton")    # this step, from a CUDA graph
    logits = FusedDecode(model)(idx, cache)      # idx (B, 1), cache a filled StaticKVCache -> (B, 1, V)
    logits = FusedDecode(model, persistent=True)(idx, cache)        # the same in one launch, B <= 16

PyTorch's kernels run a block's decode step as a dozen or more launches (norms, three products
for q, k, v, RoPE, the cache writes, the mask, attention, the output product, the residual
adds, the MLP's products and activation), and at batch 1 each costs its latency, not its bytes
(benchmarks/RESULTS.md, "Decode's floor"). ``FusedDecode`` runs a block as five
(ember/kernels/decode.py): [norm + q|k|v], [RoPE + attention, writing k and v into the cache],
[output product + residual], [norm + up + GELU, or norm + gate|up + SwiGLU], [down + residual];
with the embedding and the final norm + head, gpt2-small's step is 62 launches, then the
position's increment. With ``pdl`` (the default) each kernel reads its weights (or its cached
keys) before it waits for the one before, and on Hopper overlaps it (ember/kernels/decode.py).
With ``persistent`` the whole step is one launch instead: the same tiles as tasks that one
program an SM walks in order, each waiting for the stage before on a counter
(ember/kernels/persistent.py; it reads the weights and the cache's buffers by address).

It covers the GPT-2 and Llama layouts: LayerNorm or RMSNorm before each sublayer, learned, rotary
or no positions, the GELU (tanh) or SwiGLU MLP, biases or not, grouped-query attention; anything
else (qk-norm, soft-capping, ReLU², MoE, Mamba, LoRA or quantized linears) is refused by name.
q|k|v (and SwiGLU's gate|up) become one product over a weight concatenated here, so a step reads
the weights of its construction for them (as ``TUNED``'s frozen weights): for a benchmark or a
server, not a training-time rollout. tests/test_fused_decode.py holds it to the model's own step
(logits and cache, and the greedy tokens of ``generate``), under Triton's interpreter on a CPU.
It lives in infer/ beside engine.py, which DESIGN.md's list of infer/'s files predates: it is the
engine's decode step, reading a built model and the kernels of the floors below.
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ember.errors import EmberError
from ember.kernels.decode import ACTS, NORMS, decode_attention, decode_embed, decode_linear
from ember.model.gpt import LearnedPositions, RotaryPositions, layer_mixers


def _norm(module: nn.Module) -> tuple[Tensor, Tensor | None, float, int]:
    """(weight, bias, eps, kind) of a LayerNorm or RMSNorm, as decode_linear takes them."""
    if isinstance(module, nn.LayerNorm):
        return module.weight, module.bias, module.eps, NORMS["layer"]
    eps = module.eps if module.eps is not None else torch.finfo(module.weight.dtype).eps  # nn.RMSNorm's
    return module.weight, None, eps, NORMS["rms"]


def unsupported(model: nn.Module) -> list[str]:
    """What in ``model`` the fused step does not cover (empty: it covers it)."""
    cfg, why = model.cfg, []
    if cfg.mlp not in ("gelu", "swiglu") or cfg.mlp == "gelu" and cfg.gelu != "tanh":
        why.append(f"model.mlp={cfg.mlp}" if cfg.mlp != "gelu" else "model.gelu=erf")
    if cfg.qk_norm:
        why.append("model.qk_norm")
    if cfg.logit_softcap:
        why.append("model.logit_softcap")
    if cfg.norm_position != "pre" or cfg.head != "lm" or not cfg.causal:
        why.append("a post-norm, scoring or bidirectional model")
    if set(layer_mixers(cfg)) != {"attention"}:
        why.append("Mamba layers")
    head_dim = cfg.d_model // cfg.n_head
    if head_dim < 2 or head_dim & (head_dim - 1):  # the attention kernel's tiles: a power of two
        why.append(f"a head dimension of {head_dim}, not a power of two")
    for name, module in model.named_modules():
        if name.endswith(("wq", "wk", "wv", "wo", "w1", "w2", "w3")) or name == "output":
            if type(module) is not nn.Linear:
                why.append(f"{name} is a {type(module).__name__}, not a plain nn.Linear (LoRA, quantized)")
                break
    return why


def _joined(*linears: nn.Linear) -> tuple[Tensor, Tensor | None]:
    """The linears' weights stacked by rows into one product's (a copy), and their biases."""
    weight = torch.cat([m.weight for m in linears])
    return weight, torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None


class _Block(NamedTuple):
    """One block as the fused step reads it: its norms as ``_norm`` gives them, the joined
    q|k|v weight and bias, the output linear, the up (or gate|up) weight and bias, the down
    linear."""

    name: str
    norm1: tuple
    qkv: Tensor
    qkv_bias: Tensor | None
    wo: nn.Linear
    norm2: tuple
    up: Tensor
    up_bias: Tensor | None
    w2: nn.Linear


# The persistent step's tasks: BLOCK_N outputs by BLOCK_K inputs a product tile (one row on the CUDA
# cores: 128 registers for sm_90 at 8 warps; several rows: tl.dot, at most 256 inputs a step);
# programs 0: one an SM (fewer may be asked for, never more)
PERSISTENT = {"block_n": 16, "block_k": 1024, "programs": 0}


class FusedDecode:
    """``step(idx, cache)`` as ``model(idx, cache=cache)`` computes it for one new token a row on
    a ``StaticKVCache`` the prefill filled: logits (B, 1, V) in fp32, k and v written at the
    cache's position, the position advanced (module docstring)."""

    def __init__(self, model: nn.Module, pdl: bool = True, persistent: bool = False):
        if why := unsupported(model):
            raise EmberError(
                f"the fused decode step (kernels=triton) covers GPT-2 and Llama blocks; this model has "
                f"{', '.join(why)}: decode it with kernels=torch"
            )
        cfg = model.cfg
        self.heads = cfg.n_head, cfg.n_kv_head or cfg.n_head
        self.wte = model.tok_embeddings.weight
        self.wpe = model.pos.wpe.weight if isinstance(model.pos, LearnedPositions) else None
        self.rope = (model.pos.cos, model.pos.sin) if isinstance(model.pos, RotaryPositions) else (None, None)
        self.act = ACTS["swiglu"] if cfg.mlp == "swiglu" else ACTS["gelu"]
        self.blocks: list[_Block] = []
        with torch.no_grad():
            for name, block in model.layers.items():
                a, mlp = block.attention, block.mlp
                qkv = _joined(a.wq, a.wk, a.wv)  # one product: the same input
                swiglu = self.act == ACTS["swiglu"]  # its gate and up: one product too
                up = _joined(mlp.w1, mlp.w3) if swiglu else (mlp.w1.weight, mlp.w1.bias)
                norms = _norm(block.attention_norm), _norm(block.mlp_norm)
                self.blocks.append(_Block(name, norms[0], *qkv, a.wo, norms[1], *up, mlp.w2))
        self.final = _norm(model.norm)
        self.head = model.output
        self.pdl = pdl  # each product's weights read ahead; on Hopper, launched as dependents (docstring)
        self.persistent = persistent  # the whole step in one launch (ember.kernels.persistent)
        # its pointer table for each live cache, with the addresses it holds (a CUDA graph's static
        # cache keeps its own for the graph's life; an eager stream's goes with its cache)
        self.tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.tile: tuple[int, int] | None = None  # its (BLOCK_N, BLOCK_K) for one row; None: PERSISTENT's

    @functools.cached_property
    def _norm_kinds(self) -> set[tuple[float, int]]:
        """(eps, kind) of every norm: the persistent step takes one."""
        return {(n[2], n[3]) for b in self.blocks for n in (b.norm1, b.norm2)} | {self.final[2:]}

    def _table(self, cache) -> Tensor:
        """The (L, 14) int64 table of each block's weights' and caches' addresses (a row of
        ``ember.kernels.persistent.COLUMNS`` a block), made again only when its addresses change
        (read each call: a model moved or cast since, or a cache's rows selected, has new ones);
        refused where the step's one norm and eps do not fit."""
        if len(kinds := self._norm_kinds) > 1:
            raise EmberError(
                f"the persistent step takes one kind of norm and one eps; this model has {sorted(kinds)}"
            )
        rows = []
        for b in self.blocks:
            (g1, b1, *_), (g2, b2, *_) = b.norm1, b.norm2
            row = (b.qkv, b.qkv_bias, b.wo.weight, b.wo.bias, b.up, b.up_bias, b.w2.weight, b.w2.bias,
                   g1, b1, g2, b2)  # fmt: skip
            if any(t is not None and not t.is_contiguous() for t in row):
                raise EmberError(f"the persistent step reads weights by pointer: {b.name}'s are strided")
            row += (cache.k[b.name], cache.v[b.name])
            rows.append(tuple(0 if t is None else t.data_ptr() for t in row))
            if any(p % 16 for p in rows[-1]):  # the kernel's loads take each address as 16-byte aligned
                raise EmberError(f"the persistent step reads weights by pointer: one of {b.name}'s is not "
                                 "16-byte aligned (a view into a larger tensor?); .clone() it")  # fmt: skip
        held = self.tables.get(cache)
        if held is None or held[0] != rows:
            held = self.tables[cache] = rows, torch.tensor(rows, dtype=torch.int64, device=self.wte.device)
        return held[1]

    def _step(self, idx: Tensor, cache) -> Tensor:
        """The whole step in one launch (ember.kernels.persistent)."""
        from ember.kernels.persistent import decode_step

        B, (V, C) = idx.size(0), self.head.weight.shape
        if B > 16:
            raise EmberError(f"the persistent step takes at most 16 rows a step (tl.dot's tile), not {B}")
        dot = B > 1  # one row on the CUDA cores; more on tl.dot, whose 16-row tiles spill past 256 inputs
        block_n, block_k = self.tile or (PERSISTENT["block_n"], PERSISTENT["block_k"])
        block_n, block_k = (max(16, block_n), min(256, block_k)) if dot else (block_n, block_k)
        k0 = cache.k[self.blocks[0].name]
        b0 = self.blocks[0]
        new = lambda n, dtype=self.wte.dtype: torch.empty(B, n, dtype=dtype, device=self.wte.device)  # noqa: E731
        F = b0.up.size(0) // (2 if self.act == ACTS["swiglu"] else 1)
        logits = new(V, torch.float32)
        (_, beta, eps, norm), (gf, bf, eps_f, _) = b0.norm1, self.final
        decode_step(idx.reshape(-1).contiguous(), self.wte, self.wpe, cache.pos, cache.pad, *self.rope,
                    self._table(cache), gf, bf, self.head.weight, self.head.bias, new(C), new(b0.qkv.size(0)),
                    new(self.heads[0] * k0.size(3)), new(F), logits,
                    torch.empty(2 + 5 * len(self.blocks), dtype=torch.int32, device=self.wte.device), k0, eps,
                    eps_f, *self.heads, norm, self.act, b0.qkv_bias is not None, beta is not None, dot,
                    block_n, block_k, PERSISTENT["programs"])  # fmt: skip
        return logits[:, None]

    @torch.no_grad()
    def __call__(self, idx: Tensor, cache) -> Tensor:
        if self.persistent:
            return self._step(idx, cache)
        pos, pad = cache.pos, cache.pad
        x = decode_embed(idx.reshape(-1), self.wte, self.wpe, pos, pad)  # (B, C)
        none, pdl = NORMS["none"], self.pdl
        for blk in self.blocks:
            (g1, b1, eps1, n1), (g2, b2, eps2, n2) = blk.norm1, blk.norm2
            qkv = decode_linear(x, blk.qkv, blk.qkv_bias, g1, b1, None, eps1, n1, 0, None, pdl)
            kv = cache.k[blk.name], cache.v[blk.name]
            o = decode_attention(qkv, *kv, pos, pad, *self.rope, *self.heads, pdl)
            x = decode_linear(o, blk.wo.weight, blk.wo.bias, None, None, x, 0.0, none, 0, None, pdl)
            h = decode_linear(x, blk.up, blk.up_bias, g2, b2, None, eps2, n2, self.act, None, pdl)
            x = decode_linear(h, blk.w2.weight, blk.w2.bias, None, None, x, 0.0, none, 0, None, pdl)
        g, b, eps, n = self.final
        logits = decode_linear(x, self.head.weight, self.head.bias, g, b, None, eps, n, 0, torch.float32, pdl)
        pos += 1
        return logits[:, None]  # (B, 1, V)
