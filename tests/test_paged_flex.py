"""The flex paged cache (FlexAttention over the pool in place) against the gather cache, and decode
steps padded to a batch-size bucket (the shapes CUDA graphs replay) against unpadded ones.

FlexAttention runs eagerly here (the reference of the same math: the compiled CPU kernel takes
tens of seconds per shape to build); the block mask, the inverse tables and the padding are the
same code the compiled kernel and the CUDA graphs read."""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from ember.errors import EmberError
from ember.infer.paged import (
    FLEX_RECOMPILES,
    BlockManager,
    FlexPagedKVCache,
    PagedKVCache,
    PagedSequence,
    bucket,
    compile_flex,
)
from ember.infer.sampling import Sampling
from ember.infer.scheduler import Scheduler, padded_tokens
from tests.test_engine import LAYOUTS, tiny_model
from tests.test_scheduler import engine, serve  # noqa: F401 (a fixture)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def step(model, cache, blocks, work, pad_to=None):
    """Reserve, plan and run one packed forward of ``work`` [(seq, n)] (padded with id 0 to
    ``pad_to`` tokens); the logits of each sequence's last fed token, then commit."""
    for seq, n in work:
        blocks.reserve(seq, n)
    cache.plan(work, pad_to=pad_to) if pad_to else cache.plan(work)
    ids = [t for seq, n in work for t in seq.tokens[seq.computed : seq.computed + n]]
    ends = torch.tensor([n for _, n in work]).cumsum(0) - 1
    logits = model(torch.tensor([ids + [0] * ((pad_to or 0) - len(ids))]), cache=cache)[0]  # (N, V)
    for seq, n in work:
        blocks.commit(seq, n)
    return logits[ends]


class Twin:
    """The same sequences on two pools, one read by gathering, one by FlexAttention: every step
    is made on both (same tables: same block managers' decisions) and their logits compared."""

    def __init__(self, model, num_blocks, block_size, prompts, other=None):
        self.model, self.worst = model, 0.0
        self.blocks = [BlockManager(num_blocks, block_size) for _ in range(2)]
        other = other or (lambda blocks: FlexPagedKVCache(blocks, flex=flex_attention))
        self.caches = [PagedKVCache(self.blocks[0]), other(self.blocks[1])]
        self.seqs = [[PagedSequence(list(p)) for p in prompts] for _ in range(2)]

    def admit(self, i):
        for blocks, seqs in zip(self.blocks, self.seqs, strict=True):
            blocks.admit(seqs[i])
        return self.seqs[0][i].cached_tokens

    def release(self, i):
        for blocks, seqs in zip(self.blocks, self.seqs, strict=True):
            blocks.release(seqs[i])

    def step(self, plan, pad_to=None):
        """plan [(i, n)]; appends each decoded sequence's greedy token; returns the flex logits."""
        out = []
        for side, (blocks, cache, seqs) in enumerate(zip(self.blocks, self.caches, self.seqs, strict=True)):
            work = [(seqs[i], n) for i, n in plan]
            out.append(step(self.model, cache, blocks, work, pad_to if side else None))
        assert [s.table for s in self.seqs[0]] == [s.table for s in self.seqs[1]]
        self.worst = max(self.worst, (out[0] - out[1]).abs().max().item())
        for (i, _), g, f in zip(plan, *out, strict=True):
            assert int(g.argmax()) == int(f.argmax())
            for seqs in self.seqs:
                if seqs[i].computed == len(seqs[i].tokens):
                    seqs[i].tokens.append(int(g.argmax()))
        return out[1]


