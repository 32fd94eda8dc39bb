"""The kernels of a fused decode step: a GPT-2 or Llama block at batch 1 in five launches.

    x = decode_embed(idx, wte, wpe, pos, pad)                        # (B, C): token + position rows
    y = decode_linear(x, w, b, g, beta, r, eps, norm, act, out_dtype, pdl)  # y = act(norm(x) @ wᵀ + b) + r
    o = decode_attention(qkv, k_cache, v_cache, pos, pad, cos, sin, n_head, n_kv_head, pdl)  # k, v at pos

A batch-1 decode step of gpt2-small is ~73 matrix-vector products of 1-5 MB each, and each
costs its kernel's latency (3.5-6.3 µs on an H200 from a CUDA graph), not its bytes (0.3-1.3 µs):
benchmarks/RESULTS.md, "Decode's floor". Per op, with PyTorch's kernels, a block is about a dozen
launches; these five make one (``ember.infer.fused``):

- ``decode_linear`` with a norm before the product: LayerNorm/RMSNorm of x (statistics over the
  whole row, recomputed by every program in two passes over the 1.5 KB row, from cache) fused
  into the GEMV's loads, then bias, GELU (tanh) or SwiGLU (the gate's and the up's rows of one
  weight, in one program) and the residual add after it. A block is [norm + q|k|v],
  [attention], [o + residual], [norm + up + activation], [down + residual].
- ``decode_attention``: one program per (row, head). It turns q and the new key by RoPE when
  given the tables (rotate-half, each head as its two halves), attends the new key (from the
  q|k|v product, in registers) and every held slot of the static cache (``StaticKVCache``:
  slots below ``pos`` and not among the row's left pads, looping over those tiles alone, not the
  cache's whole width) with an online softmax; the first head of each key/value group writes the
  new key and value into slot ``pos``.

With ``pdl`` (``FusedDecode``'s default), each kernel reads what no kernel of the step writes
first: the products their first tile of weights (the step taken out of the loop, so no tile is
held across it), the attention the position, pads, RoPE tables and its first tile of held slots
(then each later tile one step ahead). On Hopper it is then launched as a programmatic
dependent (``launch_pdl``): it may start while the kernel before still runs, and waits for it
(``gdc_wait``) only before reading that kernel's outputs or storing anything, then lets the next
one start (``gdc_launch_dependents``). A launch then overlaps the one before instead of
following it. The interpreter runs the reading-ahead road without the wait; the tests hold it to
the plain one.

The products use ``tl.dot`` on 16-row tiles (tensor cores even for one row, as ``int8.py``), or
one row a program on the CUDA cores, whichever the tuner times faster for the shape; fp32
accumulation, the weight's dtype in. Inference only: no autograd formulas; ``kernel_op``
registers each with its fake, and the cache writes as the attention op's mutations.
References: ``*_ref`` below; tests/test_fused_decode.py holds the whole step to the model's.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ember.kernels import INTERPRET, kernel_op, pow2

NORMS = {"none": 0, "layer": 1, "rms": 2}
ACTS = {"none": 0, "gelu": 1, "swiglu": 2}  # swiglu: w holds the gate's rows, then the up's

# (BLOCK_N, BLOCK_K, warps) on tensor cores, rows padded to 16 (DOT): int8.py's, less the two that
# spill registers with a norm (ptxas, sm_90), and (16, 1024, 8): a 768-wide row in one step of the
# loop, so all of a program's weight loads are in flight at once (an H200 spent 5.5 µs a product
# at 3-12 steps of 256; with PDL's prefetch it spills, as every tl.dot tile with SwiGLU's two
# products does, under Triton 3.6 and 3.9 alike: the tuner times them as it times every config).
# The same with one row a program on the CUDA cores (FMA): no
# padded rows, so for sm_90 (ptxas) GPT-2's products take 56-182 registers where tl.dot's take
# 186-255, and SwiGLU's no longer spill: more programs an SM, and room beside a running kernel
# for the next one's programs (PDL); and 4 or 8 outputs a program, so that a 768-wide output
# (the attention's and the MLP's down product) is 96-192 programs for 132 SMs, not 48 (4 x 1024:
# 56-80 registers); and 2,048 or 4,096 inputs a step, so that the down product's 3,072-wide row
# (gpt2-small) is one or two steps, the first read before the wait (48-80 registers without
# SwiGLU, 128-206 with it; no spills). The tuner picks by timing, per shape, among those whose
# step is no wider than the row (rounded up to a power of two).
_DOT = [(16, 256, 4), (16, 512, 4), (32, 256, 4), (64, 256, 8), (16, 1024, 8)]
_FMA = [(16, 256, 4), (16, 512, 4), (16, 1024, 8), (4, 1024, 4), (8, 1024, 4), (8, 2048, 8), (4, 4096, 8)]
CONFIGS = [
    triton.Config({"BLOCK_M": rows, "DOT": rows > 1, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
    for rows, shapes in ((16, _DOT), (1, _FMA))
    for n, k, w in shapes
]


def _tuned_only_in_low_precision(configs, named_args, **_):
    """fp32 weights get the first config alone: on a GPU they are decode.py's parity check,
    not a speed, and tuning would compile every config for every shape and road before the
    timed rows begin. Otherwise every config whose step of inputs is no wider than the row."""
    if named_args["W"].dtype == torch.float32:
        return configs[:1]
    return [c for c in configs if c.kwargs["BLOCK_K"] <= pow2(named_args["K"])] or configs[:1]


if INTERPRET:  # one small config: the interpreter's programs run one after another
    CONFIGS = [triton.Config({"BLOCK_M": 16, "DOT": True, "BLOCK_N": 16, "BLOCK_K": 32})]


@triton.jit
def _embed_kernel(IDX, WTE, WPE, POS, PAD, X, C, spad, HAS_WPE: tl.constexpr, BLOCK: tl.constexpr):
    embed_row(IDX, WTE, WPE, POS, PAD, X, C, spad, tl.program_id(0), HAS_WPE, BLOCK)


@triton.jit
def embed_row(IDX, WTE, WPE, POS, PAD, X, C, spad, b, HAS_WPE: tl.constexpr, BLOCK: tl.constexpr):
    """Row b's token embedding, plus its learned position's (HAS_WPE), into X[b]."""
    cols = tl.arange(0, BLOCK)
    token = tl.load(IDX + b).to(tl.int64)
    x = tl.load(WTE + token * C + cols, mask=cols < C, other=0.0).to(tl.float32)
    if HAS_WPE:  # the position of slot pos in a row with pad left pads (StaticKVCache.extend)
        p = tl.maximum(tl.load(POS) - tl.load(PAD + b * spad), 0).to(tl.int64)
        x += tl.load(WPE + p * C + cols, mask=cols < C, other=0.0).to(tl.float32)
    tl.store(X + b * C + cols, x.to(X.dtype.element_ty), mask=cols < C)


@triton.jit
def _input_tile(X, G, BETA, rm, in_m, kk, in_k, K, mean, rstd, NORM: tl.constexpr, HAS_BETA: tl.constexpr):
    """The rows' inputs kk, normalized (NORM) and rounded to X's dtype as the model's norm returns them."""
    x = tl.load(X + rm[:, None] * K + kk[None, :], mask=in_m & in_k[None, :], other=0.0)
    return _normed(x, G, BETA, in_m, kk, in_k, mean, rstd, NORM, HAS_BETA)


