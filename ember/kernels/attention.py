"""FlashAttention-2-style attention, forward and backward, with GQA and causal block skipping.

    o = flash_attention(q, k, v, causal=True)   # q (B, H, T, hd); k, v (B, Hkv, T, hd), H % Hkv == 0

Fused: Q K^T, scale, causal mask, online softmax (fp32 running max and sum; fp64 for fp64) and
P V, tile by tile: the T x T scores never reach memory; the forward keeps the row logsumexp. The
backward: delta = rowsum(dO * O), then dK, dV per key block (looping over the query heads that
share it and their query blocks) and dQ per query block, recomputing P from the logsumexp.
FLOPs: 4 B H T^2 hd forward, halved when causal; backward 2.5x that (this one computes 3.5x: P is
recomputed in both backward kernels). Bytes (fewest): forward q, k, v, o = 4 B H T hd x 2 (bf16);
backward 8 such tensors. Causal forward: T/4 FLOP per byte at any hd, so at gpt2-small (B=16, H=12,
T=1024, hd=64) 26 GFLOP over 100 MB, 256 FLOP/byte (backward ~450 as computed): compute-bound (H100
ridge ~295). H200, bf16, causal fwd+bwd: 0.51 ms vs SDPA flash's 0.60; llama-ish (hd=128, GQA 4:1)
1.01 vs 1.35. Reference: ``flash_attention_ref``. Under TRITON_INTERPRET blocks are 16-32, dots fp32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from ember.kernels import INTERPRET, kernel_op, triton_ready

HEAD_DIMS = (16, 32, 64, 128)


@triton.jit
def mm(a, b, IN: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with both operands rounded to the inputs' dtype, accumulated in fp32 (fp64 for fp64).
    Triton 3.9's interpreter multiplies bf16's raw bits, so there the rounded operands go via fp32."""
    a = a.to(IN)
    b = b.to(IN)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, skt, svt, offs_m, offs_n, lo, hi, T, qk_scale,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, IN: tl.constexpr,
               PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Key blocks lo..hi of one query block; MASK: the blocks that need the causal or length mask."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASK:
            kt = tl.load(kt_ptrs + start_n * skt, mask=cols[None, :] < T, other=0.0)
            v = tl.load(v_ptrs + start_n * svt, mask=cols[:, None] < T, other=0.0)
        else:
            kt = tl.load(kt_ptrs + start_n * skt)
            v = tl.load(v_ptrs + start_n * svt)
        qk = mm(q, kt, IN, PREC, UPCAST) * qk_scale  # log2 units
        if MASK:
            keep = cols[None, :] < T
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= cols[None, :])
            qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mm(p, v, IN, PREC, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
                sob, soh, sot, sod, H, T, REP, qk_scale, CAUSAL: tl.constexpr, HD: tl.constexpr,
                ACC: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query block, batch x head); the last query blocks (most keys) start first."""
    IN: tl.constexpr = Q.dtype.element_ty
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HD)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=offs_m[:, None] < T, other=0.0)
    kt_ptrs = K + b * skb + (h // REP) * skh + offs_n[None, :] * skt + offs_d[:, None] * skd
    v_ptrs = V + b * svb + (h // REP) * svh + offs_n[:, None] * svt + offs_d[None, :] * svd
    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, HD], ACC)
    if CAUSAL:  # keys below this block's first row are all visible; the diagonal blocks are masked
        mid = pid_m * BLOCK_M
        hi = tl.minimum(mid + BLOCK_M, T)
    else:  # only the ragged last key block is masked
        mid = T // BLOCK_N * BLOCK_N
        hi = T
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, skt, svt, offs_m, offs_n, 0, mid, T,
                               qk_scale, False, CAUSAL, BLOCK_N, IN, PREC, UPCAST)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, skt, svt, offs_m, offs_n, mid, hi, T,
                               qk_scale, True, CAUSAL, BLOCK_N, IN, PREC, UPCAST)
    rows = offs_m < T
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=rows)
    o = acc / l_i[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod,
             o.to(O.dtype.element_ty), mask=rows[:, None])


@triton.jit
def _bwd_delta_kernel(O, DO, DELTA, sob, soh, sot, sod, sdb, sdh, sdt, sdd, H, T,
                      HD: tl.constexpr, ACC: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O), the softmax backward's per-row term."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HD)
    rows = offs_m[:, None] < T
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod, mask=rows, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :] * sdd, mask=rows, other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * T + offs_m, tl.sum(o.to(ACC) * do.to(ACC), 1), mask=offs_m < T)


@triton.jit
def _dkdv_inner(dk, dv, k, v, qt_ptrs, do_ptrs, lse_ptr, delta_ptr, sqt, sdt, offs_n, offs_m, lo, hi, T,
                qk_scale, MASK: tl.constexpr, BLOCK_M: tl.constexpr, IN: tl.constexpr,
                PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Query blocks lo..hi against one key block, transposed (keys on rows). Rows past T load as
    zeros (q, dO, lse, delta) and so add nothing; MASK: the causal diagonal blocks."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        qt = tl.load(qt_ptrs + start_m * sqt, mask=rows[None, :] < T, other=0.0)
        do = tl.load(do_ptrs + start_m * sdt, mask=rows[:, None] < T, other=0.0)
        lse = tl.load(lse_ptr + rows, mask=rows < T, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_ptr + rows, mask=rows < T, other=0.0)
        st = mm(k, qt, IN, PREC, UPCAST) * qk_scale
        if MASK:
            st = tl.where(rows[None, :] >= offs_n[:, None], st, float("-inf"))
        pt = tl.exp2(st - lse[None, :])
        dv += mm(pt, do, IN, PREC, UPCAST)
        dpt = mm(v, tl.trans(do), IN, PREC, UPCAST)
        dst = pt * (dpt - delta[None, :])
        dk += mm(dst, tl.trans(qt), IN, PREC, UPCAST)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, sqb, sqh, sqt, sqd, skb, skh, skt, skd,
                     svb, svh, svt, svd, sdb, sdh, sdt, sdd, H, T, REP, sm_scale, qk_scale,
                     CAUSAL: tl.constexpr, HD: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
                     UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (key block, batch x kv head): dK, dV summed over the REP query heads that
    read this kv head, in registers. dK, dV are laid out as K, V."""
    IN: tl.constexpr = Q.dtype.element_ty
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = (bhk // (H // REP)).to(tl.int64)
    hk = bhk % (H // REP)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HD)
    cols = offs_n[:, None] < T
    k_off = b * skb + hk * skh + offs_n[:, None] * skt + offs_d[None, :] * skd
    v_off = b * svb + hk * svh + offs_n[:, None] * svt + offs_d[None, :] * svd
    k = tl.load(K + k_off, mask=cols, other=0.0)
    v = tl.load(V + v_off, mask=cols, other=0.0)
    dk = tl.zeros([BLOCK_N, HD], ACC)
    dv = tl.zeros([BLOCK_N, HD], ACC)
    lo = pid_n * BLOCK_N if CAUSAL else 0  # earlier queries never see these keys
    mid = tl.minimum(lo + BLOCK_N, T) if CAUSAL else 0
    for h in range(hk * REP, hk * REP + REP):
        qt_ptrs = Q + b * sqb + h * sqh + offs_m[None, :] * sqt + offs_d[:, None] * sqd
        do_ptrs = DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :] * sdd
        row0 = (b * H + h) * T
        dk, dv = _dkdv_inner(dk, dv, k, v, qt_ptrs, do_ptrs, LSE + row0, DELTA + row0, sqt, sdt, offs_n,
                             offs_m, lo, mid, T, qk_scale, True, BLOCK_M, IN, PREC, UPCAST)
        dk, dv = _dkdv_inner(dk, dv, k, v, qt_ptrs, do_ptrs, LSE + row0, DELTA + row0, sqt, sdt, offs_n,
                             offs_m, mid, T, T, qk_scale, False, BLOCK_M, IN, PREC, UPCAST)
    tl.store(DK + k_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=cols)
    tl.store(DV + v_off, dv.to(DV.dtype.element_ty), mask=cols)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_ptrs, vt_ptrs, skt, svt, offs_m, offs_n, lo, hi, T, qk_scale,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, IN: tl.constexpr,
              PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Key blocks lo..hi against one query block; MASK as in ``_fwd_inner``."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASK:
            k = tl.load(k_ptrs + start_n * skt, mask=cols[:, None] < T, other=0.0)
            vt = tl.load(vt_ptrs + start_n * svt, mask=cols[None, :] < T, other=0.0)
        else:
            k = tl.load(k_ptrs + start_n * skt)
            vt = tl.load(vt_ptrs + start_n * svt)
        s = mm(q, tl.trans(k), IN, PREC, UPCAST) * qk_scale
        if MASK:
            keep = cols[None, :] < T
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= cols[None, :])
            s = tl.where(keep, s, float("-inf"))
        p = tl.exp2(s - lse[:, None])
        ds = p * (mm(do, vt, IN, PREC, UPCAST) - delta[:, None])
        dq += mm(ds, k, IN, PREC, UPCAST)
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sqb, sqh, sqt, sqd, skb, skh, skt, skd,
                   svb, svh, svt, svd, sdb, sdh, sdt, sdd, H, T, REP, sm_scale, qk_scale,
                   CAUSAL: tl.constexpr, HD: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
                   UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query block, batch x head): dQ = scale * dS K over its key blocks, laid out as Q."""
    IN: tl.constexpr = Q.dtype.element_ty
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HD)
    rows = offs_m < T
    q_off = b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd
    q = tl.load(Q + q_off, mask=rows[:, None], other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :] * sdd,
                 mask=rows[:, None], other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=rows, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + bh.to(tl.int64) * T + offs_m, mask=rows, other=0.0)
    k_ptrs = K + b * skb + (h // REP) * skh + offs_n[:, None] * skt + offs_d[None, :] * skd
    vt_ptrs = V + b * svb + (h // REP) * svh + offs_n[None, :] * svt + offs_d[:, None] * svd
    dq = tl.zeros([BLOCK_M, HD], ACC)
    if CAUSAL:
        mid = pid_m * BLOCK_M
        hi = tl.minimum(mid + BLOCK_M, T)
    else:
        mid = T // BLOCK_N * BLOCK_N
        hi = T
    dq = _dq_inner(dq, q, do, lse, delta, k_ptrs, vt_ptrs, skt, svt, offs_m, offs_n, 0, mid, T, qk_scale,
                   False, CAUSAL, BLOCK_N, IN, PREC, UPCAST)
    dq = _dq_inner(dq, q, do, lse, delta, k_ptrs, vt_ptrs, skt, svt, offs_m, offs_n, mid, hi, T, qk_scale,
                   True, CAUSAL, BLOCK_N, IN, PREC, UPCAST)
    tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows[:, None])


LOG2E = 1.4426950408889634
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head dim (16 and 32 take 64's) for 16-bit
# inputs on a GPU: the fastest of 8 each on an H200 (bf16, causal, B=16, T=1024: H=12, hd=64 and
# H=16, Hkv=4, hd=128; kernel ms beside them). The causal diagonal needs BLOCK_N | BLOCK_M (forward,
# dQ) and BLOCK_M | BLOCK_N (dK, dV). fp32 and fp64 take small tiles (twice the bytes per element).
GPU_CONFIGS = {
    "fwd": {64: (64, 64, 4, 3), 128: (64, 64, 4, 3)},  # 0.097, 0.214
    "dkdv": {64: (64, 64, 4, 3), 128: (32, 64, 4, 4)},  # 0.171, 0.423
    "dq": {64: (64, 64, 4, 3), 128: (64, 32, 4, 4)},  # 0.101, 0.255
}
WIDE_CONFIGS = {"fwd": (64, 32, 4, 2), "dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2)}
INTERPRET_BLOCKS = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}  # small: numpy runs each program


def _launch(which: str, q: Tensor) -> dict:
    """The block sizes (and, on a GPU, warps and pipeline stages) of one kernel for q's head dim and dtype."""
    if INTERPRET:
        return dict(zip(("BLOCK_M", "BLOCK_N"), INTERPRET_BLOCKS[which], strict=True))
    cfg = GPU_CONFIGS[which][max(q.size(-1), 64)] if q.element_size() == 2 else WIDE_CONFIGS[which]
    return dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), cfg, strict=True))


