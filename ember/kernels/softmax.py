"""Row softmax over the last dim, forward and backward: the seeds' exercise and the block that
attention and cross-entropy build on.

    y = softmax(x)                                    # x (..., N), any N (50,304: a vocab row)

A row that fits one block (N <= 8192) is read once and written once; a longer row is read twice:
the first pass keeps a running max and a sum rescaled to it (online softmax), the second writes
exp(x - max) / sum, walking the row from its end, so that it first reads the blocks the first
pass read last, the likeliest to be still in L2 (a 50,304-wide bf16 row is 100 KB; a few hundred
rows in flight fill an H100's 50 MB, so the tuner also picks how many programs walk the rows,
``LONG_CONFIGS``). Backward: dx = y * (dy - sum(dy * y)). fp32 inside (fp64 for fp64), the
input's dtype out. Per call at R x N = 16 x 50,304 fp32 (3.2 MB a tensor, two passes): forward
reads x twice and writes y, 9.7 MB; backward reads y, dy twice and writes dx, 16.1 MB. ~5 FLOPs
(one exp) per element, 0.4 FLOP/byte: memory-bound, floor 9.7 MB / 3.35 TB/s = 2.9 us on an
H100 (a one-block row moves 2 tensors forward, 3 backward). Reference: ``softmax_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ember.kernels import INTERPRET, fastest, kernel_op, pow2, sm_count, triton_ready

_MAX_BLOCK = 8192  # the longest row one program holds in registers; longer rows loop

# A longer row (a vocab row, 50,304 wide) by (columns a block, warps, stages, programs an SM; 0: a
# program a row; L2 hints); stages 0: each pass loads its next block into registers itself
# (AHEAD). The H200 timed the first, the road before, at 47% of the HBM bound forward and
# backward (bf16, 4,096 rows): each block's loads waited for the last block's sums, and a program
# a row kept 2-3 programs an SM going (64 and 40 registers for sm_90), up to 79 MB of rows (the
# backward's y and dy) at a time, more than the 50 MB L2 that the second passes were meant to
# read from. The others keep loads 2-3 blocks ahead (``tl.range``'s stages: cp.async into 8-64 KB
# of shared memory, from ptxas for sm_90, no spills in bf16) and let 1-4 programs an SM walk the
# rows, 132-528 rows at a time on an H100. The fourth lease's pick, (2048, 8, 3, 4), reached 57%:
# its bound counts each tensor once, and with every second pass read from DRAM the bytes are 8
# tensors' for the 5 counted, so its second passes mostly missed L2. With hints the first pass's
# loads ask L2 to keep the row (evict_last) and the second's loads and stores to go first
# (evict_first): the row's second read, not the output nor the row already read twice, holds L2
# (``HINTS``). Triton 3.6 (the leases' image) drops the hint from the staged loops' cp.async
# copies (3.9 keeps it) and keeps it on plain loads and stores, so four hinted configs load one
# block ahead by hand (stages 0: plain 16-byte loads, 40-80 registers, no spills), whose hints
# hold under either. ``ember.kernels.fastest`` times each on the shape at hand and keeps the
# fastest, as it does the norm backward's.
LONG_CONFIGS = [(8192, 16, 1, 0, False), (8192, 16, 3, 0, False), (8192, 16, 3, 1, False),
                (4096, 16, 3, 1, False), (4096, 16, 3, 2, False), (4096, 8, 4, 2, False),
                (2048, 8, 3, 4, False), (8192, 16, 3, 1, True), (4096, 16, 3, 2, True), (4096, 8, 4, 2, True),
                (2048, 8, 3, 4, True), (8192, 16, 0, 1, True), (4096, 16, 0, 2, True), (4096, 8, 0, 2, True),
                (2048, 8, 0, 4, True)]
HINTS, NO_HINTS = {"KEEP": "evict_last", "DROP": "evict_first"}, {"KEEP": "", "DROP": ""}
if INTERPRET:  # one config, two programs (the CPU's "SMs") walking the rows: numpy runs each in turn
    LONG_CONFIGS = [(_MAX_BLOCK, 4, 1, 1, True)]
LONG: tuple[int, int, int, int, bool] | None = None  # a config to run untuned (the road before, tests)
BEFORE = LONG_CONFIGS[0]


@triton.jit
def _softmax_fwd(X, Y, N, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """A row that fits one block: read once, written once."""
    off = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + off + cols, mask=cols < N, other=float("-inf")).to(ACC)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(Y + off + cols, (e / tl.sum(e, axis=0)).to(Y.dtype.element_ty), mask=cols < N)


@triton.jit
def _block(P, off, start, cols, N, other, POLICY: tl.constexpr):
    """The row's block at ``start`` (none past N), with L2 eviction policy ``POLICY``."""
    return tl.load(P + off + start + cols, mask=start + cols < N, other=other, eviction_policy=POLICY)


