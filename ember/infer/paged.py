"""A paged KV cache: keys and values in fixed-size blocks handed out from one pool, each
sequence reading its own through a block table (Kwon et al. 2023, vLLM's PagedAttention).

    blocks = BlockManager(num_blocks=blocks_for(2**26, model.cfg), block_size=16)
    a, b = PagedSequence(prompt_a), PagedSequence(prompt_b)
    blocks.admit(a), blocks.admit(b)                   # shares cached prompt blocks (prefix caching)
    cache = PagedKVCache(blocks)
    cache.plan([(a, len(a.tokens) - a.computed), (b, 1)])  # a prefills, b decodes: one packed row
    logits = model(packed_ids[None], cache=cache)      # (1, N, V): the ``KVCache`` protocol

Why pages: engine.py's contiguous cache reserves ``prompt + max_new_tokens`` slots per row until
the whole call ends; here a sequence takes one block at a time and gives them back the moment it
finishes (at most ``block_size - 1`` slots unused), so scheduler.py can start a new request in
the blocks a finished one frees. docs/serve.md ("Paged KV cache") has the layout, the block
manager, prefix caching and copy-on-write.

Design choices:

- **Pool buffers are sized on the first ``attend``** from the keys received (engine.py's rule).
- **Three ways to attend** (``serve.paged_attention``, the ``PAGED_ATTENTION`` registry;
  ``attention_road`` resolves ``auto``: ``triton`` on CUDA, ``gather`` elsewhere). ``gather``
  (the CPU's): each layer writes the step's new keys into their slots, gathers each
  sequence's slots (``index_select``) and runs SDPA; all decoding sequences go as one padded
  batch. Plain PyTorch, the same on every device, and the reference. ``flex``
  (``FlexPagedKVCache``): one FlexAttention call per layer reads the pool in place, a
  ``mask_mod`` mapping a physical slot to its logical position through an inverse block table
  and a block mask built from the tables (PyTorch's ``_paged_attention``, gpt-fast). On the
  2-core CPU gather is faster (tiny model, a decode step of 16 sequences on one thread: 1.9 ms
  against 5.2 ms with flex compiled and warm). ``triton`` (``TritonPagedKVCache``): ember's
  paged kernel reads the pool through the block tables; the fastest on an H200 (docs/serve.md).
- **Prefix keys are chained hashes** (parent key + own tokens), so equal keys mean equal whole
  prefixes; sharing stops one token short of the prompt, whose logits start the answer. Only a
  partly filled last block after ``fork`` can be written by two sequences: it is copied on the
  first such write (copy-on-write); full blocks are never written again.
- **A Mamba layer's state** (a model with Mamba layers) lives in one slot per running sequence
  of the cache's state pools, not in blocks: ``recur`` runs the layer on the sequences split out
  of the packed row (docs/mamba.md, "Serving").
- Hand-written because the cache is what ember studies (DESIGN rule 1); it must equal the
  contiguous cache (tests/test_paged.py: same logits to 1e-5, same greedy tokens).
"""

from __future__ import annotations

import hashlib
import itertools
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from ember.errors import EmberError
from ember.model.gpt import layer_mixers, sdpa_attention