@pytest.mark.parametrize("layout", ["learned-mha", "rope-gqa"])
def test_flex_equals_gather_on_ragged_rows_sharing_prefix_blocks(layout, other=None):
    """Rows of 11, 3, 6 and 14 tokens in blocks of 4 (every chunk ends mid-block), two of them
    sharing a prefix-cached 8 tokens, a fork writing its copied last block, then blocks freed
    and taken again by a new sequence (stale keys in them): logits within 1e-5, same greedy ids.
    (``other``: the cache held to gather's, flex by default; tests/test_paged_triton.py's too.)"""
    torch.manual_seed(0)
    model = tiny_model(**LAYOUTS[layout])
    shared = torch.randint(0, 64, (9,)).tolist()
    prompts = [torch.randint(0, 64, (n,)).tolist() for n in (11, 3, 6)]
    prompts += [shared + [1, 2, 3, 4, 5], shared + [7]]
    t = Twin(model, num_blocks=24, block_size=4, prompts=prompts, other=other)
    with torch.no_grad():
        for i in range(4):
            t.admit(i)
        t.step([(0, 5), (1, 3)])  # chunked prefill: one mid-prompt while another starts
        t.step([(0, 6), (2, 6), (3, 14)])
        assert t.admit(4) == 8  # two full blocks of sequence 3's prompt, shared
        t.step([(4, 2), (0, 1), (1, 1), (2, 1), (3, 1)])  # prefill beside decodes in one row
        for _ in range(4):  # sequence 2 ends with 11 of 12 slots of its last block filled
            t.step([(i, 1) for i in range(5)])
        for blocks, seqs in zip(t.blocks, t.seqs, strict=True):  # n answers: a fork of sequence 2
            seqs.append(blocks.fork(seqs[2]))
        for _ in range(3):
            t.step([(i, 1) for i in range(6)])
        assert t.blocks[1].cow == 1
        t.release(0), t.release(1)  # their blocks go back; a new sequence takes them, stale keys and all
        late = torch.randint(0, 64, (13,)).tolist()
        for seqs in t.seqs:
            seqs.append(PagedSequence(list(late)))
        t.admit(6)
        t.step([(6, 13), (2, 1), (5, 1)])
        for _ in range(4):
            t.step([(i, 1) for i in (2, 3, 4, 5, 6)])
    assert t.worst < 1e-5


def test_decode_padded_to_a_bucket_equals_the_unpadded_step():
    """A decode step of 5 sequences padded to bucket 8 (three pad tokens writing to the scratch
    slot and attending to nothing): the 5 real rows' logits equal the gather cache's, and the
    next steps (which read what the padded step wrote) still do."""
    torch.manual_seed(1)
    model = tiny_model(**LAYOUTS["rope-gqa"])
    prompts = [torch.randint(0, 64, (n,)).tolist() for n in (7, 1, 12, 4, 9)]
    t = Twin(model, num_blocks=40, block_size=4, prompts=prompts)
    with torch.no_grad():
        for i in range(5):
            t.admit(i)
        t.step([(i, len(p)) for i, p in enumerate(prompts)])
        for _ in range(6):
            t.step([(i, 1) for i in range(5)], pad_to=8)
        t.step([(i, 1) for i in range(5)])  # unpadded again
    assert t.worst < 1e-5
    assert bucket(5) == 16 and bucket(17) == 32 and bucket(64) == 64