@triton.jit
def _block_before(P, off, start, cols, N, other, POLICY: tl.constexpr, BLOCK: tl.constexpr):
    """``_block`` at start - BLOCK, none before the row's first (start a multiple of BLOCK: the
    mask's columns stay in runs of 16, and the loads 16 bytes wide)."""
    at = start - BLOCK + cols
    return tl.load(P + off + at, mask=(at >= 0) & (at < N), other=other, eviction_policy=POLICY)


@triton.jit
def _online(m, s, x):
    """Fold block x into the running max m and the sum s of exp(x - m), per lane; a lane that
    saw only -inf keeps s = 0."""
    m_new = tl.maximum(m, x)
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, s * tl.exp(m - safe) + tl.exp(x - safe)


@triton.jit
def _softmax_fwd_long(X, Y, R, N, ACC: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
                      KEEP: tl.constexpr, DROP: tl.constexpr, AHEAD: tl.constexpr):
    """Rows longer than a block, two passes each; a program takes rows pid, pid + programs, ...
    KEEP, DROP: the L2 eviction policies of the first pass's loads and of the second pass's
    loads and stores ("" for the default). AHEAD: each pass loads its next block into registers
    before it works on this one (plain loads, which keep their L2 policy under any Triton),
    instead of ``tl.range``'s stages (cp.async, whose copies Triton 3.6 issues without it)."""
    cols = tl.arange(0, BLOCK)
    blocks = tl.cdiv(N, BLOCK)
    inf = float("-inf")
    for row in range(tl.program_id(0).to(tl.int64), R, tl.num_programs(0)):  # (int64: R x N may pass 2**31)
        off = row * N
        m = tl.full((BLOCK,), inf, ACC)
        s = tl.zeros((BLOCK,), ACC)
        if AHEAD:
            x_next = _block(X, off, 0, cols, N, inf, KEEP)
            for start in range(0, N, BLOCK):
                x = x_next
                x_next = _block(X, off, start + BLOCK, cols, N, inf, KEEP)
                m, s = _online(m, s, x.to(ACC))
        else:
            for start in tl.range(0, N, BLOCK, num_stages=STAGES):
                m, s = _online(m, s, _block(X, off, start, cols, N, inf, KEEP).to(ACC))
        row_max = tl.max(m, axis=0)
        inv = 1.0 / tl.sum(s * tl.exp(m - row_max), axis=0)
        # backwards: the last blocks read, likeliest in L2
        if AHEAD:
            x_next = _block(X, off, (blocks - 1) * BLOCK, cols, N, inf, DROP)
        for i in tl.range(0, blocks, num_stages=STAGES):
            start = (blocks - 1 - i) * BLOCK
            if AHEAD:
                x = x_next
                x_next = _block_before(X, off, start, cols, N, inf, DROP, BLOCK)
            else:
                x = _block(X, off, start, cols, N, inf, DROP)
            tl.store(Y + off + start + cols, (tl.exp(x.to(ACC) - row_max) * inv).to(Y.dtype.element_ty),
                     mask=start + cols < N, eviction_policy=DROP)


