"""A whole batch-1 decode step in one persistent kernel: every block's products and attention,
the embedding and the head, as tasks that a grid of one program an SM walks in order.

    FusedDecode(model, persistent=True)(idx, cache)    # ember.infer.fused: decode_step(...) below

Why: a step of five launches a block (``decode.py``) pays each kernel's start and drain. On an
H200 that was 5.5 µs a product whose bytes take 0.3-1.3 µs, and it caps a kernel-per-op step of
gpt2-small at 16-23% of the HBM bound (benchmarks/RESULTS.md, "Decode's floor"). Hazy Research's
"megakernel" (2025) ran Llama-1B's whole step in one launch for the same reason. Here one launch
holds the step, in stages: [embedding], then per block [norm + q|k|v tiles], [attention, a task a
(row, head)], [o tiles + residual], [norm + up (+ gate) tiles + activation], [down tiles +
residual], then [final norm + head tiles]. Each task is one of ``decode.py``'s tiles, by the same
helpers (``linear_tile``, ``attend_head``), so the numbers are the five-launch step's.

Order without a grid barrier: tasks are numbered stage by stage, and program p takes tasks p,
p + G, p + 2G, ... (G programs, all resident: one an SM). A task first reads what no task of the
step writes (its first tile of weights, or its first tile of held keys), then waits until the
stage before it has counted all its tasks done (an acquire on that stage's counter, skipped
once the program has seen it), computes, and counts itself done (a release). The lowest
unfinished task never waits on anything unfinished, so the walk cannot deadlock while every
program is resident. Under Triton's interpreter programs run one after another, so there G is 1.
The last head task to finish advances the cache's position.

Residual adds are in place on the step's X: a tile reads and writes its own columns, after every
reader of the whole row (the stage before) has finished. Inference only, B <= 16 rows (tl.dot's
tile; one row on the CUDA cores).

Unlike the other files here, ``decode_step`` is not a ``torch.library`` op and has no reference
function beside it: it writes the caches through pointers no schema can name, it is replayed
from a CUDA graph rather than traced, and its reference is the model's own step, which
tests/test_persistent_decode.py holds it to (as tests/test_fused_decode.py does the five-launch
step built from the same tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ember.kernels import INTERPRET, pow2, sm_count
from ember.kernels.decode import attend_head, embed_row, linear_tile

# A block's pointers in TABLE's row: weights and biases of q|k|v, o, up (gate|up), down; the
# two norms' weights and biases; the layer's key and value caches.
COLUMNS = ("qkv", "qkv_b", "wo", "wo_b", "up", "up_b", "w2", "w2_b", "g1", "b1", "g2", "b2", "kc", "vc")


@triton.jit
def _at(TABLE, layer, column, LIKE):
    """The pointer in TABLE[layer, column], typed as the pointer ``LIKE`` and known to be 16-byte
    aligned (the table's maker checks it): a pointer loaded from memory carries no alignment, so
    without the hint every weight and cache load was scalar, 2 bytes an instruction in bf16 (617
    such loads for sm_90 at one row of gpt2-small, 9 with it)."""
    return tl.multiple_of(tl.load(TABLE + layer * 14 + column).to(LIKE.dtype), 16)


@triton.jit
def _step_kernel(IDX, WTE, WPE, POS, PAD, COS, SIN, TABLE, GF, BF, HEAD, HEAD_B, X, QKV, O, HID, LOGITS, SYNC,
                 B, C, F, V, L, eps, eps_f, spad, skb, skh, sks, scale,
                 H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, NORM: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_BETA: tl.constexpr, ACT: tl.constexpr, HAS_WPE: tl.constexpr,
                 ROPE: tl.constexpr, HEAD_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                 DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_C: tl.constexpr):  # fmt: skip
    """The step's tasks t = program_id, + programs, ... (module docstring). Stage 0 is the
    embedding (one task), stage 1 + 5l + k - 1 is block l's kind k (1 q|k|v, 2 attention, 3 o,
    4 up, 5 down), stage 1 + 5L the head; SYNC[s] counts stage s's tasks done."""
    n1 = tl.cdiv((H + 2 * HKV) * HD, BLOCK_N)
    n2 = B * H
    n3 = tl.cdiv(C, BLOCK_N)
    n4 = tl.cdiv(F, BLOCK_N)
    c1, c2, c3, c4 = n1, n1 + n2, n1 + n2 + n3, n1 + n2 + n3 + n4
    per_layer = c4 + n3  # the down product: C outputs, as o's
    n_head = tl.cdiv(V, BLOCK_N)
    known = 0  # the stages below this one are all done, as this program has seen
    for t in range(tl.program_id(0), 1 + L * per_layer + n_head, tl.num_programs(0)):
        u = tl.maximum(t - 1, 0)
        layer = u // per_layer
        r = u - layer * per_layer
        kind = 1 + (r >= c1).to(tl.int32) + (r >= c2).to(tl.int32) + (r >= c3).to(tl.int32)
        kind += (r >= c4).to(tl.int32)
        tile = r - tl.where(kind == 2, c1, tl.where(kind == 3, c2, tl.where(kind == 4, c3, 0)))
        tile -= tl.where(kind == 5, c4, 0)
        kind = tl.where(layer >= L, 6, kind)  # the head, after the last block
        tile = tl.where(kind == 6, u - L * per_layer, tile)
        kind = tl.where(t == 0, 0, kind)
        stage = tl.where(kind == 0, 0, tl.where(kind == 6, 1 + 5 * L, 1 + 5 * layer + kind - 1))
        # the stage before's task count: the embedding's 1, else the kind before's (the down's for a q|k|v)
        before = tl.where(kind == 2, n1, tl.where(kind == 3, n2, tl.where(kind == 5, n4, n3)))
        before = tl.where(stage == 1, 1, before)
        need = tl.where(stage <= known, 0, before)
        if kind == 0:
            for b in range(0, B):
                embed_row(IDX, WTE, WPE, POS, PAD, X, C, spad, b, HAS_WPE, BLOCK_C)
        elif kind == 1:
            linear_tile(X, _at(TABLE, layer, 0, WTE), _at(TABLE, layer, 1, WTE), _at(TABLE, layer, 8, WTE),
                         _at(TABLE, layer, 9, WTE), None, QKV, B, (H + 2 * HKV) * HD, C, eps, tile, 0, SYNC,
                         stage, need, NORM, HAS_BIAS, HAS_BETA, 0, False, FP32_DOT, True, 2, BLOCK_M, DOT,
                         BLOCK_N, BLOCK_K)
        elif kind == 2:
            attend_head(QKV, _at(TABLE, layer, 12, X), _at(TABLE, layer, 13, X), POS, PAD, COS, SIN, O, spad,
                    skb, skh, sks, scale, (tile // H).to(tl.int64), tile % H, SYNC, stage, need, H, HKV, HD,
                    ROPE, True, 2, BLOCK_S)
        elif kind == 3:
            linear_tile(O, _at(TABLE, layer, 2, WTE), _at(TABLE, layer, 3, WTE), None, None, X, X, B, C, C,
                         0.0, tile, 0, SYNC, stage, need, 0, HAS_BIAS, False, 0, True, FP32_DOT, True, 2,
                         BLOCK_M, DOT, BLOCK_N, BLOCK_K)
        elif kind == 4:
            linear_tile(X, _at(TABLE, layer, 4, WTE), _at(TABLE, layer, 5, WTE), _at(TABLE, layer, 10, WTE),
                         _at(TABLE, layer, 11, WTE), None, HID, B, F, C, eps, tile, 0, SYNC, stage, need,
                         NORM, HAS_BIAS, HAS_BETA, ACT, False, FP32_DOT, True, 2, BLOCK_M, DOT, BLOCK_N,
                         BLOCK_K)
        elif kind == 5:
            linear_tile(HID, _at(TABLE, layer, 6, WTE), _at(TABLE, layer, 7, WTE), None, None, X, X, B, C, F,
                         0.0, tile, 0, SYNC, stage, need, 0, HAS_BIAS, False, 0, True, FP32_DOT, True, 2,
                         BLOCK_M, DOT, BLOCK_N, BLOCK_K)
        else:
            linear_tile(X, HEAD, HEAD_B, GF, BF, None, LOGITS, B, V, C, eps_f, tile, 0, SYNC, stage, need,
                         NORM, HEAD_BIAS, HAS_BETA, 0, False, FP32_DOT, True, 2, BLOCK_M, DOT, BLOCK_N,
                         BLOCK_K)
        known = tl.maximum(known, stage)
        tl.debug_barrier()  # every thread's stores before the count that publishes them
        done = tl.atomic_add(SYNC + stage, 1, sem="release")
        if (kind == 6) & (done == n_head - 1):  # the step's last task: the next step's position
            tl.store(POS, tl.load(POS) + 1)


def _step_launch(idx: Tensor, wte: Tensor, wpe: Tensor | None, pos: Tensor, pad: Tensor, cos: Tensor | None,
                 sin: Tensor | None, table: Tensor, gf: Tensor, bf: Tensor | None, head: Tensor,
                 head_b: Tensor | None, x: Tensor, qkv: Tensor, o: Tensor, hid: Tensor, logits: Tensor,
                 sync: Tensor, k_cache: Tensor, eps: float, eps_f: float, n_head: int, n_kv_head: int,
                 norm: int, act: int, has_bias: bool, has_beta: bool, dot: bool, block_n: int, block_k: int,
                 programs: int) -> None:
    """One step into ``logits`` (B, V) fp32, the caches written at pos, pos advanced. ``table``
    (L, 14) int64: each block's pointers (``COLUMNS``); ``k_cache`` one layer's (B, Hkv, S, hd),
    for the caches' strides; x, qkv, o, hid the step's activations; ``sync`` (2 + 5L,) int32,
    zeroed here. ``programs``: the grid (0: one an SM; never more)."""
    B, C = x.shape
    L, F, V = table.size(0), hid.size(1), logits.size(1)
    assert table.shape[1] == len(COLUMNS) == 14, table.shape  # (_at reads rows of 14)
    S, hd = k_cache.size(2), k_cache.size(3)
    sync.zero_()  # (the counters; a memset node in a CUDA graph)
    # at most one program an SM, all resident at once, or a wait could spin on a task no SM runs;
    # the interpreter runs one program after another, so there one program walks every task
    grid = 1 if INTERPRET else min(programs or 2**31, sm_count(x.get_device()))
    _step_kernel[(grid,)](
        idx, wte, wpe, pos, pad, cos, sin, table, gf, bf, head, head_b, x, qkv, o, hid, logits, sync,
        B, C, F, V, L, eps, eps_f, 1 if pad.numel() > 1 else 0, *k_cache.stride()[:3], hd**-0.5,
        H=n_head, HKV=n_kv_head, HD=hd, NORM=norm, HAS_BIAS=has_bias, HAS_BETA=has_beta, ACT=act,
        HAS_WPE=wpe is not None, ROPE=cos is not None, HEAD_BIAS=head_b is not None,
        FP32_DOT=INTERPRET or wte.dtype == torch.float32, BLOCK_M=16 if dot else 1, DOT=dot, BLOCK_N=block_n,
        BLOCK_K=block_k, BLOCK_S=min(64, pow2(S)), BLOCK_C=pow2(C), num_warps=4 if block_k <= 256 else 8,
    )  # fmt: skip


# Not a registered op: it writes the caches through TABLE's pointers, which no schema can say, and
# it is replayed from a CUDA graph, never traced by torch.compile.
decode_step = _step_launch
