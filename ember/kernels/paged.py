"""Paged attention: each query token attends to its sequence's keys through the sequence's block
table, in the pool where they lie (Kwon et al. 2023, vLLM's PagedAttention).

    o = paged_attention(q, k_pool, v_pool, tables, q_pos, tiles, block_size)
    # q (T, H, hd); pools (slots, Hkv, hd); tables (R, W) block ids; q_pos (T,) positions;
    # tiles (3, n): each tile's sequence, first token and token count (0: none) -> o (T, H, hd)

The serving cache's third road (``serve.paged_attention=triton``, ``TritonPagedKVCache`` in
ember/infer/paged.py), beside ``gather`` (copy each sequence's keys out, then SDPA) and ``flex``
(FlexAttention over the whole pool with a block mask). One program per (tile, head), as vLLM's
unified Triton attention: a tile is up to ``BLOCK_M`` consecutive tokens of one sequence (a
prompt chunk is cut into tiles; a decoding sequence's one token is a tile of its own), whose
queries read each tile of ``BLOCK_N`` keys once, through the table (the slot of logical position
j is ``tables[seq, j // block_size] * block_size + j % block_size``), with ``tl.dot`` products
and an online softmax in fp32, causal by position. Token rows that no tile covers (the pads of a
CUDA graph's fixed shape) stay zero. The grid and every bound are read from memory, so one launch
shape serves every step of a bucket and replays from a CUDA graph.

Bytes: a tile reads its sequence's keys and values once per query head (the heads of a group
share them through the cache), 2·L·hd·2 bytes at L held positions in bf16, for up to 16 queries:
decode is memory-bound, as every decode attention; a long prompt chunk costs 1/16 of what one
program per token would read. Reference: ``paged_ref``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ember.kernels import INTERPRET, kernel_op
from ember.kernels.invariant import dot

BLOCK_M = 16  # query tokens a tile (tl.dot's least rows)


@triton.jit
def _paged_kernel(Q, K, V, TABLES, QPOS, TILES, O, sqt, sqh, sks, skh, st, n_tiles, scale,
                  BS: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr, HD: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Tile i, head h: its queries' softmax over positions 0..pos of their sequence."""
    i, h = tl.program_id(0), tl.program_id(1)
    seq, first = tl.load(TILES + i), tl.load(TILES + n_tiles + i).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    live = rows < tl.load(TILES + 2 * n_tiles + i)  # a count of 0: no tile here
    tok = first + rows
    pos = tl.load(QPOS + tok, mask=live, other=-1)  # (BLOCK_M,): -1 reads nothing
    last = tl.max(pos, axis=0)
    e = tl.arange(0, HD)
    q = tl.load(Q + tok[:, None] * sqt + h * sqh + e[None, :], mask=live[:, None], other=0.0)
    table = TABLES + tl.maximum(seq, 0).to(tl.int64) * st
    kv = (h // GROUP) * skh
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # each query's running max
    total = tl.zeros((BLOCK_M,), tl.float32)  # its sum of exp(score - max)
    acc = tl.zeros((BLOCK_M, HD), tl.float32)
    for j0 in range(0, last + 1, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        held = j <= last
        block = tl.load(table + j // BS, mask=held, other=0).to(tl.int64)
        at = (block * BS + j % BS)[:, None] * sks + kv + e[None, :]
        k = tl.load(K + at, mask=held[:, None], other=0.0)
        v = tl.load(V + at, mask=held[:, None], other=0.0)
        scores = dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), Q.dtype.element_ty, PREC,
                     UPCAST) * scale  # (BLOCK_M, BLOCK_N), fp32
        scores = tl.where(j[None, :] <= pos[:, None], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        top = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet: no NaN
        p = tl.exp(scores - top[:, None])
        shrink = tl.exp(m - top)
        total = total * shrink + tl.sum(p, axis=1)
        acc = acc * shrink[:, None] + dot(p, v, tl.zeros((BLOCK_M, HD), tl.float32), Q.dtype.element_ty, PREC,
                                          UPCAST)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    at = tok[:, None] * (H * HD) + h * HD + e[None, :]
    tl.store(O + at, out.to(O.dtype.element_ty), mask=live[:, None])


def _paged_launch(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, q_pos: Tensor, tiles: Tensor,
                  block_size: int) -> Tensor:
    """q (T, H, hd), pools (slots, Hkv, hd), tables (R, W), q_pos (T,), tiles (3, n) -> o (T, H, hd)."""
    (T, H, hd), Hkv, n = q.shape, k_pool.size(1), tiles.size(1)
    q = q if q.stride(-1) == 1 else q.contiguous()
    o = q.new_zeros(T, H, hd)
    _paged_kernel[(n, H)](q, k_pool, v_pool, tables, q_pos, tiles, o, q.stride(0), q.stride(1),
                          k_pool.stride(0), k_pool.stride(1), tables.stride(0), n, 1 / math.sqrt(hd),
                          BS=block_size, H=H, GROUP=H // Hkv, HD=hd, BLOCK_M=BLOCK_M, BLOCK_N=32,
                          PREC="ieee" if q.dtype == torch.float32 else "tf32",  # fp32: greedy parity
                          UPCAST=INTERPRET)  # fmt: skip
    return o


paged_attention = kernel_op("paged_attention", _paged_launch, lambda q, *_: torch.empty_like(q))


def tiles_for(counts: list[int], size: int) -> Tensor:
    """The tiles (3, size) of a packed row whose sequences feed ``counts`` tokens each, in order:
    each sequence's tokens cut into runs of at most ``BLOCK_M``; the rest of the ``size`` columns
    count 0 tokens. (numpy: a serving step's host work.)"""
    counts = np.asarray(counts, dtype=np.int64)
    k = -(-counts // BLOCK_M)  # tiles a sequence
    seq = np.repeat(np.arange(len(counts)), k)
    j = np.arange(int(k.sum())) - np.repeat(k.cumsum() - k, k)  # the tile's index in its sequence
    assert len(seq) <= size, f"{len(seq)} tiles do not fit {size}"
    tiles = np.zeros((3, size), np.int64)
    tiles[0, : len(seq)], tiles[1, : len(seq)] = seq, (counts.cumsum() - counts)[seq] + j * BLOCK_M
    tiles[2, : len(seq)] = np.minimum(BLOCK_M, counts[seq] - j * BLOCK_M)
    return torch.from_numpy(tiles)


def paged_ref(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, q_pos: Tensor, tiles: Tensor,
              block_size: int) -> Tensor:
    """The same token by token in PyTorch: gather the sequence's slots, then SDPA over them."""
    T, H, hd = q.shape
    out = torch.zeros_like(q)
    for seq, first, count in tiles.t().tolist():
        for t in range(first, first + count):
            j = torch.arange(int(q_pos[t]) + 1, device=q.device)
            slots = tables[seq, j // block_size].long() * block_size + j % block_size
            k = k_pool[slots].transpose(0, 1).float()  # (Hkv, L, hd)
            v = v_pool[slots].transpose(0, 1).float()
            group = H // k.size(0)
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            out[t] = F.scaled_dot_product_attention(q[t, :, None].float(), k, v)[:, 0].to(q.dtype)
    return out