@triton.jit
def _softmax_bwd(Y, DY, DX, N, ACC: tl.constexpr, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    y = tl.load(Y + off + cols, mask=cols < N, other=0.0).to(ACC)
    dy = tl.load(DY + off + cols, mask=cols < N, other=0.0).to(ACC)
    dx = y * (dy - tl.sum(y * dy, axis=0))
    tl.store(DX + off + cols, dx.to(DX.dtype.element_ty), mask=cols < N)


@triton.jit
def _softmax_bwd_long(Y, DY, DX, R, N, ACC: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
                      KEEP: tl.constexpr, DROP: tl.constexpr, AHEAD: tl.constexpr):
    """dx = y * (dy - sum(y * dy)) over rows longer than a block: the sum, then dx backwards (as
    the forward's second pass); KEEP, DROP, AHEAD as ``_softmax_fwd_long``'s."""
    cols = tl.arange(0, BLOCK)
    blocks = tl.cdiv(N, BLOCK)
    for row in range(tl.program_id(0).to(tl.int64), R, tl.num_programs(0)):  # (int64: R x N may pass 2**31)
        off = row * N
        acc = tl.zeros((BLOCK,), ACC)
        if AHEAD:
            y_next, dy_next = _block(Y, off, 0, cols, N, 0.0, KEEP), _block(DY, off, 0, cols, N, 0.0, KEEP)
            for start in range(0, N, BLOCK):
                y, dy = y_next, dy_next
                y_next = _block(Y, off, start + BLOCK, cols, N, 0.0, KEEP)
                dy_next = _block(DY, off, start + BLOCK, cols, N, 0.0, KEEP)
                acc += y.to(ACC) * dy.to(ACC)
        else:
            for start in tl.range(0, N, BLOCK, num_stages=STAGES):
                y, dy = _block(Y, off, start, cols, N, 0.0, KEEP), _block(DY, off, start, cols, N, 0.0, KEEP)
                acc += y.to(ACC) * dy.to(ACC)
        dot = tl.sum(acc, axis=0)
        if AHEAD:
            last = (blocks - 1) * BLOCK
            y_next = _block(Y, off, last, cols, N, 0.0, DROP)
            dy_next = _block(DY, off, last, cols, N, 0.0, DROP)
        for i in tl.range(0, blocks, num_stages=STAGES):
            start = (blocks - 1 - i) * BLOCK
            if AHEAD:
                y, dy = y_next, dy_next
                y_next = _block_before(Y, off, start, cols, N, 0.0, DROP, BLOCK)
                dy_next = _block_before(DY, off, start, cols, N, 0.0, DROP, BLOCK)
            else:
                y, dy = _block(Y, off, start, cols, N, 0.0, DROP), _block(DY, off, start, cols, N, 0.0, DROP)
            dx = y.to(ACC) * (dy.to(ACC) - dot)
            tl.store(DX + off + start + cols, dx.to(DX.dtype.element_ty), mask=start + cols < N,
                     eviction_policy=DROP)


def _launch(one, long, *tensors: Tensor) -> Tensor:
    """Run ``one`` (a row in a block) or ``long`` over the rows of ``tensors`` (all shaped like the
    first); -> the output."""
    ok, why = triton_ready(tensors[0].device)
    if not ok:
        raise RuntimeError(why)
    flat, N = tensors[0].dim() == 2, tensors[0].size(-1)
    # (R, N); a 2-D input is not reshaped and its output not viewed back: each costs ~5 us of host
    rows = [t.contiguous() if flat else t.reshape(-1, N).contiguous() for t in tensors]
    out = torch.empty_like(rows[0])
    R, acc = out.size(0), tl.float64 if out.dtype == torch.float64 else tl.float32
    if N <= _MAX_BLOCK:
        block = pow2(N)
        one[(R,)](*rows, out, N, ACC=acc, BLOCK=block, num_warps=min(16, max(4, block // 512)))
    else:
        sms = sm_count(out.get_device()) if out.is_cuda else 2

        def run(config: tuple[int, int, int, int, bool]) -> None:
            block, warps, stages, per_sm, hints = config
            grid = (min(R, sms * per_sm) if per_sm else R,)
            long[grid](*rows, out, R, N, ACC=acc, BLOCK=block, STAGES=max(stages, 1), AHEAD=stages == 0,
                       num_warps=warps, **(HINTS if hints else NO_HINTS))  # fmt: skip
            # (stages 0: each pass a block ahead in registers, AHEAD; its loops are not staged)

        # timed once for N and the rows to a power of two (up to 4,096), so that a new row count
        # does not time every config again; a shape first met inside a CUDA graph's capture runs
        # the road before untimed (ember.kernels.fastest)
        key = (long.__name__, min(pow2(R), 4096), N, out.dtype)
        run(LONG or fastest(key, LONG_CONFIGS, run, out.device))
    return out if flat else out.view(tensors[0].shape)


def _softmax_launch(x: Tensor) -> Tensor:
    return _launch(_softmax_fwd, _softmax_fwd_long, x)


def _softmax_backward_launch(y: Tensor, dy: Tensor) -> Tensor:
    return _launch(_softmax_bwd, _softmax_bwd_long, y, dy)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output)


_softmax_backward = kernel_op("softmax_backward", _softmax_backward_launch, lambda y, _: y.new_empty(y.shape))
_softmax = kernel_op("softmax", _softmax_launch, lambda x: x.new_empty(x.shape), _setup,
                     lambda ctx, dy: _softmax_backward(ctx.saved_tensors[0], dy))


def softmax(x: Tensor) -> Tensor:
    """Softmax over the last dim of x (..., N) -> (..., N), x's dtype."""
    return _softmax(x)


def softmax_ref(x: Tensor) -> Tensor:
    """The same math in torch: fp32 (or fp64) inside, x's dtype out."""
    return torch.softmax(x.to(torch.promote_types(x.dtype, torch.float32)), dim=-1).to(x.dtype)
