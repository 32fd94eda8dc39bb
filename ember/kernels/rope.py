"""Rotary positions (rotate-half, as ``ember.model.gpt.apply_rotary``) on q and k in one launch.

    q_rot, k_rot = rope_qk(q, k, cos, sin)    # q (B, H, T, hd), k (B, Hkv, T, hd); cos, sin as gpt.py's

One program per (b, block of positions) loads their cos/sin once and turns every head of q and k,
reading all of them before it writes any. Dimension i pairs with i + hd/2,
(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), fp32 inside.
The registered op ``ember::rope`` takes q and k as gpt.py holds them, (B, heads, T, hd) views of
the linears' (B, T, C) (any strides, the last dim dense), and returns contiguous (B, T, heads, hd)
tensors, which ``rope_qk`` hands on transposed, so the gradients flow back into the linears'
(B, T, C) without a copy.
(When it wrote (B, H, T, hd) contiguous, as apply_rotary's torch.cat does, the gradients came back
transposed and each backward paid a copy of q and k: on an H200 it ran at 30% of the HBM bound
where Liger's, in the linears' layout, ran at 64%.) The inputs' transposes happen inside the op,
not as views autograd records around it (two nodes fewer a forward and backward: with four, an
H200's host took 616 us a call against Liger's 294). The backward is the same kernel turning by
-angle. Per call at B x T = 16 x 1024, H = Hkv = 12, hd = 64 (gpt2-small) in bf16: reads q, k
(50 MB) and writes them (50 MB), tables 0.3 MB (re-read from L2); 6 FLOPs per pair (75 MFLOP,
0.75 FLOP/byte): memory-bound, floor 100 MB / 3.35 TB/s = 30 us on an H100.
Reference: ``rope_qk_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ember.kernels import fastest, kernel_op, pow2, triton_ready

# A program's tile: BLOCK_T positions x BLOCK_H heads x hd/2 of each half, about TILE elements;
# k's heads have their own block (BLOCK_HK), so GQA's few key heads do not leave lanes masked.
# LOADS_FIRST: q's and k's loads are all issued before any store (a store to QO may alias K as
# far as the compiler knows, so otherwise k's loads wait behind q's stores). The H200 lease timed
# tiles of 4,096 with q then k (30% of the HBM bound, with a copy in each backward since gone);
# kernels.py's "ember as before" row times that road beside this one. The fourth lease timed the
# first of CONFIGS, (TILE, warps), at 76% of the bound and 0.96x Liger's, whose programs each take
# one position (at gpt2-small's heads, a tile of 512). The others are smaller and larger tiles, and
# fewer warps a tile; ``ember.kernels.fastest`` times them on the shape and layout at hand (the
# backward's gradients come contiguous, the forward's q and k as views of the projections) and
# keeps the fastest, as it does the norms' configs.
CONFIGS = [(2048, 4), (512, 1), (512, 2), (1024, 2), (1024, 4), (4096, 8)]
CONFIG: tuple[int, int] | None = None  # a config to run untimed (benchmarks' roads, tests)
LOADS_FIRST = True


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, T, H, HK, sqb, sqh, sqt, skb, skh, skt, scb, sct,
                 INVERSE: tl.constexpr, ACC: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
                 LOADS_FIRST: tl.constexpr):
    """One program turns BLOCK_T positions of one row b: every head of q and of k (heads are
    a block of BLOCK_H heads for q's H, of BLOCK_HK for k's Hkv)."""
    b, pid_t = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T))[:, None, None]  # (BLOCK_T, 1, 1)
    h = tl.arange(0, BLOCK_H)[None, :, None]  # (1, BLOCK_H, 1)
    hk = tl.arange(0, BLOCK_HK)[None, :, None]
    d = tl.arange(0, BLOCK_D)[None, None, :]  # (1, 1, BLOCK_D)
    row = (t < T) & (d < HALF)
    cos = tl.load(COS + b * scb + t * sct + d, mask=row, other=0.0).to(ACC)  # (BLOCK_T, 1, BLOCK_D)
    sin = tl.load(SIN + b * scb + t * sct + d, mask=row, other=0.0).to(ACC)
    if INVERSE:
        sin = -sin
    hd = 2 * HALF  # outputs contiguous (B, T, heads, hd)
    mq, mk = row & (h < H), row & (hk < HK)
    xq, xk = Q + b * sqb + h * sqh + t * sqt + d, K + b * skb + hk * skh + t * skt + d
    q1, q2 = tl.load(xq, mask=mq, other=0.0), tl.load(xq + HALF, mask=mq, other=0.0)
    if LOADS_FIRST:
        k1, k2 = tl.load(xk, mask=mk, other=0.0), tl.load(xk + HALF, mask=mk, other=0.0)
    q1, q2 = q1.to(ACC), q2.to(ACC)
    o = QO + ((b * T + t) * H + h) * hd + d
    tl.store(o, (q1 * cos - q2 * sin).to(QO.dtype.element_ty), mask=mq)
    tl.store(o + HALF, (q2 * cos + q1 * sin).to(QO.dtype.element_ty), mask=mq)
    if not LOADS_FIRST:
        k1, k2 = tl.load(xk, mask=mk, other=0.0), tl.load(xk + HALF, mask=mk, other=0.0)
    k1, k2 = k1.to(ACC), k2.to(ACC)
    o = KO + ((b * T + t) * HK + hk) * hd + d
    tl.store(o, (k1 * cos - k2 * sin).to(KO.dtype.element_ty), mask=mk)
    tl.store(o + HALF, (k2 * cos + k1 * sin).to(KO.dtype.element_ty), mask=mk)


def _rope_launch(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> tuple[Tensor, Tensor]:
    """q (B, H, T, hd), k (B, Hkv, T, hd), cos/sin (T, hd/2), (1, T, hd/2), (1, 1, T, hd/2) or (B, 1, T, hd/2)
    -> q, k turned by +angle (-angle with inverse), contiguous (B, T, heads, hd)."""
    ok, why = triton_ready(q.device)
    if not ok:
        raise RuntimeError(why)
    (B, H, T, hd), HK = q.shape, k.size(1)
    if q.stride(-1) != 1:  # strided heads/positions are fine
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    scb = cos.stride(0) if cos.dim() > 2 and cos.size(0) > 1 else 0  # the tables' row and position strides
    qo, ko = q.new_empty((B, T, H, hd)), k.new_empty((B, T, HK, hd))
    half = hd // 2
    acc = tl.float64 if q.dtype == torch.float64 else tl.float32
    block_h, block_d = pow2(H), pow2(half)

    def run(config: tuple[int, int]) -> None:
        tile, warps = config
        block_t = max(1, min(pow2(T), tile // (block_h * block_d)))
        _rope_kernel[(B, -(-T // block_t))](
            q, k, qo, ko, cos, sin, T, H, HK, *_bht(q), *_bht(k), scb, cos.stride(-2),
            INVERSE=inverse, ACC=acc, HALF=half, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HK=pow2(HK),
            BLOCK_D=block_d, LOADS_FIRST=LOADS_FIRST, num_warps=warps,
        )  # fmt: skip

    if B and T:
        # timed once for a power of two of rows and of positions, not again at every new batch size
        key = ("rope", pow2(B), min(pow2(T), 65536), H, HK, hd, q.dtype, q.stride(2), k.stride(2))
        run(CONFIG or fastest(key, CONFIGS, run, q.device))
    return qo, ko


def _bht(x: Tensor) -> tuple[int, int, int]:
    """(B, heads, T, hd) ``x``'s strides in the kernel's order: batch, head, position."""
    return x.stride(0), x.stride(1), x.stride(2)


def _setup(ctx, inputs, output):
    _, _, cos, sin, ctx.inverse = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dq, dk):
    # a rotation's transpose is the rotation by the opposite angle (and the op is its own backward's);
    # dq, dk (B, T, heads, hd) as the outputs, the inputs' gradients (B, heads, T, hd) as they
    dq, dk = _rope(dq.transpose(1, 2), dk.transpose(1, 2), *ctx.saved_tensors, not ctx.inverse)
    return dq.transpose(1, 2), dk.transpose(1, 2), None, None, None


def _fake(q: Tensor, k: Tensor, *_) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.transpose(1, 2).shape), k.new_empty(k.transpose(1, 2).shape)


_rope = kernel_op("rope", _rope_launch, _fake, _setup, _backward)


def rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """apply_rotary(q, (cos, sin)), apply_rotary(k, (cos, sin)) in one kernel; q's dtype out. q
    (B, H, T, hd) and k (B, Hkv, T, hd) as gpt.py's; the outputs are transposes of (B, T, heads, hd)
    tensors (module docstring)."""
    qo, ko = _rope(q, k, cos, sin, False)
    return qo.transpose(1, 2), ko.transpose(1, 2)


def rope_qk_ref(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """gpt.py's apply_rotary on q and k, fp32 (or fp64) inside, the input's dtype out."""
    acc = torch.promote_types(q.dtype, torch.float32)
    cos, sin = (c.to(acc).reshape(-1, 1, *c.shape[-2:]) for c in (cos, sin))  # (1 or B, 1, T, hd/2)

    def turn(x: Tensor) -> Tensor:
        x1, x2 = x.to(acc).chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return turn(q), turn(k)
