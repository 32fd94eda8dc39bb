"""Paged attention: each query token attends to its sequence's keys through the sequence's block
table, in the pool where they lie (Kwon et al. 2023, vLLM's PagedAttention).

    o = paged_attention(q, k_pool, v_pool, tables, q_seq, q_pos, block_size)
    # q (T, H, hd); pools (slots, Hkv, hd); tables (R, W) block ids; q_seq, q_pos (T,) -> o (T, H, hd)

The serving cache's third road (``serve.paged_attention=triton``, ``TritonPagedKVCache`` in
ember/infer/paged.py), beside ``gather`` (copy each sequence's keys out, then SDPA) and ``flex``
(FlexAttention over the whole pool with a block mask). One program per (token, head): token t of
sequence ``q_seq[t]`` at position ``q_pos[t]`` reads logical positions 0..q_pos[t], each at slot
``tables[seq, j // block_size] * block_size + j % block_size``, with an online softmax in fp32.
Prompt chunks and decodes go in the same launch, causal by position; a token with ``q_seq`` < 0
(a pad of a CUDA graph's fixed shape) reads nothing and gives zeros. The grid is the token count
by the heads and every bound is read from memory, so one launch shape serves every step of a
bucket and replays from a CUDA graph. Bytes: a decode token reads its sequence's keys and values
once per query head (the group's heads share them through the cache), ~2·L·hd·2 bytes per head
at L held positions in bf16: memory-bound, as every decode attention. Reference: ``paged_ref``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ember.kernels import kernel_op


@triton.jit
def _paged_kernel(Q, K, V, TABLES, QSEQ, QPOS, O, sqt, sqh, sks, skh, st, scale, BS: tl.constexpr,
                  GROUP: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Token t, head h: softmax over positions 0..pos of its sequence, read through its table."""
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    e = tl.arange(0, HD)
    seq = tl.load(QSEQ + t)
    last = tl.where(seq >= 0, tl.load(QPOS + t), -1)  # a pad reads nothing
    q = tl.load(Q + t * sqt + h * sqh + e).to(tl.float32) * scale
    kv = (h // GROUP) * skh
    table = TABLES + tl.maximum(seq, 0).to(tl.int64) * st
    m = tl.max(tl.full((BLOCK_N,), float("-inf"), tl.float32), axis=0)  # the running max, a scalar
    total = tl.sum(tl.zeros((BLOCK_N,), tl.float32), axis=0)  # its sum of exp(score - m)
    acc = tl.zeros((HD,), tl.float32)
    for j0 in range(0, last + 1, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        held = j <= last
        block = tl.load(table + j // BS, mask=held, other=0).to(tl.int64)
        at = (block * BS + j % BS)[:, None] * sks + kv + e[None, :]
        k = tl.load(K + at, mask=held[:, None], other=0.0).to(tl.float32)
        scores = tl.where(held, tl.sum(k * q[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))  # finite: position j0 <= last is held
        p = tl.exp(scores - m_new)
        shrink = tl.exp(m - m_new)
        v = tl.load(V + at, mask=held[:, None], other=0.0).to(tl.float32)
        acc = acc * shrink + tl.sum(p[:, None] * v, axis=0)
        total = total * shrink + tl.sum(p, axis=0)
        m = m_new
    out = tl.where(total > 0, acc / tl.maximum(total, 1e-30), 0.0)
    tl.store(O + (t * tl.num_programs(1) + h) * HD + e, out.to(O.dtype.element_ty))


def _paged_launch(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, q_seq: Tensor, q_pos: Tensor,
                  block_size: int) -> Tensor:
    """q (T, H, hd), pools (slots, Hkv, hd), tables (R, W), q_seq and q_pos (T,) -> o (T, H, hd)."""
    (T, H, hd), Hkv = q.shape, k_pool.size(1)
    q = q if q.stride(-1) == 1 else q.contiguous()
    o = q.new_empty(T, H, hd)
    _paged_kernel[(T, H)](q, k_pool, v_pool, tables, q_seq, q_pos, o, q.stride(0), q.stride(1),
                          k_pool.stride(0), k_pool.stride(1), tables.stride(0), 1 / math.sqrt(hd),
                          BS=block_size, GROUP=H // Hkv, HD=hd, BLOCK_N=64)  # fmt: skip
    return o


paged_attention = kernel_op("paged_attention", _paged_launch, lambda q, *_: torch.empty_like(q))


def paged_ref(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, q_seq: Tensor, q_pos: Tensor,
              block_size: int) -> Tensor:
    """The same token by token in PyTorch: gather the sequence's slots, then SDPA over them."""
    T, H, hd = q.shape
    out = torch.zeros_like(q)
    for t in range(T):
        seq, pos = int(q_seq[t]), int(q_pos[t])
        if seq < 0:
            continue
        j = torch.arange(pos + 1, device=q.device)
        slots = tables[seq, j // block_size].long() * block_size + j % block_size
        k = k_pool[slots].transpose(0, 1).float()  # (Hkv, L, hd)
        v = v_pool[slots].transpose(0, 1).float()
        group = H // k.size(0)
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        out[t] = F.scaled_dot_product_attention(q[t, :, None].float(), k, v)[:, 0].to(q.dtype)
    return out