@functools.cache
def _consts_for(device: str, dtype: torch.dtype, hd: int, tf32: bool) -> dict:
    ok, why = triton_ready(device)
    if not ok:
        raise RuntimeError(why)
    half = dtype in (torch.bfloat16, torch.float16)
    prec = "tf32" if half or (tf32 and dtype == torch.float32) else "ieee"
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    return dict(HD=hd, ACC=acc, PREC=prec, UPCAST=INTERPRET and half)


def _consts(q: Tensor) -> dict:
    """The constexprs that depend on the dtype: accumulator, dot precision (tf32 for fp32 only as
    torch's matmul allows it), and the interpreter's detour for 16-bit dots."""
    tf32 = torch.backends.cuda.matmul.allow_tf32 and not INTERPRET
    return _consts_for(q.device.type, q.dtype, q.size(-1), tf32)


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _grad_like(t: Tensor) -> tuple[Tensor, Tensor]:
    """(t, an empty gradient laid out as t): where t has gaps, empty_like is dense, so t is copied to it."""
    g = torch.empty_like(t)
    return (t, g) if g.stride() == t.stride() else (torch.empty_like(t).copy_(t), g)


def _forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """(o, lse): o like q; lse (B, H, T) the natural-log row logsumexp of the scaled scores."""
    B, H, T, _ = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(B, H, T, dtype=_lse_dtype(q), device=q.device)
    cfg = _launch("fwd", q)
    _fwd_kernel[(triton.cdiv(T, cfg["BLOCK_M"]), B * H)](
        q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(), H, T, H // k.size(1),
        scale * LOG2E, CAUSAL=causal, **_consts(q), **cfg)
    return o, lse


