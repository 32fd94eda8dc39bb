"""The paged KV cache against the full forward: packed prefill and decode of ragged sequences,
prefix caching, copy-on-write after a fork, and the block manager's bookkeeping."""

from __future__ import annotations

import pytest
import torch

from ember.errors import EmberError
from ember.infer.paged import BlockManager, PagedKVCache, PagedSequence, blocks_for, chain_hash
from tests.test_engine import LAYOUTS, tiny_model


def step(model, cache, blocks, work):
    """Reserve, plan and run one packed forward of ``work`` [(seq, n)]; the logits of each
    sequence's last fed token, then commit."""
    for seq, n in work:
        blocks.reserve(seq, n)
    cache.plan(work)
    ids = torch.tensor([t for seq, n in work for t in seq.tokens[seq.computed : seq.computed + n]])
    logits = model(ids[None], cache=cache)[0]  # (N, V)
    ends = torch.tensor([n for _, n in work]).cumsum(0) - 1
    for seq, n in work:
        blocks.commit(seq, n)
    return logits[ends]


def full_last(model, tokens):
    return model(torch.tensor([tokens]))[0, -1]


@pytest.mark.parametrize("layout", ["learned-mha", "rope-gqa"])
def test_packed_chunks_and_decode_equal_the_full_forward(layout):
    """Three sequences of different lengths, prefilled in chunks of uneven sizes and decoded
    in one packed row with each other: every logit equals a full forward of that prefix."""
    torch.manual_seed(0)
    model = tiny_model(**LAYOUTS[layout])
    blocks = BlockManager(num_blocks=32, block_size=4)
    cache = PagedKVCache(blocks)
    seqs = [PagedSequence(torch.randint(0, 64, (n,)).tolist()) for n in (11, 3, 6)]
    for s in seqs:
        blocks.admit(s)
    worst = 0.0
    plans = [[(seqs[0], 5), (seqs[1], 3)], [(seqs[0], 6), (seqs[1], 0), (seqs[2], 6)]]
    for work in plans:  # chunked prefill, one sequence mid-prompt while another starts
        work = [(s, n) for s, n in work if n]
        step(model, cache, blocks, work)
    for _ in range(7):  # decode all three together, appending a greedy token each step
        work = [(s, 1) for s in seqs]
        for s in seqs:
            assert s.computed == len(s.tokens) - 1 or s.computed == len(s.tokens)
        for s in seqs:
            if s.computed == len(s.tokens):
                s.tokens.append(int(full_last(model, s.tokens).argmax()))
        logits = step(model, cache, blocks, work)
        for s, row in zip(seqs, logits, strict=True):
            worst = max(worst, (row - full_last(model, s.tokens)).abs().max().item())
    assert worst < 1e-5
    for s in seqs:
        blocks.release(s)
    assert blocks.num_free == 32 and sum(blocks.ref) == 0


def test_prefix_cache_shares_full_blocks_and_gives_the_same_logits():
    torch.manual_seed(1)
    model = tiny_model()
    blocks = BlockManager(num_blocks=16, block_size=4)
    cache = PagedKVCache(blocks)
    shared = torch.randint(0, 64, (9,)).tolist()
    a = PagedSequence(shared + [1, 2, 3])
    blocks.admit(a)
    assert a.computed == 0
    step(model, cache, blocks, [(a, len(a.tokens))])
    b = PagedSequence(shared + [7, 8])  # 9 common tokens: the first two blocks are full and shared
    blocks.admit(b)
    assert b.cached_tokens == 8 and b.table == a.table[:2]
    assert [blocks.ref[x] for x in a.table] == [2, 2, 1]
    [logit] = step(model, cache, blocks, [(b, len(b.tokens) - b.computed)])
    assert (logit - full_last(model, b.tokens)).abs().max() < 1e-5
    c = PagedSequence(list(a.tokens))  # all of a: shares all but the block of its last token
    blocks.admit(c)
    assert c.cached_tokens == 8
    blocks.release(a), blocks.release(b)
    assert blocks.ref[c.table[0]] == 1
    blocks.release(c)
    assert blocks.num_free == 16 and sum(blocks.ref) == 0
    d = PagedSequence(shared + [5])  # freed blocks stay findable until reallocated
    blocks.admit(d)
    assert d.cached_tokens == 8
    [logit] = step(model, cache, blocks, [(d, len(d.tokens) - d.computed)])
    assert (logit - full_last(model, d.tokens)).abs().max() < 1e-5
    blocks.release(d)
    # reallocating every block evicts the cache
    many = [PagedSequence(list(range(4))) for _ in range(16)]
    for s in many:
        blocks.admit(s)  # (3 tokens ask for no full block)
        blocks.reserve(s, 4)
    assert blocks.num_free == 0 and not blocks.block_of
    for s in many:
        blocks.release(s)


def test_fork_copies_the_shared_last_block_on_write():
    torch.manual_seed(2)
    model = tiny_model()
    blocks = BlockManager(num_blocks=16, block_size=4)
    cache = PagedKVCache(blocks)
    a = PagedSequence(torch.randint(0, 64, (6,)).tolist())  # 1.5 blocks
    blocks.admit(a)
    step(model, cache, blocks, [(a, 6)])
    b = blocks.fork(a)
    assert b.table == a.table and blocks.ref[a.table[1]] == 2
    a.tokens.append(10), b.tokens.append(20)
    assert blocks.blocks_needed(a, 1) == 1
    la, lb = step(model, cache, blocks, [(a, 1), (b, 1)])
    assert a.table[0] == b.table[0] and a.table[1] != b.table[1]  # the partial block was copied
    assert (la - full_last(model, a.tokens)).abs().max() < 1e-5
    assert (lb - full_last(model, b.tokens)).abs().max() < 1e-5
    blocks.release(a), blocks.release(b)
    assert blocks.num_free == 16 and sum(blocks.ref) == 0


def test_chain_hash_keys_the_whole_prefix_and_budget_sizing():
    assert chain_hash(b"", [1, 2]) != chain_hash(chain_hash(b"", [9, 9]), [1, 2])
    assert chain_hash(b"", [1, 2]) == chain_hash(b"", [1, 2])
    cfg = tiny_model().cfg  # 2 layers × 4 heads × 16 dims: 2 × 2 × 64 × 4 bytes = 1 KiB a token
    assert blocks_for(16 * 1024 * 10, cfg, block_size=16) == 10
    with pytest.raises(EmberError, match="serve.kv_memory"):
        blocks_for(100, cfg)