def blocks_for(budget_bytes: int, cfg, block_size: int = 16, dtype: torch.dtype = torch.float32) -> int:
    """How many blocks of ``block_size`` tokens fit in ``budget_bytes`` for a model config (keys
    and values of every attention layer: 2 × layers × n_kv_head × head_dim values per token; a
    pure Mamba model's blocks hold no keys, and are counted as one layer's)."""
    n_kv = getattr(cfg, "n_kv_head", None) or cfg.n_head
    layers = max(1, layer_mixers(cfg).count("attention"))
    per_token = 2 * layers * n_kv * (cfg.d_model // cfg.n_head) * torch.finfo(dtype).bits // 8
    blocks = int(budget_bytes) // (per_token * block_size)
    if blocks < 1:
        raise EmberError(
            f"a KV budget of {budget_bytes:,} bytes holds no block of {block_size} tokens "
            f"({per_token * block_size:,} bytes each for this model); raise serve.kv_memory"
        )
    return blocks


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: BLAKE2b of its parent's key and its token ids.
    A cryptographic hash, because a collision would silently hand one user another's keys."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


@dataclass
class PagedSequence:
    """One sequence's view of the pool: its tokens, its block table, and how many of its
    tokens have keys in the cache (``computed``; the rest are fed at the next steps)."""

    tokens: list[int]
    table: list[int] = field(default_factory=list)  # block ids, in order
    computed: int = 0  # tokens whose keys and values are in the cache
    hashes: list[bytes] = field(default_factory=list)  # keys of the table's full blocks, in order
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    state: int | None = None  # its slot of the Mamba state pools while admitted (PagedKVCache.recur)


class BlockManager:
    """Blocks of one pool: free list, reference counts, prefix cache (module docstring); and, for a
    model with Mamba layers, ``num_states`` state slots, one taken by each admitted sequence."""

    def __init__(
        self, num_blocks: int, block_size: int = 16, prefix_caching: bool = True, num_states: int = 0
    ):
        if num_blocks < 1 or block_size < 1:
            raise EmberError(f"a KV pool needs blocks; got {num_blocks} blocks of {block_size} tokens")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self.key_of: dict[int, bytes] = {}  # block -> its prefix-cache key (full blocks)
        self.block_of: dict[bytes, int] = {}  # prefix-cache key -> block
        self.copies: list[tuple[int, int]] = []  # (src, dst) copy-on-writes the cache must apply
        self.hits = self.lookups = 0  # prefix-cache blocks found / looked up
        self.cow = 0  # copy-on-writes made
        self.num_states, self.free_states = num_states, list(range(num_states))[::-1]  # slot 0 first

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: PagedSequence, n: int) -> int:
        """New blocks ``seq`` takes to hold ``n`` more tokens (a copy-on-write counts as one)."""
        bs, end = self.block_size, seq.computed + n
        grow = max(0, -(-end // bs) - len(seq.table))
        shared_tail = seq.computed % bs and self.ref[seq.table[seq.computed // bs]] > 1
        return grow + bool(shared_tail and n)

    def _take(self) -> int:
        if not self.free:  # the scheduler checks blocks_needed first; reaching here is a bug
            raise RuntimeError("KV pool exhausted")
        block, _ = self.free.popitem(last=False)  # the least recently freed
        key = self.key_of.pop(block, None)  # reallocated: its cached contents are gone
        if key is not None:
            del self.block_of[key]
        self.ref[block] = 1
        return block

    def _share(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def admit(self, seq: PagedSequence) -> None:
        """Share the prefix-cached blocks of ``seq``'s prompt (all but its last token)."""
        assert not seq.table, "admit a sequence once, or after release"
        seq.computed, seq.hashes, seq.cached_tokens = 0, [], 0
        if self.num_states:  # the scheduler admits no more sequences than slots; reaching here empty is a bug
            seq.state = self.free_states.pop()
        if not self.prefix_caching:
            return
        bs, key = self.block_size, b""
        for i in range((len(seq.tokens) - 1) // bs):
            key = chain_hash(key, seq.tokens[i * bs : (i + 1) * bs])
            self.lookups += 1
            block = self.block_of.get(key)
            if block is None:
                break
            self.hits += 1
            self._share(block)
            seq.table.append(block)
            seq.hashes.append(key)
        seq.computed = seq.cached_tokens = len(seq.table) * bs

    def reserve(self, seq: PagedSequence, n: int) -> None:
        """Make room for ``n`` more tokens of ``seq``: new blocks at the end of its table, and a
        private copy of a shared last block before it is written (recorded in ``copies``)."""
        bs = self.block_size
        if n and seq.computed % bs:
            i = seq.computed // bs
            if self.ref[seq.table[i]] > 1:
                new = self._take()
                self.copies.append((seq.table[i], new))
                self.cow += 1
                self.ref[seq.table[i]] -= 1
                seq.table[i] = new
        while len(seq.table) * bs < seq.computed + n:
            seq.table.append(self._take())

    def commit(self, seq: PagedSequence, n: int) -> None:
        """``n`` more tokens of ``seq`` are in the cache: publish the blocks they filled."""
        seq.computed += n
        bs = self.block_size
        while len(seq.hashes) < seq.computed // bs:
            i = len(seq.hashes)
            key = chain_hash(seq.hashes[-1] if seq.hashes else b"", seq.tokens[i * bs : (i + 1) * bs])
            seq.hashes.append(key)
            if self.prefix_caching and key not in self.block_of and seq.table[i] not in self.key_of:
                self.block_of[key], self.key_of[seq.table[i]] = seq.table[i], key

    def fork(self, seq: PagedSequence) -> PagedSequence:
        """A second sequence with ``seq``'s tokens and blocks (for ``n`` answers to one prompt);
        the shared last block is copied on the first write of either."""
        assert seq.state is None, "a Mamba state is not shared: scheduler.py queues such answers apart"
        for block in seq.table:
            self._share(block)
        tokens, table, hashes = list(seq.tokens), list(seq.table), list(seq.hashes)
        return PagedSequence(tokens, table, seq.computed, hashes, seq.cached_tokens)

    def release(self, seq: PagedSequence) -> None:
        """Give ``seq``'s blocks back (finished, cancelled or preempted); cached ones stay findable."""
        for block in reversed(seq.table):  # the tail first: evicted before the shared prefix
            self.ref[block] -= 1
            assert self.ref[block] >= 0, f"block {block} released twice"
            if self.ref[block] == 0:
                self.free[block] = None
        seq.table, seq.computed, seq.hashes = [], 0, []
        if seq.state is not None:
            self.free_states.append(seq.state)
            seq.state = None

    @property
    def in_use(self) -> int:
        return self.num_blocks - len(self.free)


class PagedKVCache:
    """The ``KVCache`` protocol of ember/model/gpt.py over a ``BlockManager``'s pool, for one
    packed row of tokens from many sequences (module docstring). ``plan`` before each forward."""

    graphed = False  # whether StepGraphs may replay its steps: shapes that depend on a bucket alone

    def __init__(
        self, blocks: BlockManager, device: torch.device | None = None, max_seqs: int = 64, max_len: int = 0
    ):
        self.blocks, self.device = blocks, device  # (max_seqs, max_len: the padded caches'; any fit here)
        self.pool_slots = blocks.num_blocks * blocks.block_size  # a layer's pool: its keys' slots
        self.k: dict[str, Tensor] = {}  # layer -> (num_blocks * block_size, n_kv_head, head_dim)
        self.v: dict[str, Tensor] = {}
        self.spans: list[tuple[int, int, Tensor]] = []
        self.states: dict[str, tuple[Tensor, ...]] = {}  # Mamba layer -> its pools, (num_states, ...) each

    def plan(self, work: Sequence[tuple[PagedSequence, int]]) -> None:
        """The next forward feeds, for each ``(seq, n)``, ``seq.tokens[seq.computed : +n]``, in
        this order, as one row. Blocks must be reserved (``BlockManager.reserve``). A handful of
        tensor operations whatever the number of sequences: at 16 sequences of a small model a
        few per sequence were a tenth of the step."""
        bs, device = self.blocks.block_size, self.device
        width = max(len(seq.table) for seq, _ in work)
        rows, positions, decoding, self.spans, offset = [], [], [], [], 0
        for i, (seq, n) in enumerate(work):
            assert len(seq.table) * bs >= seq.computed + n, "reserve blocks before planning"
            rows += [i] * n
            positions += range(seq.computed, seq.computed + n)
            if n == 1:
                decoding.append((offset, i, seq.computed + 1))  # one query each: batched below
            else:
                self.spans.append((offset, n, i, seq.computed + n))
            offset += n
        tables = torch.tensor([seq.table + [0] * (width - len(seq.table)) for seq, _ in work])
        slot_of = (tables[:, :, None] * bs + torch.arange(bs)).view(len(work), width * bs)  # [i, pos]
        pos = torch.tensor(positions)
        self.slots = to_device(slot_of[torch.tensor(rows), pos], device)  # (N,) where the new keys go
        self.positions = to_device(pos, device)[None]  # (1, N)
        self.spans = [(o, n, to_device(slot_of[i, :end], device)) for o, n, i, end in self.spans]  # its slots
        self.decode = None
        if decoding:  # one SDPA over their gathered keys, padded to the longest and masked
            at, which, lengths = (torch.tensor(c) for c in zip(*decoding, strict=True))
            longest = int(lengths.max())
            padded = slot_of[which, :longest]  # past a sequence's length: slots it does not own, masked
            held = (torch.arange(longest) < lengths[:, None])[:, None, None, :]
            self.decode = (*(to_device(t, device) for t in (at, padded.reshape(-1), held)), longest)
        if self.blocks.num_states:
            self.plan_states(work)

    def plan_states(self, work: Sequence[tuple[PagedSequence, int]]) -> None:
        """The Mamba layers' share of the plan (``recur``): the decoding sequences go as one group,
        a batch of one token each, and each prompt chunk as a group of its own; a sequence fed from
        its first token starts from a zero state (its slot held another's before)."""
        groups, decoding, offset = [], [], 0
        for seq, n in work:
            if n == 1:
                decoding.append((offset, seq.state))
            else:
                groups.append((torch.arange(offset, offset + n)[None], [seq.state]))
            offset += n
        if decoding:
            at, slots = zip(*decoding, strict=True)
            groups.append((torch.tensor(at)[:, None], list(slots)))
        self.groups = [(at.to(self.device), torch.tensor(slots, device=self.device)) for at, slots in groups]
        fresh = [seq.state for seq, _ in work if seq.computed == 0]
        self.fresh = torch.tensor(fresh, dtype=torch.long, device=self.device)

    def recur(self, layer: str, x: Tensor, mix: Callable) -> Tensor:
        """A Mamba layer over the packed row x (1, N, C) (``RecurrentCache``, ember/model/mamba.py):
        each planned group runs ``mix`` as a batch of rows, from the states gathered from its
        sequences' slots, and scatters the states after it back. The pools, fp32, are sized on
        the first call from the states it returns (all fresh then: nothing was fed before)."""
        pools = self.states.get(layer)
        if pools is not None:
            for pool in pools:
                pool.index_fill_(0, self.fresh, 0.0)
        out = torch.zeros_like(x)
        for at, slots in self.groups:  # at: (R, t) token indices into the row; slots: (R,)
            state = None if pools is None else tuple(pool.index_select(0, slots) for pool in pools)
            y, state = mix(x[0, at], state, None)  # (R, t, C)
            out[0, at] = y
            if pools is None:
                n_slots = self.blocks.num_states
                pools = tuple(t.new_zeros(n_slots, *t.shape[1:], dtype=torch.float32) for t in state)
                self.states[layer] = pools
            for pool, t in zip(pools, state, strict=True):
                pool.index_copy_(0, slots, t.float())
        return out

    def extend(self, T: int) -> Tensor:
        assert T == self.slots.numel(), f"planned {self.slots.numel()} tokens, fed {T}"
        bs = self.blocks.block_size
        for src, dst in self.blocks.copies:  # copy-on-write, before anything is written
            for pool in (*self.k.values(), *self.v.values()):
                pool[dst * bs : (dst + 1) * bs] = pool[src * bs : (src + 1) * bs]
        self.blocks.copies.clear()
        return self.positions

    def stored(self, layer: str, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The layer's pools (pool_slots, n_kv_head, hd), made on its first call, with the fed
        tokens' keys and values (1, n_kv_head, N, hd) written into their planned slots."""
        if layer not in self.k:
            self.k[layer] = k.new_zeros(self.pool_slots, k.size(1), k.size(3))
            self.v[layer] = v.new_zeros(self.pool_slots, v.size(1), v.size(3))
        keys, values = self.k[layer], self.v[layer]
        keys.index_copy_(0, self.slots, k[0].transpose(0, 1))
        values.index_copy_(0, self.slots, v[0].transpose(0, 1))
        return keys, values

    def attend(self, layer: str, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        keys, values = self.stored(layer, k, v)
        out = torch.empty_like(q)  # (1, n_head, N, hd)
        for offset, n, seq_slots in self.spans:  # prompt chunks, one by one, causal
            kk = keys.index_select(0, seq_slots).transpose(0, 1)[None]  # (1, n_kv_head, L, hd)
            vv = values.index_select(0, seq_slots).transpose(0, 1)[None]
            out[:, :, offset : offset + n] = sdpa_attention(q[:, :, offset : offset + n], kk, vv, 0.0)
        if self.decode is not None:
            at, slots, held, longest = self.decode
            D = at.numel()
            kk = keys.index_select(0, slots).view(D, longest, *keys.shape[1:]).transpose(1, 2)  # D, kv, L, d
            vv = values.index_select(0, slots).view(D, longest, *values.shape[1:]).transpose(1, 2)
            qq = q[0, :, at].transpose(0, 1)[:, :, None]  # (D, n_head, 1, hd)
            out[0, :, at] = sdpa_attention(qq, kk, vv, 0.0, held)[:, :, 0].transpose(0, 1)
        return out


def to_device(t: Tensor, device) -> Tensor:
    """``t`` (on the CPU) on ``device``: to a GPU from pinned memory, without waiting. A plain
    ``.to("cuda")`` of pageable memory synchronizes the stream, so a step's plan would wait for the
    step before it to finish, and ``Scheduler(async_steps=True)`` plans while that one runs."""
    if device is None or torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)  # the caching host allocator keeps it till copied


def fed(work: Sequence[tuple[PagedSequence, int]], pad_to: int | None, rows: int, block_size: int):
    """The padded caches' share of a plan: each fed token's sequence (its index in ``work``) and
    position, (N,) int64 arrays each; T, the tokens fed with the pads (``pad_to``, or N); and each
    sequence's blocks held, (S,). Checks that the blocks are reserved and that fewer than
    ``rows`` sequences run. numpy, not torch: a step plans on the host, where torch's ~5 µs an
    op on small tensors added up to most of the triton plan's 370 µs at 64 sequences (2-core CPU)."""
    S = len(work)
    assert S < rows, f"{S} sequences in one step; the cache was made for max_seqs={rows - 1} at most"
    ns = np.fromiter((n for _, n in work), np.int64, S)
    done = np.fromiter((seq.computed for seq, _ in work), np.int64, S)
    held = np.fromiter((len(seq.table) for seq, _ in work), np.int64, S)
    assert (held * block_size >= done + ns).all(), "reserve blocks before planning"
    N = int(ns.sum())
    T = pad_to or N  # pads write to the scratch slot
    assert T >= N, f"{N} tokens do not fit a row padded to {pad_to}"
    q_seq = np.repeat(np.arange(S), ns)
    starts = done - (ns.cumsum() - ns)  # a sequence's first position, less its first token's index
    return q_seq, starts[q_seq] + np.arange(N), T, held


def padded(slots: np.ndarray, q_pos: np.ndarray, T: int, scratch: int, device) -> tuple[Tensor, Tensor]:
    """The slots (T,) the fed tokens' keys go to and their positions (1, T) on ``device``, the
    pads' at the scratch slot and position 0."""
    out = np.zeros((2, T), np.int64)  # slots, positions: one copy to the device
    out[0] = scratch
    out[0, : len(slots)], out[1, : len(q_pos)] = slots, q_pos
    out = to_device(torch.from_numpy(out), device)
    return out[0], out[1][None]


KV_TILE = 128  # FlexAttention's sparse block (queries and pool slots): its CUDA kernel's tiles divide it


def flex_kernel():
    """FlexAttention compiled (the fused kernel; on a CPU inductor's C++ template), once per process.
    Static shapes, padded to ``bucket`` lengths: one kernel per query bucket serves every step.
    Those buckets (16 to ``max_batch_tokens``: 8 at 2,048) may outnumber dynamo's default of 8
    compilations per function, past which it would run FlexAttention eagerly, materializing the
    scores over the whole pool (an H100, 2026-11-27: 0.4x the batch-1 engine at 64 clients), so
    the calls raise that limit to ``FLEX_RECOMPILES``."""
    global _FLEX
    if _FLEX is None:
        _FLEX = compile_flex()
    return _FLEX


def compile_flex(backend: str | Callable = "inductor") -> Callable:
    """``flex_kernel``'s function, under another ``backend`` too (tests count its compilations)."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False, backend=backend)  # dynamic: CPU template fails
    return torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILES)(compiled)


_FLEX = None
FLEX_RECOMPILES = 32  # query buckets 16 .. 16 * 2**31 tokens


def bucket(n: int) -> int:
    """The power of two >= n, at least 16: the lengths FlexAttention is compiled for."""
    return max(16, 1 << (n - 1).bit_length())


class FlexPagedKVCache(PagedKVCache):
    """``PagedKVCache`` whose attention reads the pool in place: one FlexAttention call per layer
    over the packed row and the whole pool, a ``mask_mod`` mapping each physical slot back to its
    logical position in the query's sequence (PyTorch's ``_paged_attention``, gpt-fast), and a
    block mask built from the block tables so only the ``KV_TILE`` tiles a query's sequence owns
    are read. Prompt chunks and decodes go in the same call. ``flex``: the attention function
    (tests pass the eager one). ``plan(work, pad_to=B)`` pads the row to B tokens that write to
    a scratch slot and attend to nothing: the fixed shapes a CUDA graph replays."""

    graphed = True

    def __init__(
        self, blocks: BlockManager, device: torch.device | None = None, max_seqs: int = 64, max_len: int = 0,
        flex=None,
    ):
        super().__init__(blocks, device, max_seqs)
        self.flex = flex
        self.rows = bucket(max_seqs + 1)  # of the inverse table, fixed: one kernel per query bucket
        bs = blocks.block_size
        self.scratch = blocks.num_blocks * bs  # the slot padding tokens write to, owned by no block
        self.pool_slots = -(-(self.scratch + 1) // KV_TILE) * KV_TILE
        self.pages = -(-self.pool_slots // bs)  # columns of the inverse table, scratch's included
        self._block_mask = None
        self.inv: Tensor | None = None  # (rows, pages) [seq, physical block] -> logical block, or -1
        self.written: tuple[Tensor, Tensor] | None = None  # the entries of ``inv`` the last plan set

    def plan(self, work: Sequence[tuple[PagedSequence, int]], pad_to: int | None = None) -> None:
        bs, S = self.blocks.block_size, len(work)
        q_seq, q_pos, T, lens = fed(work, pad_to, self.rows, bs)
        q_seq, q_pos, lens = torch.from_numpy(q_seq), torch.from_numpy(q_pos), torch.from_numpy(lens)
        N, Q, R = len(q_seq), bucket(T), self.rows  # fixed but for Q: a few compiled kernels serve every step
        table = torch.tensor([b for seq, _ in work for b in seq.table], dtype=torch.long)  # tables, joined
        first = lens.cumsum(0) - lens  # where each sequence's table starts in ``table``
        owner = torch.repeat_interleave(torch.arange(S), lens)
        # [seq, physical block] -> logical block; rows >= S own none. One table kept for the pool,
        # whose last plan's entries are reset: a new table each step cost O(pool), 12.5 MB at 1e8
        # bytes of KV, the most of the flex road's host work on the 2-core CPU
        if self.inv is None:
            self.inv = torch.full((R, self.pages), -1, dtype=torch.int32, device=self.device)
        if self.written is not None:
            self.inv[self.written] = -1
        self.written = (to_device(owner, self.device), to_device(table, self.device))
        logical = (torch.arange(len(table)) - first[owner]).int()
        self.inv.index_put_(self.written, to_device(logical, self.device))
        slots = table[first[q_seq] + q_pos // bs] * bs + q_pos % bs  # (N,) where the new keys go
        self.slots, self.positions = padded(slots.numpy(), q_pos.numpy(), T, self.scratch, self.device)
        q_seq = torch.cat([q_seq, torch.full((Q - N,), S)])  # pads belong to row S, which owns nothing
        q_pos = torch.cat([q_pos, torch.zeros(Q - N, dtype=torch.long)])
        # Block mask: a query tile reads every KV tile holding a block of one of its sequences.
        n_q, n_kv = Q // KV_TILE or 1, self.pool_slots // KV_TILE
        in_tile = torch.zeros(n_q, R)
        in_tile[torch.arange(Q) // KV_TILE, q_seq] = 1
        owns = torch.zeros(R, n_kv)
        owns[owner, table * bs // KV_TILE] = 1
        owns[owner, (table * bs + bs - 1) // KV_TILE] = 1  # a block across a tile edge
        needed = (in_tile @ owns) > 0  # (n_q, n_kv)
        num = needed.sum(-1, dtype=torch.int32)[None, None]  # (1, 1, n_q)
        indices = needed.int().argsort(dim=-1, descending=True, stable=True).int()[None, None]  # theirs first
        self.mask = (to_device(q_seq, self.device), to_device(q_pos, self.device), self.inv)
        self.tiles = (to_device(num, self.device), to_device(indices, self.device), Q)

    def replayed(self) -> list[Tensor]:
        """The plan's tensors that a step reads, for ``StepGraphs`` to copy into a shape's buffers
        (the inverse table is one buffer already, kept in place)."""
        return [self.slots, self.positions, *self.mask[:2], *self.tiles[:2]]

    def read_from(self, buffers: list[Tensor]) -> None:
        """Read the plan from ``buffers`` (``replayed``'s order): what a CUDA graph replays."""
        self.slots, self.positions, q_seq, q_pos, num, indices = buffers
        self.mask, self.tiles = (q_seq, q_pos, self.inv), (num, indices, self.tiles[2])

    def block_mask(self):
        from torch.nn.attention.flex_attention import BlockMask

        q_seq, q_pos, inv = self.mask
        bs = self.blocks.block_size

        def mask_mod(b, h, q, kv):  # kv: a physical slot; visible if its sequence's and causal
            logical = inv[q_seq[q], kv // bs]
            return (logical >= 0) & (logical * bs + kv % bs <= q_pos[q])

        num, indices, n = self.tiles
        return BlockMask.from_kv_blocks(
            num, indices, BLOCK_SIZE=KV_TILE, mask_mod=mask_mod, seq_lengths=(n, self.pool_slots)
        )

    def extend(self, T: int) -> Tensor:
        assert T == self.slots.numel(), f"planned {self.slots.numel()} tokens, fed {T}"
        bs = self.blocks.block_size
        for src, dst in self.blocks.copies:  # copy-on-write, before anything is written
            for pool in (*self.k.values(), *self.v.values()):
                pool[:, dst * bs : (dst + 1) * bs] = pool[:, src * bs : (src + 1) * bs]
        self.blocks.copies.clear()
        self._block_mask = None
        return self.positions

    def attend(self, layer: str, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if layer not in self.k:  # (n_kv_head, pool_slots, hd): the layout FlexAttention reads
            self.k[layer] = k.new_zeros(k.size(1), self.pool_slots, k.size(3))
            self.v[layer] = v.new_zeros(v.size(1), self.pool_slots, v.size(3))
        keys, values = self.k[layer], self.v[layer]
        keys.index_copy_(1, self.slots, k[0])  # (n_kv_head, N, hd) into their slots
        values.index_copy_(1, self.slots, v[0])
        if self._block_mask is None:  # once per forward, shared by the layers
            self._block_mask = self.block_mask()
        flex, T, gqa = self.flex or flex_kernel(), q.size(2), q.size(1) != k.size(1)
        # (1, n_head, Q, hd): the bucket's length, contiguous (a pad of 0 would keep the transposed
        # strides of q, and each stride is one more compiled kernel)
        q = F.pad(q, (0, 0, 0, self.tiles[2] - T)).contiguous()
        out = flex(q, keys[None], values[None], block_mask=self._block_mask, enable_gqa=gqa)
        return out[:, :, :T]


class TritonPagedKVCache(PagedKVCache):
    """``PagedKVCache`` whose attention is ember's own kernel (``ember.kernels.paged``): one launch
    per layer, each tile of up to 16 tokens of one sequence reading that sequence's keys where
    they lie, through its block table; prompt chunks and decodes alike. Nothing to compile but the
    kernel, and no mask to build: the plan is the tables (``max_seqs + 1`` rows by the blocks a
    sequence of ``max_len`` tokens holds), each token's position, the tiles, and the slots the new
    keys go to. ``plan(work, pad_to=B)`` pads the row to B tokens that write to a scratch slot and
    belong to no tile, so a step's shapes depend on B alone and ``StepGraphs`` can replay it.
    Needs Triton (on a CPU, under its interpreter: tests only)."""

    graphed = True

    def __init__(
        self, blocks: BlockManager, device: torch.device | None = None, max_seqs: int = 64, max_len: int = 0
    ):
        from ember.kernels import triton_ready

        ok, why = triton_ready(torch.device(device or "cpu"))
        if not ok:
            raise EmberError(f"serve.paged_attention=triton: {why}; use serve.paged_attention=gather")
        if max_len < 1:
            raise EmberError("serve.paged_attention=triton needs the model's max_seq_len (its tables' width)")
        if torch.device(device or "cpu").type == "cpu":
            warnings.warn(
                "serve.paged_attention=triton on a CPU runs under Triton's interpreter, for tests: "
                "hundreds of times slower than serve.paged_attention=gather",
                stacklevel=2,
            )
        super().__init__(blocks, device, max_seqs)
        from ember.kernels import paged as kernel  # (imports Triton: only once it is known ready)

        self.kernel = kernel
        self.rows = max_seqs + 1
        self.width = -(-max_len // blocks.block_size)  # blocks of the longest sequence
        self.scratch = blocks.num_blocks * blocks.block_size  # the slot padding tokens write to
        self.pool_slots = self.scratch + 1

    def plan(self, work: Sequence[tuple[PagedSequence, int]], pad_to: int | None = None) -> None:
        bs = self.blocks.block_size
        q_seq, q_pos, T, held = fed(work, pad_to, self.rows, bs)
        assert held.max() <= self.width, f"{held.max()} blocks; a table holds {self.width}"
        tables = np.zeros((self.rows, self.width), dtype=np.int32)
        blocks = itertools.chain.from_iterable(seq.table for seq, _ in work)
        tables[: len(work)][np.arange(self.width) < held[:, None]] = np.fromiter(blocks, np.int32, held.sum())
        slots = tables[q_seq, q_pos // bs].astype(np.int64) * bs + q_pos % bs
        self.slots, self.positions = padded(slots, q_pos, T, self.scratch, self.device)
        # as many tile columns as any step of T tokens from at most max_seqs sequences can need
        size = min(T, T // self.kernel.BLOCK_M + self.rows - 1)
        self.tiles = to_device(self.kernel.tiles_for([n for _, n in work], size), self.device)
        self.tables = to_device(torch.from_numpy(tables), self.device)

    def replayed(self) -> list[Tensor]:
        """The plan's tensors that a step reads (``FlexPagedKVCache.replayed``)."""
        return [self.slots, self.positions, self.tiles, self.tables]

    def read_from(self, buffers: list[Tensor]) -> None:
        self.slots, self.positions, self.tiles, self.tables = buffers

    def attend(self, layer: str, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        keys, values = self.stored(layer, k, v)
        q = q[0].transpose(0, 1)  # (T, n_head, hd)
        out = self.kernel.paged_attention(
            q, keys, values, self.tables, self.positions[0], self.tiles, self.blocks.block_size
        )
        return out.transpose(0, 1)[None]  # (1, n_head, T, hd)


# serve.paged_attention
PAGED_ATTENTION = {"gather": PagedKVCache, "flex": FlexPagedKVCache, "triton": TritonPagedKVCache}


def attention_road(choice: str, device: torch.device | str, recurrent: bool, batch_invariant: bool) -> str:
    """``serve.paged_attention``, with ``auto`` resolved: ``triton`` for a batch-invariant server
    (the one road whose sums keep one order), else on CUDA for an attention-only model where
    Triton is ready (two H200 leases at 64 clients: 11.3x and 9.3x the sequential batch-1
    engine, where gather made 4.9x and flex 1.5x), else ``gather`` (a CPU, where the kernels run
    only interpreted, and Mamba layers, whose state padded steps cannot carry)."""
    if choice != "auto":
        return choice
    if batch_invariant:
        return "triton"
    from ember.kernels import triton_ready

    cuda = torch.device(device).type == "cuda"
    return "triton" if cuda and not recurrent and triton_ready(device)[0] else "gather"