def test_compiled_flex_compiles_once_per_query_bucket():
    """The compiled kernel's cache: one compilation per query bucket, whether the row fills its
    bucket or is padded to it (a row that fills it used to reach FlexAttention with transposed
    strides: a second compilation per bucket), and past dynamo's recompile limit (8 by default;
    here lowered to 2 around the calls) every bucket still compiles: beyond the limit dynamo runs
    FlexAttention eagerly over the whole pool, what an H100 showed at 64 clients. The backend
    counts frames and runs them eagerly."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    kernel = compile_flex(backend=counter)
    model = tiny_model(max_seq_len=256, n_layer=1)  # (a packed row is one sequence to it)
    blocks = BlockManager(num_blocks=80, block_size=8)
    cache = FlexPagedKVCache(blocks, flex=kernel, max_seqs=8)
    buckets, rng = [16, 32, 64, 128, 256], random.Random(0)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=2):
        for Q in buckets:
            for tokens in (Q, Q // 2 + 1):  # fills its bucket, then is padded to it
                per = -(-tokens // 8)  # in up to 8 fresh sequences of at most 32 tokens
                lengths = [min(per, tokens - k) for k in range(0, tokens, per)]  # random ids: no cache hits
                seqs = [PagedSequence([rng.randrange(3, 64) for _ in range(n)]) for n in lengths]
                for seq in seqs:
                    blocks.admit(seq)
                step(model, cache, blocks, [(seq, len(seq.tokens)) for seq in seqs])
                assert cache.tiles[2] == Q
                for seq in seqs:
                    blocks.release(seq)
    assert counter.frame_count == len(buckets), counter.frame_count
    assert FLEX_RECOMPILES >= 8 + len(buckets)


def test_padded_steps_equal_unpadded_ones(engine):  # noqa: F811
    """Every step of the scheduler's graph road (decode-only steps padded to a batch bucket, mixed
    steps of prompt chunks and decodes to a token bucket, logits picked by index) against the
    same step unpadded with a mask (``Scheduler._forward``), on the same cache: the same logits
    within 1e-5. The second forward rewrites the same keys into the same slots."""
    s = Scheduler(engine, num_blocks=60, block_size=8, max_batch_tokens=40, max_seqs=8,
                  paged_attention="flex", decode_buckets=(1, 2, 4))  # fmt: skip
    s.cache.flex, padded, kinds = flex_attention, s.graphs, []

    def both(work, drawn=None):
        logits, plain = padded(work, drawn), s._forward(work, drawn)
        kinds.append((padded.shape(work), all(n == 1 for _, n in work)))
        assert logits.shape == plain.shape and (logits - plain).abs().max() < 1e-5
        return logits

    s.graphs = both
    rng = random.Random(2)  # 6 requests of up to 50 prompt tokens arriving one a step: chunks beside decodes
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 50))] for _ in range(6)]
    requests = [(i, prompt, rng.randint(1, 12)) for i, prompt in enumerate(prompts)]
    serve(s, requests, lambda i, new: Sampling(new, temperature=0))
    assert any(d for _, d in kinds) and any(not d for _, d in kinds)  # both roads taken
    assert {L for L, d in kinds if not d} == {16, 32, 48} and {L for L, d in kinds if d} <= {1, 2, 4, 8, 16}


def test_mixed_steps_are_padded_by_at_most_a_quarter_past_64_tokens():
    """``padded_tokens``: four shapes a doubling, each a multiple of 16; past 64 tokens the pads
    are under a quarter of the step (the power of two above wasted up to half)."""
    shapes = {padded_tokens(n) for n in range(1, 2049)}
    assert sorted(shapes)[:8] == [16, 32, 48, 64, 80, 96, 112, 128] and max(shapes) == 2048
    assert len(shapes) == 4 + 4 * 5 and all(L % 16 == 0 for L in shapes)  # 16..64, then 4 a doubling
    for n in range(1, 2049):
        L = padded_tokens(n)
        assert L >= n and padded_tokens(L) == L and (n <= 64 or (L - n) * 4 < L)


def test_scheduler_flex_and_buckets_equal_gather_with_preemptions(engine):  # noqa: F811
    """The scheduler over the flex cache, with every step padded to a bucket (CUDA graphs'
    shapes; captured only on CUDA), in a pool small enough to preempt, and the same with
    ``async_steps``: every greedy answer equals the gather cache's, token for token, and every
    block is free at the end."""
    rng = random.Random(1)  # 8 requests of up to 30 + 16 tokens, a pool of 7 blocks of 8: preemptions
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 30))] for _ in range(8)]
    requests = [(rng.randint(0, 2), prompt, rng.randint(1, 16)) for prompt in prompts]
    answers, preemptions = {}, {}
    for name, kind, buckets in [("gather", "gather", None), ("flex", "flex", (1, 2, 4, 8)),
                                ("async", "flex", (1, 2, 4, 8))]:  # fmt: skip
        s = Scheduler(engine, num_blocks=7, block_size=8, max_batch_tokens=64, max_seqs=8,
                      paged_attention=kind, decode_buckets=buckets, async_steps=name == "async")  # fmt: skip
        if kind == "flex":
            s.cache.flex = flex_attention
            assert s.graphs is not None and not s.graphs.capture  # a CPU: the padded step runs eagerly
        got = serve(s, requests, lambda i, new: Sampling(new, temperature=0))
        answers[name], preemptions[name] = [c.token_ids for c in got], s.preemptions
    assert answers["flex"] == answers["gather"] == answers["async"]  # async: ids fed from the device
    assert preemptions["flex"] > 0 and preemptions["async"] > 0
    with pytest.raises(EmberError, match="serve.paged_attention=dense"):
        Scheduler(engine, num_blocks=40, paged_attention="dense")
    assert isinstance(Scheduler(engine, num_blocks=8).cache, PagedKVCache)  # auto on a CPU: gather


def test_auto_attends_by_triton_on_cuda_and_by_gather_elsewhere(monkeypatch):
    """``serve.paged_attention=auto`` (the default): ember's kernel where the leases measured it
    fastest (CUDA with Triton, attention-only models); gather on a CPU or with Mamba layers;
    triton whenever the server is batch-invariant; a named road as named."""
    from ember import kernels
    from ember.infer.paged import attention_road

    for device in ("cpu", "cuda", "cuda:1"):
        want = "triton" if device != "cpu" and kernels.HAS_TRITON else "gather"
        assert attention_road("auto", device, False, False) == want
        assert attention_road("auto", device, True, False) == "gather"  # Mamba: no padded steps
        assert attention_road("auto", device, False, True) == "triton"
        assert attention_road("flex", device, False, False) == "flex"
    monkeypatch.setattr(kernels, "_ready", lambda kind: (False, "Triton is not installed"))
    assert attention_road("auto", "cuda", False, False) == "gather"
