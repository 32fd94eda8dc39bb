"""int8 weight-only linear for decode on CUDA: ``y = (x @ Qᵀ) · s`` in one Triton kernel.

    from ember.kernels.int8 import int8_linear      # torch.ops.ember.int8_linear
    y = int8_linear(x, q, s)     # x (M, K) bf16/fp16/fp32, q (N, K) int8, s (N,) -> (M, N) in x's dtype

Fused: int8 → x-dtype weight conversion, the product (tl.dot on 16-row tiles, fp32 accumulation,
a K loop per BLOCK_N outputs) and the per-row scale, applied once per output. Reads N·K weight
bytes + (M·K + M·N)·2 for 2·M·N·K FLOPs (≤ 32 FLOPs/byte at M ≤ 16): memory-bound. H200, CUDA
graphs, bf16, M=1: head 768→50304 10.5 µs = 77% of 4.8 TB/s (bf16 F.linear 21.9, compiled
``linear(x, Q.to(bf16)) * s`` 81.9); 768→2304 / 768→3072 / 3072→768 / 768→768: 4.0 / 3.1 / 7.5 /
2.9 µs (F.linear 3.5 / 3.5 / 6.3 / 4.0), launch-bound below ~10 MB. ``QuantLinear.forward`` calls
it for int8-weight layers on CUDA with ≤ FAST_ROWS rows (the engine's int8 decode steps).
Inference: the autograd formula gives x's gradient ``(dy · s) @ Q``, none for the int8 buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ember.kernels import INTERPRET, kernel_op  # (sets TRITON_INTERPRET before a kernel is decorated)

# (BLOCK_N, BLOCK_K, warps): few outputs per program so that small N still fills the SMs
_CONFIGS = [(16, 256, 4), (16, 512, 4), (32, 256, 4), (64, 128, 4), (64, 256, 8), (128, 128, 8)]
CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in _CONFIGS]
if INTERPRET:  # the interpreter runs one config, small enough to test ragged edges quickly
    CONFIGS = [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32})]


@triton.autotune(CONFIGS, key=["M", "N", "K"])
@triton.jit
def _int8_linear_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        in_k = kk[None, :] < K
        w = tl.load(q_ptr + rn[:, None] * K + kk[None, :], mask=(rn[:, None] < N) & in_k, other=0)
        x = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & in_k, other=0)
        if FP32_DOT:  # fp32 inputs, and the interpreter (whose bf16 tl.dot is wrong in triton 3.9)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:  # int8 values are exact in bf16/fp16; the tensor cores accumulate in fp32
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    s = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    y = acc * s[None, :]
    out = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=out)


def int8_linear_ref(x: Tensor, q: Tensor, s: Tensor) -> Tensor:
    """The same math in PyTorch: fp32 product of x and the int8 weights, scaled per output."""
    return ((x.float() @ q.float().t()) * s.float()).to(x.dtype)


def _int8_launch(x: Tensor, q: Tensor, s: Tensor) -> Tensor:
    """(x @ q.T) * s for x (M, K), q (N, K) int8, s (N,); (M, N) in x's dtype."""
    x, q, s = x.contiguous(), q.contiguous(), s.float().contiguous()
    (m, k), n = x.shape, q.size(0)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16  # tensor-core tiles even for M = 1: faster on an H200 than a multiply-and-sum
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, block_m))  # noqa: E731
    fp32_dot = INTERPRET or x.dtype == torch.float32
    _int8_linear_kernel[grid](x, q, s, y, m, n, k, BLOCK_M=block_m, FP32_DOT=fp32_dot)
    return y


def _int8_fake(x: Tensor, q: Tensor, s: Tensor) -> Tensor:
    return x.new_empty(x.size(0), q.size(0))


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1], inputs[2])


def _backward(ctx, dy: Tensor):
    q, s = ctx.saved_tensors
    return (dy * s.to(dy.dtype)) @ q.to(dy.dtype), None, None


int8_linear = kernel_op("int8_linear", _int8_launch, _int8_fake, _setup, _backward)