@triton.jit
def _normed(x, G, BETA, in_m, kk, in_k, mean, rstd, NORM: tl.constexpr, HAS_BETA: tl.constexpr):
    """``_input_tile`` of inputs already loaded."""
    if NORM != 0:
        xn = (x.to(tl.float32) - mean[:, None]) * rstd[:, None]
        xn = xn * tl.load(G + kk, mask=in_k, other=0.0).to(tl.float32)[None, :]
        if HAS_BETA:
            xn += tl.load(BETA + kk, mask=in_k, other=0.0).to(tl.float32)[None, :]
        x = tl.where(in_m & in_k[None, :], xn, 0.0).to(x.dtype)
    return x


@triton.jit
def _weight_tiles(W, rn, in_n, kk, in_k, N, K, ACT: tl.constexpr):
    """Rows ``rn`` of W, inputs ``kk``: a (BLOCK_N, BLOCK_K) tile, zeros outside, and for SwiGLU
    (W (2N, K)) the up's rows ``rn + N`` too (else the same tile again)."""
    w = tl.load(W + rn[:, None] * K + kk[None, :], mask=in_n & in_k[None, :], other=0.0)
    u = w
    if ACT == 2:
        u = tl.load(W + (rn + N)[:, None] * K + kk[None, :], mask=in_n & in_k[None, :], other=0.0)
    return w, u