def _forward_fake(q, k, v, causal, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=_lse_dtype(q))


def _backward_impl(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
                        scale: float) -> tuple[Tensor, Tensor, Tensor]:
    B, H, T, hd = q.shape
    consts = _consts(q)
    (q, dq), (k, dk), (v, dv) = _grad_like(q), _grad_like(k), _grad_like(v)
    delta = torch.empty_like(lse)
    bm = 16 if INTERPRET else 64
    _bwd_delta_kernel[(triton.cdiv(T, bm), B * H)](o, do, delta, *o.stride(), *do.stride(), H, T, HD=hd,
                                                   ACC=consts["ACC"], BLOCK_M=bm)
    args = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), H, T, H // k.size(1), scale, scale * LOG2E)
    cfg = _launch("dkdv", q)
    _bwd_dkdv_kernel[(triton.cdiv(T, cfg["BLOCK_N"]), B * k.size(1))](
        q, k, v, do, lse, delta, dk, dv, *args, CAUSAL=causal, **consts, **cfg)
    cfg = _launch("dq", q)
    _bwd_dq_kernel[(triton.cdiv(T, cfg["BLOCK_M"]), B * H)](
        q, k, v, do, lse, delta, dq, *args, CAUSAL=causal, **consts, **cfg)
    return dq, dk, dv


