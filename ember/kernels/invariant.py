"""Batch-invariant products: a row's result the same bits whatever other rows share its batch.

    from ember.kernels.invariant import batch_invariant, matmul
    y = matmul(a, b, bias)          # a (M, K) @ b (K, N) (+ bias (N,)), fp32 sums in one fixed order
    with batch_invariant():         # every aten mm / addmm in the block runs through ``matmul``
        logits = model(ids, cache=cache)

Why: a served request's greedy tokens should not depend on who else is being served. Each
token's logits are sums, and floating-point sums depend on their order; cuBLAS (or MKL) picks
its kernel, tiling and split of K by the product's shape, so the row of a 1-token decode and
the same row inside a 64-row step sum in different orders and can differ in the last bits,
enough to flip a greedy choice where two logits nearly tie (He et al. 2025, "Defeating
nondeterminism in LLM inference"; vLLM's and SGLang's batch-invariant modes). Here one Triton
kernel computes every output from its own row of ``a`` and column of ``b``, K walked in
BLOCK_K steps from 0 up, fp32 (or fp64) accumulation, never split: each row's bits depend on
that row alone (its tile's size only says how many outputs a program makes). Its rows of pads
(masked loads: zeros) change nothing either. Norms, GELU and embeddings are per row already;
attention's sums are the paged kernel's (ember.kernels.paged), whose order does not depend on
the batch. Hand-written because that is the point: a library GEMM makes no promise about its
order. Not a ``torch.library`` op as the other kernels here are: it runs at inference only, below
autograd, called by the dispatch mode, so there is no formula or fake to register; its reference
is PyTorch's own product (tests/test_invariant.py).

Cost: fp32 products on CUDA run on the FMA units (``ieee``, never TF32), as cuBLAS's fp32
GEMM does, for 16 rows at least (tl.dot's least tile): a batch-1 step does 16 rows' FMAs.
``batch_invariant`` is a ``TorchDispatchMode``: every op in its block passes through Python (a
few µs each), which a CUDA graph's replay does not pay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ember.errors import EmberError
from ember.kernels import INTERPRET  # (sets TRITON_INTERPRET before a kernel is decorated)

BLOCK_K = 32  # the one step of the sums: any BLOCK_M and BLOCK_N sum an output in the same order
# (BLOCK_M, BLOCK_N) by rows: small tiles fill the SMs at decode's few rows. Each output is one
# chain of fp32 FMAs (fp32) or mma.sync m16n8k16s (bf16) over k from 0 up at either size, as their
# sm_90 PTX shows; 64 rows would make a bf16 product wgmma's, whose chain is another, so neither
# tile reaches 64 (tests/test_kernels_ptx.py checks the instructions)
SMALL, LARGE, ROWS = (16, 32), (32, 64), 64
aten = torch.ops.aten
WHOLE = (aten.matmul.default, aten.einsum.default, aten.tensordot.default)  # composites: into their parts
REFUSED = (aten.bmm.default, aten.baddbmm.default, aten.mv.default, aten.addmv.default, aten.dot.default,
           aten.vdot.default)  # float products with no fixed-order kernel here
PRECISION = {torch.float32: "ieee", torch.float64: "ieee", torch.bfloat16: "tf32", torch.float16: "tf32"}


@triton.jit
def dot(a, b, acc, IN: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b, a and b rounded to IN, fp32 (fp64) sums; each row's the same wherever it sits.
    On a GPU tl.dot's FMA chains (fp32) and tensor-core tiles are per element. Under the interpreter
    (UPCAST) tl.dot is numpy's matmul, whose OpenBLAS kernel sums a row in an order that depends on
    where the row sits in its tile, so there the products are summed over k as broadcasts."""
    a = a.to(IN)
    b = b.to(IN)
    if UPCAST:
        return acc + tl.sum(a.to(acc.dtype)[:, :, None] * b.to(acc.dtype)[None, :, :], axis=1)
    return tl.dot(a, b, acc, input_precision=PREC, out_dtype=acc.dtype)