@triton.jit
def _slot_tile(KC, VC, base, s, held, sks, d, e, HALF: tl.constexpr):
    """Cached slots ``s`` of one key/value head: the keys' two halves and the values, zeros
    where not ``held``."""
    at = base + s[:, None] * sks
    c1 = tl.load(KC + at + d[None, :], mask=held[:, None], other=0.0)
    c2 = tl.load(KC + at + HALF + d[None, :], mask=held[:, None], other=0.0)
    return c1, c2, tl.load(VC + at + e[None, :], mask=held[:, None], other=0.0)


@triton.jit
def _products(acc, up, x, w, u, FP32_DOT: tl.constexpr, ACT: tl.constexpr, DOT: tl.constexpr):
    """acc += x @ wᵀ, and SwiGLU's up += x @ uᵀ, accumulated in fp32 (DOT: by tl.dot; else one
    row, x (1, K), by products and a sum on the CUDA cores)."""
    if not DOT:
        acc += tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=1)[None, :]
        if ACT == 2:
            up += tl.sum(x.to(tl.float32) * u.to(tl.float32), axis=1)[None, :]
    elif FP32_DOT:  # fp32 weights, and the interpreter (whose bf16 tl.dot is not exact)
        acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        if ACT == 2:
            up += tl.dot(x.to(tl.float32), tl.trans(u.to(tl.float32)), input_precision="ieee")
    else:
        acc += tl.dot(x.to(w.dtype), tl.trans(w))
        if ACT == 2:
            up += tl.dot(x.to(u.dtype), tl.trans(u))
    return acc, up


@triton.jit
def _wait(WAIT: tl.constexpr, SYNC, stage, need):
    """Wait for what this program reads from others. WAIT 1: the kernel before (PDL: then the next
    one may start); 2: a persistent step's stage ``stage`` - 1 (``ember.kernels.persistent``), its
    count at SYNC + stage - 1 reaching ``need`` (0: known done); 0: nothing."""
    if WAIT == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT == 2:
        if need > 0:
            while tl.atomic_add(SYNC + stage - 1, 0, sem="acquire") < need:
                pass


