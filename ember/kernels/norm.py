"""RMSNorm and LayerNorm over the last dim, optionally fused with the residual add before them.

    y = rms_norm(x, weight, eps)                      # x (..., N); or RMSNorm(N) in a model
    y, h = add_rms_norm(x, residual, weight, eps)     # h = x + residual, y = rms_norm(h)

Fused: the residual add, the row statistics, scale and shift (fp32 inside for bf16/fp16, fp64
for fp64), the cast back; the backward makes dx from the saved per-row rstd (and mean) and dw,
db as per-program partial sums over rows, summed after. Per call at R x N = 16,384 x 768
(gpt2-small, B x T = 16 x 1024) in bf16: forward reads x, writes y, 50 MB (with the add 100 MB);
backward reads h, dy and writes dx, 75 MB. ~8 FLOPs per element (0.1 GFLOP, 2 FLOP/byte):
memory-bound, floor 50 MB / 3.35 TB/s = 15 us on an H100. References: ``*_ref`` below.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor, nn

from ember.kernels import fastest, kernel_op, pow2, sm_count, triton_ready


@triton.jit
def _norm_fwd(X, R, W, B, Y, H, Mean, Rstd, M, N, eps, RMS: tl.constexpr, HAS_R: tl.constexpr,
              HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACC: tl.constexpr, ROWS: tl.constexpr,
              BLOCK: tl.constexpr):
    """One program per ROWS rows, each whole row in registers (N <= BLOCK)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (cols[None, :] < N)  # (ROWS, BLOCK)
    at = rows[:, None].to(tl.int64) * N + cols[None, :]
    x = tl.load(X + at, mask=mask, other=0.0)
    if HAS_R:  # h in x's dtype, as torch's x + residual, and the norm reads that rounded h
        x = (x.to(ACC) + tl.load(R + at, mask=mask, other=0.0).to(ACC)).to(H.dtype.element_ty)
        tl.store(H + at, x, mask=mask)
    x = x.to(ACC)
    if not RMS:
        mean = tl.sum(x, axis=1) / N
        x = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(Mean + rows, mean, mask=rows < M)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    tl.store(Rstd + rows, rstd, mask=rows < M)
    y = x * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=cols < N, other=0.0).to(ACC)[None, :]
    tl.store(Y + at, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _add_pairs(a, b, c, d):
    return a + c, b + d


@triton.jit
def _norm_bwd(DY, DH, H, W, Mean, Rstd, DX, DW, DB, M, N, rows_per_program, RMS: tl.constexpr,
              HAS_DH: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACC: tl.constexpr,
              STAGES: tl.constexpr, BLOCK: tl.constexpr):
    """Each program takes rows_per_program rows: dx for each, and its partial sums of dw, db.
    The loop is pipelined (``tl.range``'s stages): the next rows' loads are in flight while this
    row's sums run."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dw = tl.zeros((BLOCK,), ACC)
    db = tl.zeros((BLOCK,), ACC)
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(ACC)
    start = pid.to(tl.int64) * rows_per_program
    for row in tl.range(start, tl.minimum(start + rows_per_program, M), num_stages=STAGES):
        off = row * N
        dy = tl.load(DY + off + cols, mask=mask, other=0.0).to(ACC)
        xhat = tl.load(H + off + cols, mask=mask, other=0.0).to(ACC)
        if not RMS:
            xhat = xhat - tl.load(Mean + row)
        xhat = xhat * tl.load(Rstd + row)
        wdy = dy
        if HAS_W:
            wdy = dy * w
            dw += dy * xhat
        if HAS_B:
            db += dy
        if RMS:
            dx = wdy - xhat * (tl.sum(xhat * wdy, axis=0) / N)  # d/dx of xhat = x * rstd
        else:  # xhat = (x - mean) * rstd; the two sums in one reduction, one round through shared memory
            dot, total = tl.reduce((xhat * wdy, wdy), 0, _add_pairs)
            dx = wdy - xhat * (dot / N) - total / N
        dx = dx * tl.load(Rstd + row)
        if HAS_DH:  # the residual stream's own gradient flows on through h = x + residual
            dx += tl.load(DH + off + cols, mask=mask, other=0.0).to(ACC)
        tl.store(DX + off + cols, dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(DW + pid * N + cols, dw, mask=mask)
    if HAS_B:
        tl.store(DB + pid * N + cols, db, mask=mask)


@triton.jit
def _sum_partials(PW, PB, DW, DB, P, N, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACC: tl.constexpr,
                  BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """dw[n] = sum over p of PW[p, n], and db from PB, each cast to its output's dtype: the
    backward's partial sums in one launch (torch's sum, then a cast, was two launches for dw and
    four with db, each a few µs of a step's ~70 µs norm on an H200)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dw = tl.zeros((BLOCK_N,), ACC)
    db = tl.zeros((BLOCK_N,), ACC)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        at = rows[:, None] * N + cols[None, :]
        keep = (rows[:, None] < P) & (cols[None, :] < N)
        if HAS_W:
            dw += tl.sum(tl.load(PW + at, mask=keep, other=0.0), axis=0)
        if HAS_B:
            db += tl.sum(tl.load(PB + at, mask=keep, other=0.0), axis=0)
    if HAS_W:
        tl.store(DW + cols, dw.to(DW.dtype.element_ty), mask=cols < N)
    if HAS_B:
        tl.store(DB + cols, db.to(DB.dtype.element_ty), mask=cols < N)


# The forward's configs, (rows a program, warps); forward_configs() offers those where a thread
# holds at most 64 values. The H200 timed the first, 4 rows of 768 and 4 warps
# (rows_per_program(), row_warps()), as it timed one row a program. The others
# give each warp fewer or more values of a row (1-2 warps a program: a row's sums stay in one
# warp's shuffles, with no round through shared memory; 8 rows of 8 warps: more of a row's loads
# in flight a program). ``ember.kernels.fastest`` times them on the shape at hand and keeps the
# fastest, as it does the backward's.
FORWARD_CONFIGS = [(1, 1), (2, 1), (2, 2), (4, 2), (8, 4), (8, 8)]
FORWARD: tuple[int, int] | None = None  # a config to run untimed (benchmarks' roads, tests)
# The backward's configs: (programs an SM, stages, warps as a multiple of the row's). Its programs
# each walk their share of the rows, and one row at a time left each load's latency exposed (an
# H200: RMSNorm's forward and backward at 38% of the HBM bound). The loop is pipelined: with 5
# stages the next four rows' loads are in flight while this one's sums run (the interpreter
# ignores it). An H200, 16,384 x 768 bf16 forward + backward, 4 programs an SM: 3 stages 56% of the
# bound (RMSNorm) and 48% (LayerNorm), 5 stages 63% and 49%. More programs an SM keep more rows in
# flight (48-64 registers and 16 KB of shared memory a program at 768 wide leave room for 8).
# The last two give a program 1 or 2 warps (a quarter or half of the row's 4 at 768 wide): a
# row's two sums then stay in one warp's shuffles, or two, with no round through shared memory,
# and 8 programs an SM each keep their own rows in flight (ptxas, sm_90, 768 wide: 254 and 122
# registers, no spills; 8 such programs fill an SM's 64K registers).
# ``ember.kernels.fastest`` times them on the shape at hand once and keeps the fastest; the first
# is the road that H200 timed. backward_stages() caps the stages by shared memory.
BACKWARD_CONFIGS = [(4, 5, 1), (8, 5, 1), (8, 3, 1), (4, 3, 1), (2, 5, 2), (8, 3, 0.25), (8, 5, 0.5)]
BACKWARD: tuple[int, int, float] | None = None  # a config to run untimed (benchmarks' roads, tests)


def backward_stages(block: int, elem: int, loads: int, smem: int, stages: int | None = None) -> int:
    """The backward's stages at rows of ``block`` values of ``elem`` bytes, ``loads`` of them a
    row (dy, h and dh with a residual): each stage past the first keeps one row's loads in shared
    memory, so at most what ``smem`` bytes hold, 32 KB kept for the reductions (an H100's 227 KB
    a block hold 3 stages of 16,384-wide bf16 rows, 2 of 32,768, 1 of 65,536); ``stages``: the
    most wanted (the first config's)."""
    stages = BACKWARD_CONFIGS[0][1] if stages is None else stages
    return max(1, min(stages, 1 + (smem - 32 * 1024) // (loads * block * elem)))


@functools.cache
def _smem(index: int) -> int:
    """A block's shared memory on CUDA device ``index``, as Triton's launcher checks it."""
    try:
        return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    except Exception:  # noqa: BLE001 -- a Triton without that table: the least of recent GPUs' (99 KB)
        return 99 * 1024


def rows_per_program(block: int) -> int:
    """The forward's rows a program: a tile of about 4,096 values, 4 rows at gpt2-small's 768
    wide. Each thread then has four rows' loads in flight, and one shared-memory round sums the
    statistics of all four, where one row a program pays that round, and a program's start, for
    every row (inductor's norm kernels take several rows a program too). On an H200 it timed as
    one row did (0.070 against 0.071 ms, forward and backward): the first of
    ``forward_configs``, which benchmarks/kernels.py times beside one row (``FORWARD``)."""
    return max(1, min(16, 4096 // block))


def forward_configs(block: int) -> list[tuple[int, int]]:
    """The forward's (rows a program, warps) for rows of ``block`` values: the first runs
    untimed (``fastest``); those of ``FORWARD_CONFIGS`` that give a thread at most 64 values
    join it (at 768 wide all, at 2,048 three, past 2,048 none)."""
    first = (rows_per_program(block), row_warps(block))
    return [first] + [(r, w) for r, w in FORWARD_CONFIGS if r * block <= 64 * 32 * w and (r, w) != first]


def row_warps(block: int) -> int:
    """The warps a program of rows of ``block`` values runs with: 4, or one per 512 values, up to 16."""
    return min(16, max(4, block // 512))


def backward_configs(block: int, warps: int) -> list[tuple[int, int, float]]:
    """``BACKWARD_CONFIGS`` for rows of ``block`` values at ``warps`` warps a row: those with
    fewer warps than the row's only where a thread then holds at most 32 of a row's values (at
    768 wide all; at 2,048 the 2-warp config alone)."""
    return [c for c in BACKWARD_CONFIGS if c[2] >= 1 or max(1, int(warps * c[2])) * 32 * 32 >= block]


def _launch_args(x: Tensor) -> dict:
    """Refuse a device Triton can't run on; one row's block, its warps, the accumulation dtype."""
    ok, why = triton_ready(x.device)
    if not ok:
        raise RuntimeError(why)
    block = pow2(x.size(-1))
    if block > 65536:
        raise ValueError(f"the norm kernels hold a row in registers: {x.size(-1)} columns is too many")
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    return dict(ACC=acc, BLOCK=block, num_warps=row_warps(block))


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _outputs(x: Tensor, residual: Tensor | None, rms: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    M = x.shape[:-1].numel()
    h = x.new_empty(x.shape if residual is not None else 0)
    return x.new_empty(x.shape), h, x.new_empty(0 if rms else M, dtype=_acc(x)), x.new_empty(M, dtype=_acc(x))


def _norm_launch(x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None, eps: float,
                 rms: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x (..., N) -> y (..., N), h = x + residual (..., N), mean and rstd (rows,) in fp32 (fp64 for
    fp64 x), kept for the backward; h is empty without a residual, mean for rms."""
    y, h, mean, rstd = out = _outputs(x, residual, rms)
    x, r, w, b = (t.contiguous() if t is not None else None for t in (x, residual, weight, bias))
    args, M = _launch_args(x), rstd.numel()
    args.pop("num_warps")

    def run(config: tuple[int, int]) -> None:
        rows, warps = config
        _norm_fwd[(-(-M // rows),)](x, r, w, b, y, h if r is not None else None, None if rms else mean, rstd,
                                    M, x.size(-1), eps, RMS=rms, HAS_R=r is not None, HAS_W=w is not None,
                                    HAS_B=b is not None, ROWS=rows, num_warps=warps, **args)  # fmt: skip

    if M:
        key = ("norm_forward", min(pow2(M), 65536), x.size(-1), x.dtype, rms, r is not None, w is not None,
               b is not None)  # fmt: skip
        run(FORWARD or fastest(key, forward_configs(args["BLOCK"]), run, x.device))
    return out


def _norm_backward_launch(dy: Tensor, dh: Tensor | None, h: Tensor, weight: Tensor | None, mean: Tensor,
                          rstd: Tensor, rms: bool, has_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """-> dx (..., N); dw, db (N,) in the weight's dtype (without one, fp32, or fp64 for fp64),
    empty without a weight or a bias."""
    h, dy, dh, w = (t.contiguous() if t is not None else None for t in (h, dy, dh, weight))
    M, N = rstd.numel(), h.size(-1)
    out = _grad_dtype(h, w)
    if M == 0:  # no rows: no launch (its grid would be empty)
        return h.new_empty(h.shape), h.new_zeros(N if w is not None else 0, dtype=out), \
            h.new_zeros(N if has_bias else 0, dtype=out)  # fmt: skip
    sms = sm_count(h.get_device()) if h.is_cuda else 2
    dx, args = h.new_empty(h.shape), _launch_args(h)
    warps, smem = args.pop("num_warps"), _smem(h.get_device()) if h.is_cuda else 227 * 1024

    def run(config: tuple[int, int, float]) -> tuple[int, Tensor, Tensor]:
        per_sm, stages, more_warps = config
        programs = min(M, per_sm * sms)  # each sums its rows' dw, db: (programs, N) partials, summed below
        dw, db = (h.new_empty(programs if has else 0, N, dtype=_acc(h)) for has in (w is not None, has_bias))
        stages = backward_stages(args["BLOCK"], h.element_size(), 2 + (dh is not None), smem, stages)
        _norm_bwd[(programs,)](dy, dh, h, w, None if rms else mean, rstd, dx, dw if w is not None else None,
                               db if has_bias else None, M, N, -(-M // programs), RMS=rms,
                               HAS_DH=dh is not None, HAS_W=w is not None, HAS_B=has_bias, STAGES=stages,
                               num_warps=min(16, max(1, int(warps * more_warps))), **args)  # fmt: skip
        return programs, dw, db

    key = ("norm_backward", min(pow2(M), 65536), N, h.dtype, rms, dh is not None, w is not None, has_bias)
    config = BACKWARD or fastest(key, backward_configs(args["BLOCK"], warps), run, h.device)
    programs, dw, db = run(config)
    dw_sum, db_sum = (h.new_empty(N if has else 0, dtype=out) for has in (w is not None, has_bias))
    if w is not None or has_bias:
        _sum_partials[(-(-N // 32),)](dw, db, dw_sum, db_sum, programs, N, HAS_W=w is not None,
                                      HAS_B=has_bias, ACC=args["ACC"], BLOCK_P=64, BLOCK_N=32)
    return dx, dw_sum, db_sum


def _grad_dtype(h: Tensor, weight: Tensor | None) -> torch.dtype:
    """dw's and db's dtype: the weight's (a bias of another dtype is cast after)."""
    return weight.dtype if weight is not None else _acc(h)


def _norm_backward_fake(dy, dh, h, weight, mean, rstd, rms, has_bias):
    N, acc = h.size(-1), _grad_dtype(h, weight)
    return h.new_empty(h.shape), h.new_empty(N if weight is not None else 0, dtype=acc), \
        h.new_empty(N if has_bias else 0, dtype=acc)  # fmt: skip


_norm_backward = kernel_op("norm_backward", _norm_backward_launch, _norm_backward_fake)


def _setup(ctx, inputs, output):
    x, residual, weight, bias, _, ctx.rms = inputs
    # mean and rstd never get a gradient: left undefined, not filled with zeros (two more kernels
    # a backward, on ops of tens of microseconds)
    ctx.set_materialize_grads(False)
    ctx.has_r, ctx.bias_dtype = residual is not None, bias.dtype if bias is not None else None
    ctx.save_for_backward(output[1] if ctx.has_r else x, weight, output[2], output[3])


def _backward(ctx, dy, dh, _dmean, _drstd):
    h, weight, mean, rstd = ctx.saved_tensors
    dy = torch.zeros_like(h) if dy is None else dy  # (y unused: only h flowed on)
    has_b = ctx.bias_dtype is not None
    dx, dw, db = _norm_backward(dy, dh if ctx.has_r else None, h, weight, mean, rstd, ctx.rms, has_b)
    # dw comes in the weight's dtype; a bias of another dtype is cast here
    dw, db = dw if weight is not None else None, db.to(ctx.bias_dtype) if has_b else None
    return dx, dx if ctx.has_r else None, dw, db, None, None


_norm = kernel_op("norm", _norm_launch, lambda x, r, weight, bias, eps, rms: _outputs(x, r, rms), _setup,
                  _backward)


def _eps(eps: float | None, x: Tensor) -> float:
    return torch.finfo(x.dtype).eps if eps is None else eps  # nn.RMSNorm's default


def rms_norm(x: Tensor, weight: Tensor | None, eps: float | None = None) -> Tensor:
    return _norm(x, None, weight, None, _eps(eps, x), True)[0]


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    return _norm(x, None, weight, bias, eps, False)[0]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor | None,
                 eps: float | None = None) -> tuple[Tensor, Tensor]:
    """-> (rms_norm(h), h) with h = x + residual."""
    return _norm(x, residual, weight, None, _eps(eps, x), True)[:2]


def add_layer_norm(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None,
                   eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """-> (layer_norm(h), h) with h = x + residual."""
    return _norm(x, residual, weight, bias, eps, False)[:2]


def _up(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.to(torch.promote_types(t.dtype, torch.float32))


def rms_norm_ref(x: Tensor, weight: Tensor | None, eps: float | None = None) -> Tensor:
    """The same math in torch, fp32 (or fp64) inside, the input's dtype out."""
    return F.rms_norm(_up(x), x.shape[-1:], _up(weight), _eps(eps, x)).to(x.dtype)


def layer_norm_ref(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    return F.layer_norm(_up(x), x.shape[-1:], _up(weight), _up(bias), eps).to(x.dtype)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameters and state dict, so a model can swap it in) on the kernel.
    Normalises over the last dim only."""

    def forward(self, x: Tensor) -> Tensor:
        assert len(self.normalized_shape) == 1, "the kernel normalises over the last dim only"
        return rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters and state dict) on the kernel; over the last dim only."""

    def forward(self, x: Tensor) -> Tensor:
        assert len(self.normalized_shape) == 1, "the kernel normalises over the last dim only"
        return layer_norm(x, self.weight, self.bias, self.eps)