@triton.jit
def _matmul_kernel(A, B, BIAS, C, M, N, K, sam, sak, sbk, sbn, scm, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   ACC: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """C[m, n] = sum over k from 0 up, BLOCK_K at a time, of A[m, k] B[k, n] (+ BIAS[n])."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        in_a, in_b = (rm[:, None] < M) & (kk[None, :] < K), (kk[:, None] < K) & (rn[None, :] < N)
        a = tl.load(A + rm[:, None] * sam + kk[None, :] * sak, mask=in_a, other=0.0)
        b = tl.load(B + kk[:, None] * sbk + rn[None, :] * sbn, mask=in_b, other=0.0)
        acc = dot(a, b, acc, A.dtype.element_ty, PREC, UPCAST)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(ACC)[None, :]
    at = rm[:, None] * scm + rn[None, :]
    tl.store(C + at, acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """a (M, K) @ b (K, N) + bias (N,) in a's dtype, each row of the result a function of that
    row of ``a`` alone (module docstring). Any strides (``b`` is usually a weight's transpose)."""
    (M, K), N = a.shape, b.size(1)
    c = a.new_empty(M, N)
    if M == 0 or N == 0:
        return c
    BLOCK_M, BLOCK_N = SMALL if M <= ROWS else LARGE
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    fp64 = a.dtype == torch.float64
    _matmul_kernel[grid](a, b, bias if bias is not None else a, c, M, N, K, a.stride(0), a.stride(1),
                         b.stride(0), b.stride(1), c.stride(0), HAS_BIAS=bias is not None,
                         BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                         ACC=tl.float64 if fp64 else tl.float32, PREC=PRECISION[a.dtype],
                         UPCAST=INTERPRET)  # fmt: skip
    return c


def _fits(*tensors: Tensor) -> bool:
    """Plain dense tensors of one floating dtype the kernel takes, on one device."""
    a = tensors[0]
    return a.dtype in PRECISION and all(
        type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
        and t.dtype == a.dtype and t.device == a.device
        for t in tensors
    )


class batch_invariant(TorchDispatchMode):  # noqa: N801 (used as a context manager, like no_grad)
    """Within the block every ``aten.mm``, ``aten.addmm`` and ``aten.linear`` (what
    ``nn.Linear`` runs as: whole under inference mode, else as a view and an addmm) is
    ``matmul``, and ``@``, einsum and tensordot are decomposed into their parts; other ops run
    as they would. Products the kernel does not take (integer or mixed dtypes, sparse or
    subclassed tensors) run as they would too, not batch-invariant; float ``bmm``, ``baddbmm``,
    ``mv``, ``addmv``, ``dot`` and ``vdot`` are refused. Under
    ``torch.compile`` the mode is not seen: ember refuses the two together. Tensors made inside
    the block are ordinary; the mode holds no state, so it nests and can be entered once per step
    (a CUDA graph captured inside it replays the kernel's launches)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.mm.default and _fits(*args):
            return matmul(*args)
        if func is torch.ops.aten.addmm.default and _fits(*args):
            bias, a, b = args
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            if bias.dim() == 1 and bias.size(0) == b.size(1) and bias.stride(0) == 1 and beta == alpha == 1:
                return matmul(a, b, bias)
            if beta == 0:  # as aten's: the bias unread (a NaN in it stays out)
                return alpha * matmul(a, b)
            return beta * bias + alpha * matmul(a, b)  # (elementwise: per row already)
        if func is torch.ops.aten.linear.default and _fits(*(t for t in args if t is not None)):
            x, w, *bias = args
            y = matmul(x.reshape(-1, x.size(-1)), w.t(), *(b.contiguous() for b in bias if b is not None))
            return y.view(*x.shape[:-1], w.size(0))
        if func in WHOLE:  # ``@``, einsum (whole under inference mode): decomposed, their parts seen here
            with self:
                return func.decompose(*args, **kwargs)
        if func in REFUSED and _fits(*(t for t in args if isinstance(t, torch.Tensor))):
            raise EmberError(
                f"batch_invariant: {func} has no fixed-order kernel in ember (ember/kernels/invariant.py "
                "takes mm, addmm, linear and matmul into them); serve this model without batch invariance"
            )
        return func(*args, **kwargs)