@triton.jit
def linear_tile(X, W, BIAS, G, BETA, R, Y, M, N, K, eps, pid_n, pid_m, SYNC, stage, need,
                NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_BETA: tl.constexpr, ACT: tl.constexpr,
                HAS_RES: tl.constexpr, FP32_DOT: tl.constexpr, PREFETCH: tl.constexpr, WAIT: tl.constexpr,
                BLOCK_M: tl.constexpr, DOT: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):  # fmt: skip
    """Y[:, n] = act(norm(X) @ W[n]ᵀ + BIAS[n]) + R[:, n] for the BLOCK_N outputs of tile pid_n
    and the BLOCK_M rows of tile pid_m (SwiGLU: silu(norm(X) @ W[n]ᵀ + BIAS[n]) · (norm(X) @
    W[N + n]ᵀ + BIAS[N + n])). PREFETCH: the first tile of weights is read before anything else;
    only then does the program wait (``_wait``). The rows' first BLOCK_K inputs are read once, for
    the statistics' first step and the product's: at K <= BLOCK_K (a 768-wide row in tiles of
    1,024) a LayerNorm product reads its input once after the wait, not three times in turn."""
    tl.static_assert(DOT or BLOCK_M == 1, "the CUDA cores' products take one row a program")
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_m = rm[:, None] < M
    in_n = rn[:, None] < N
    rk = tl.arange(0, BLOCK_K)
    if PREFETCH:  # the weights are no kernel's output: their first tile need not wait for one
        w1, u1 = _weight_tiles(W, rn, in_n, rk, rk < K, N, K, ACT)
    _wait(WAIT, SYNC, stage, need)  # X and R are outputs before this one, and Y may be a buffer one reads
    x1 = tl.load(X + rm[:, None] * K + rk[None, :], mask=in_m & (rk[None, :] < K), other=0.0)  # 1st inputs
    mean = tl.zeros((BLOCK_M,), tl.float32)
    rstd = mean
    if NORM != 0:  # the rows' statistics first, two passes over the (short, cache-hot) rows
        if NORM == 1:
            mean += tl.sum(x1.to(tl.float32), axis=1)
            for k0 in range(BLOCK_K, K, BLOCK_K):
                at = k0 + rk[None, :]
                x = tl.load(X + rm[:, None] * K + at, mask=in_m & (at < K), other=0.0)
                mean += tl.sum(x.to(tl.float32), axis=1)
            mean = mean / K
        x = tl.where(rk[None, :] < K, x1.to(tl.float32) - mean[:, None], 0.0)
        var = tl.sum(x * x, axis=1)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            at = k0 + rk[None, :]
            x = tl.load(X + rm[:, None] * K + at, mask=in_m & (at < K), other=0.0).to(tl.float32)
            x = tl.where(at < K, x - mean[:, None], 0.0)
            var += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(var / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # SwiGLU's second product: W's rows N..2N
    if not PREFETCH:  # (loaded here, not held through the statistics)
        w1, u1 = _weight_tiles(W, rn, in_n, rk, rk < K, N, K, ACT)
    x = _normed(x1, G, BETA, in_m, rk, rk < K, mean, rstd, NORM, HAS_BETA)  # the first step, out of the loop
    acc, up = _products(acc, up, x, w1, u1, FP32_DOT, ACT, DOT)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + rk
        in_k = kk < K
        x = _input_tile(X, G, BETA, rm, in_m, kk, in_k, K, mean, rstd, NORM, HAS_BETA)
        w, u = _weight_tiles(W, rn, in_n, kk, in_k, N, K, ACT)
        acc, up = _products(acc, up, x, w, u, FP32_DOT, ACT, DOT)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if ACT == 2:
            up += tl.load(BIAS + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if ACT != 0:  # the products rounded as the model's linears return them, then the activation
        acc = acc.to(Y.dtype.element_ty).to(tl.float32)
    if ACT == 1:  # GELU, tanh form: 0.5·a·(1 + tanh(z)) = a·sigmoid(2z), z = √(2/π)·(a + 0.044715·a³)
        z = 1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)
        acc = acc * tl.sigmoid(tl.minimum(tl.maximum(z, -40.0), 40.0))  # (saturated there: no exp overflow)
    if ACT == 2:  # SwiGLU: silu(gate) · up, each rounded as the model's ops round them
        gate = (acc * tl.sigmoid(tl.maximum(acc, -80.0))).to(Y.dtype.element_ty).to(tl.float32)
        acc = gate * up.to(Y.dtype.element_ty).to(tl.float32)
    out = in_m & (rn[None, :] < N)
    if HAS_RES:  # the block's own output rounded first, then added, as the model's x + f(x)
        acc = acc.to(Y.dtype.element_ty).to(tl.float32)
        acc += tl.load(R + rm[:, None] * N + rn[None, :], mask=out, other=0.0).to(tl.float32)
    tl.store(Y + rm[:, None] * N + rn[None, :], acc.to(Y.dtype.element_ty), mask=out)


# the key: the shape and what the product fuses (a SwiGLU product of the same shape needs other registers)
@triton.autotune(CONFIGS, key=["M", "N", "K", "PREFETCH", "NORM", "ACT", "HAS_RES"],
                 prune_configs_by={"early_config_prune": _tuned_only_in_low_precision})
@triton.jit
def _linear_kernel(X, W, BIAS, G, BETA, R, Y, M, N, K, eps,
                   NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_BETA: tl.constexpr, ACT: tl.constexpr,
                   HAS_RES: tl.constexpr, FP32_DOT: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
                   BLOCK_M: tl.constexpr, DOT: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):  # fmt: skip
    """``linear_tile`` for tile (program_id(0), program_id(1)); PDL: it waits for the kernel
    before (module docstring)."""
    linear_tile(X, W, BIAS, G, BETA, R, Y, M, N, K, eps, tl.program_id(0), tl.program_id(1), None, 0, 0,
                 NORM, HAS_BIAS, HAS_BETA, ACT, HAS_RES, FP32_DOT, PREFETCH, 1 if PDL else 0, BLOCK_M, DOT,
                 BLOCK_N, BLOCK_K)


@triton.jit
def attend_head(QKV, KC, VC, POS, PAD, COS, SIN, O, spad, skb, skh, sks, scale, b, h, SYNC, stage, need,
            H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, ROPE: tl.constexpr,
            PREFETCH: tl.constexpr, WAIT: tl.constexpr, BLOCK_S: tl.constexpr):
    """Row b, head h: softmax over the new key and the row's held slots, in fp32. Each head
    vector is handled as its two halves, which RoPE (rotate-half) turns as pairs. What no kernel
    of this step writes (the position, the pads, the tables and the held slots, written by
    earlier steps) is read first; PREFETCH reads each tile of held slots one step ahead, the
    first before q; only then does the program wait (``_wait``) for q|k|v's product."""
    g = h // (H // HKV)  # its key/value head
    HALF: tl.constexpr = HD // 2
    d, e = tl.arange(0, HALF), tl.arange(0, HD)
    pos, pad = tl.load(POS), tl.load(PAD + b * spad)
    if ROPE:  # the new token's position, as StaticKVCache.extend gives it: its slot less the row's pads
        t = tl.maximum(pos - pad, 0)
        cos, sin = tl.load(COS + t * HALF + d).to(tl.float32), tl.load(SIN + t * HALF + d).to(tl.float32)
    base = b * skb + g * skh
    first = pad // BLOCK_S * BLOCK_S  # the held slots' tiles, not the cache's S
    if PREFETCH:
        s1 = first + tl.arange(0, BLOCK_S)
        c1_next, c2_next, v_next = _slot_tile(KC, VC, base, s1, (s1 < pos) & (s1 >= pad), sks, d, e, HALF)
    _wait(WAIT, SYNC, stage, need)
    width = (H + 2 * HKV) * HD
    q = QKV + b * width + h * HD
    k = QKV + b * width + (H + g) * HD
    q1, q2 = tl.load(q + d).to(tl.float32), tl.load(q + HALF + d).to(tl.float32)
    k1, k2 = tl.load(k + d).to(tl.float32), tl.load(k + HALF + d).to(tl.float32)
    v_new = tl.load(QKV + b * width + (H + HKV + g) * HD + e)
    if ROPE:
        q1, q2 = q1 * cos - q2 * sin, q2 * cos + q1 * sin
        k1, k2 = k1 * cos - k2 * sin, k2 * cos + k1 * sin
    if h % (H // HKV) == 0:  # one writer per key/value head; the readers use k1, k2, v_new instead
        tl.store(KC + base + pos * sks + d, k1.to(KC.dtype.element_ty))
        tl.store(KC + base + pos * sks + HALF + d, k2.to(KC.dtype.element_ty))
        tl.store(VC + base + pos * sks + e, v_new.to(VC.dtype.element_ty))
    # q and the new key as the model holds them, in the activations' dtype (the key: the cache's)
    q1 = q1.to(QKV.dtype.element_ty).to(tl.float32) * scale
    q2 = q2.to(QKV.dtype.element_ty).to(tl.float32) * scale
    k1, k2 = k1.to(KC.dtype.element_ty).to(tl.float32), k2.to(KC.dtype.element_ty).to(tl.float32)
    m = tl.sum(q1 * k1, axis=0) + tl.sum(q2 * k2, axis=0)  # the running max starts at the new key's score
    total = m * 0.0 + 1.0  # exp(score - m) of the new key (a scalar of m's type)
    acc = v_new.to(tl.float32)
    for s0 in range(first, pos, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        held = (s < pos) & (s >= pad)
        if PREFETCH:  # this tile came with the step before; the next one's is asked for now
            c1, c2, v = c1_next, c2_next, v_next
            n = s + BLOCK_S
            c1_next, c2_next, v_next = _slot_tile(KC, VC, base, n, (n < pos) & (n >= pad), sks, d, e, HALF)
        else:
            c1, c2, v = _slot_tile(KC, VC, base, s, held, sks, d, e, HALF)
        c1, c2 = c1.to(tl.float32), c2.to(tl.float32)
        scores = tl.sum(c1 * q1[None, :], axis=1) + tl.sum(c2 * q2[None, :], axis=1)
        scores = tl.where(held, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)  # 0 where not held
        shrink = tl.exp(m - m_new)
        acc = acc * shrink + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        total = total * shrink + tl.sum(p, axis=0)
        m = m_new
    tl.store(O + b * H * HD + h * HD + e, (acc / total).to(O.dtype.element_ty))


# The attention's held slots a tile. Its loop over a row's held slots waits for one tile at a time
# (the next read a step ahead), and one program a head leaves only 12 programs' loads in flight: at
# 64 slots a tile a 192-slot context is three DRAM round trips in turn (an H200: 8.2 µs a call).
# A tile of the cache's whole width, up to 16,384 values (256 slots of hd 64, 128 of hd 128), is
# read before the wait; slots past pos are masked, not read. ptxas for sm_90: 207 registers at 256
# x 64 and 8 warps, no spills, under Triton 3.9; under 3.6 (the leases') 255 and 8 bytes of
# spills at 12 key/value heads (16 warps: 128 and 56 bytes); 256 x 128 spills. Chosen from the
# shape, not timed: a tuner's first call comes at an empty cache (pos 0), where every tile times
# the same. The interpreter keeps tiles of at most 64, so the tests walk several.
def attention_tile(width: int, hd: int) -> tuple[int, int]:
    """(held slots a tile, warps) for a cache ``width`` slots wide of ``hd``-wide heads."""
    slots = max(16, min(pow2(width), 64 if INTERPRET else 16384 // hd))
    return slots, 4 if slots * hd <= 4096 else 8


@triton.jit
def _attention_kernel(QKV, KC, VC, POS, PAD, COS, SIN, O, spad, skb, skh, sks, scale,
                      H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, ROPE: tl.constexpr,
                      PREFETCH: tl.constexpr, PDL: tl.constexpr, BLOCK_S: tl.constexpr):
    """``attend_head`` for row program_id(0), head program_id(1); PDL: it waits for the kernel before."""
    attend_head(QKV, KC, VC, POS, PAD, COS, SIN, O, spad, skb, skh, sks, scale, tl.program_id(0).to(tl.int64),
            tl.program_id(1), None, 0, 0, H, HKV, HD, ROPE, PREFETCH, 1 if PDL else 0, BLOCK_S)


def _embed_launch(idx: Tensor, wte: Tensor, wpe: Tensor | None, pos: Tensor, pad: Tensor) -> Tensor:
    B, C = idx.size(0), wte.size(1)
    idx, x = idx.contiguous(), wte.new_empty(B, C)  # (ids[:, t] is a strided view)
    spad = 1 if pad.numel() > 1 else 0
    _embed_kernel[(B,)](idx, wte, wpe, pos, pad, x, C, spad, HAS_WPE=wpe is not None, BLOCK=pow2(C))
    return x


@functools.cache
def _gdc(index: int) -> bool:
    """Whether CUDA device ``index`` has grid dependency control (PDL): Hopper (sm_90) and later."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def _overlap(x: Tensor, pdl: bool) -> dict:
    """The launch's PREFETCH and PDL constants and options: ``pdl`` asks for both; PDL itself
    needs a GPU with it (the interpreter runs the prefetching road alone, which the CPU tests
    hold to the plain one)."""
    on = pdl and x.is_cuda and not INTERPRET and _gdc(x.device.index or 0)
    return {"PREFETCH": pdl, "PDL": on, **({"launch_pdl": True} if on else {})}


def _linear_launch(x: Tensor, w: Tensor, bias: Tensor | None, g: Tensor | None, beta: Tensor | None,
                   r: Tensor | None, eps: float, norm: int, act: int,
                   out_dtype: torch.dtype | None, pdl: bool = False) -> Tensor:
    """act(norm(x) @ wᵀ + bias) + r for x (M, K), w (N, K): (M, N) in ``out_dtype`` (x's if None);
    for SwiGLU w is (2N, K), the gate's rows then the up's, and bias (2N,). ``pdl``: prefetch
    the weights and, on Hopper, launch as a programmatic dependent (module docstring)."""
    (M, K), N = x.shape, w.size(0) // 2 if act == ACTS["swiglu"] else w.size(0)
    x, w, r = x.contiguous(), w.contiguous(), r if r is None else r.contiguous()
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(M, meta["BLOCK_M"]))  # noqa: E731
    _linear_kernel[grid](x, w, bias, g, beta, r, y, M, N, K, eps, NORM=norm, HAS_BIAS=bias is not None,
                         HAS_BETA=beta is not None, ACT=act, HAS_RES=r is not None,
                         FP32_DOT=INTERPRET or w.dtype == torch.float32,
                         **_overlap(x, pdl))  # fmt: skip
    return y


def _attention_launch(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor, pad: Tensor,
                      cos: Tensor | None, sin: Tensor | None, n_head: int, n_kv_head: int,
                      pdl: bool = False) -> Tensor:
    """qkv (B, (H + 2·Hkv)·hd); caches (B, Hkv, S, hd); RoPE's tables (max_seq_len, hd/2) or None
    -> o (B, H·hd); k (turned) and v written at slot pos. ``pdl`` as ``_linear_launch``'s."""
    B, S, hd = qkv.size(0), k_cache.size(2), k_cache.size(3)
    slots, warps = attention_tile(S, hd)
    o = qkv.new_empty(B, n_head * hd)
    spad = 1 if pad.numel() > 1 else 0
    _attention_kernel[(B, n_head)](qkv, k_cache, v_cache, pos, pad, cos, sin, o, spad,
                                   *k_cache.stride()[:3], 1 / math.sqrt(hd), H=n_head, HKV=n_kv_head, HD=hd,
                                   ROPE=cos is not None, BLOCK_S=slots, num_warps=warps,
                                   **_overlap(qkv, pdl))  # fmt: skip
    return o


decode_embed = kernel_op("decode_embed", _embed_launch,
                         lambda idx, wte, *_: wte.new_empty(idx.size(0), wte.size(1)))
decode_linear = kernel_op("decode_linear", _linear_launch, lambda x, w, *a: x.new_empty(
    x.size(0), w.size(0) // 2 if a[6] == ACTS["swiglu"] else w.size(0), dtype=a[7] or x.dtype))
decode_attention = kernel_op("decode_attention", _attention_launch,
                             lambda qkv, kc, *a: qkv.new_empty(qkv.size(0), a[5] * kc.size(3)),
                             mutates=("k_cache", "v_cache"))


def decode_linear_ref(x, w, bias, g, beta, r, eps, norm, act, out_dtype=None) -> Tensor:
    """The same in PyTorch: the norm in fp32 rounded to x's dtype, the product, bias, GELU, then
    the residual added to the rounded result."""
    if norm:
        h = x.float()
        if norm == NORMS["layer"]:
            h = F.layer_norm(h, h.shape[-1:], g.float(), None if beta is None else beta.float(), eps)
        else:
            h = F.rms_norm(h, h.shape[-1:], g.float(), eps)
        x = h.to(x.dtype)
    y = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    if act == ACTS["gelu"]:
        y = F.gelu(y, approximate="tanh")
    if act == ACTS["swiglu"]:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    y = y.to(out_dtype or x.dtype)
    return y if r is None else (y.float() + r.float()).to(y.dtype)