def _backward_fake(do, q, k, v, o, lse, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_attention_backward = kernel_op("flash_attention_backward", _backward_impl, _backward_fake)


def _setup(ctx, inputs, output):
    q, k, v, ctx.causal, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, *output)


def _backward(ctx, do, _dlse):
    dq, dk, dv = _attention_backward(do, *ctx.saved_tensors, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


_attention = kernel_op("flash_attention", _forward, _forward_fake, _setup, _backward)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                    scale: float | None = None) -> Tensor:
    """softmax(q k^T * scale + causal mask) v; q (B, H, T, hd), k, v (B, Hkv, T, hd) with H a multiple
    of Hkv (query head h reads kv head h // (H / Hkv)); hd in 16, 32, 64, 128; any strides."""
    B, H, T, hd = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2:] != (T, hd) or H % k.size(1):
        raise ValueError(f"flash_attention wants q (B, H, T, hd), k, v (B, Hkv, T, hd), H % Hkv == 0; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if hd not in HEAD_DIMS or not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"flash_attention takes head dims {HEAD_DIMS} and one dtype; got {hd}, "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    scale = hd**-0.5 if scale is None else float(scale)
    return _attention(q, k, v, causal, scale)[0]


def flash_attention_ref(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                        scale: float | None = None) -> Tensor:
    """The formula: softmax(q k^T * scale + causal mask) v, kv heads repeated for GQA."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5 if scale is None else scale)
    if causal:
        T, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(T, S, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s.softmax(dim=-1) @ v
