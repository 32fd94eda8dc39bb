"""ember's own paged-attention kernel (``serve.paged_attention=triton``) against its reference and
against the gather cache, and the scheduler's padded steps over it (the shapes CUDA graphs
replay) against unpadded ones. The kernel runs under Triton's interpreter here."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton", reason="the kernel is Triton's: pip install 'ember[kernels]'")
pytestmark = pytest.mark.filterwarnings("ignore:serve.paged_attention=triton on a CPU")

from ember.errors import EmberError  # noqa: E402
from ember.infer.paged import BlockManager, PagedSequence, TritonPagedKVCache  # noqa: E402
from ember.infer.sampling import Sampling  # noqa: E402
from ember.infer.scheduler import Scheduler  # noqa: E402
from ember.kernels import triton_ready  # noqa: E402
from ember.kernels.paged import paged_attention, paged_ref, tiles_for  # noqa: E402
from tests import test_paged_flex  # noqa: E402 (its scenario, not its tests: imported as a module)
from tests.test_scheduler import engine, serve  # noqa: E402, F401 (a fixture)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel's (gpu.sh kernels-test runs it there)
# the cache's tests run the model on the CPU, so the kernel under the interpreter: not on a GPU machine
on_cpu = pytest.mark.skipif(not triton_ready("cpu")[0], reason=triton_ready("cpu")[1])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_kernel_equals_its_reference(dtype, tol):
    """Three sequences' keys scattered over a shuffled pool in blocks of 4: a 21-token prompt
    chunk (two tiles, the second ragged), a 1-token decode at position 70 (three 32-key tiles,
    the last ragged), a chunk of 3 continuing at 5, and two pads (no tile: zeros out); 4 query
    heads over 2 key heads."""
    torch.manual_seed(0)
    H, Hkv, hd, bs, num_blocks = 4, 2, 16, 4, 40
    k_pool = torch.randn(num_blocks * bs + 1, Hkv, hd).to(DEVICE, dtype)
    v_pool = torch.randn(num_blocks * bs + 1, Hkv, hd).to(DEVICE, dtype)
    order = torch.randperm(num_blocks).int()
    lengths = [21, 71, 8]
    tables, used = torch.zeros(4, 20, dtype=torch.int32), 0
    for i, n in enumerate(lengths):
        held = -(-n // bs)
        tables[i, :held] = order[used : used + held]
        used += held
    q_pos = torch.tensor([*range(21), 70, 5, 6, 7, 0, 0], device=DEVICE)
    tiles = tiles_for([21, 1, 3], 6)
    assert tiles.tolist() == [[0, 0, 1, 2, 0, 0], [0, 16, 21, 22, 0, 0], [16, 5, 1, 3, 0, 0]]
    tiles, tables = tiles.to(DEVICE), tables.to(DEVICE)
    q = torch.randn(len(q_pos), H, hd).to(DEVICE, dtype)
    got = paged_attention(q, k_pool, v_pool, tables, q_pos, tiles, bs)
    want = paged_ref(q, k_pool, v_pool, tables, q_pos, tiles, bs)
    assert (got.float() - want.float()).abs().max() < tol
    assert got[-2:].abs().max() == 0 and want[:-2].abs().max() > 0.1
    if dtype == torch.float32:  # the registered op, traced whole by torch.compile (its fake gives the shape)
        compiled = torch.compile(paged_attention, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(q, k_pool, v_pool, tables, q_pos, tiles, bs), got)


@on_cpu
def test_triton_equals_gather_on_ragged_rows_sharing_prefix_blocks():
    """flex's scenario (tests/test_paged_flex.py) with the triton cache in its place, for RoPE and
    GQA: ragged chunks, shared prefix blocks, a fork's copy-on-write, freed blocks reused (stale
    keys in them): logits within 1e-5, the same greedy ids."""
    test_paged_flex.test_flex_equals_gather_on_ragged_rows_sharing_prefix_blocks(
        "rope-gqa", other=lambda blocks: TritonPagedKVCache(blocks, max_len=64)
    )


@on_cpu
def test_padded_steps_equal_unpadded_ones_and_the_scheduler_equals_gather(engine):  # noqa: F811
    """Every step of the graph road over the triton cache (decode-only steps padded to a batch
    bucket, mixed steps to a token bucket, logits picked by index) against the same step
    unpadded, within 1e-5, with async steps (each step's ids fed from the last draw on the
    device); then the scheduler in a pool small enough to preempt: every greedy
    answer equal to the gather cache's, every block free at the end."""
    s = Scheduler(engine, num_blocks=60, block_size=8, max_batch_tokens=40, max_seqs=8,
                  paged_attention="triton", decode_buckets=(1, 2, 4), async_steps=True)  # fmt: skip
    assert s.graphs is not None and not s.graphs.capture  # a CPU: the padded step runs eagerly
    padded, kinds = s.graphs, []

    def both(work, drawn=None):
        logits, plain = padded(work, drawn), s._forward(work, drawn)
        kinds.append(all(n == 1 for _, n in work))
        assert logits.shape == plain.shape and (logits - plain).abs().max() < 1e-5
        return logits

    s.graphs = both
    rng = random.Random(2)  # 4 requests of up to 24 prompt tokens arriving one a step: chunks beside decodes
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 24))] for _ in range(4)]
    greedy = lambda i, n: Sampling(n, temperature=0)  # noqa: E731
    serve(s, [(i, p, rng.randint(1, 8)) for i, p in enumerate(prompts)], greedy)
    assert any(kinds) and not all(kinds)  # both roads taken

    rng = random.Random(1)  # 6 requests of up to 20 + 12 tokens, 5 blocks of 8: preemptions
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    requests = [(rng.randint(0, 2), prompt, rng.randint(1, 12)) for prompt in prompts]
    answers = {}
    for kind, buckets in [("gather", None), ("triton", (1, 2, 4, 8))]:
        s = Scheduler(engine, num_blocks=5, block_size=8, max_batch_tokens=64, max_seqs=8,
                      paged_attention=kind, decode_buckets=buckets)  # fmt: skip
        answers[kind] = [c.token_ids for c in serve(s, requests, greedy)]
        assert kind == "gather" or s.preemptions > 0
    assert answers["triton"] == answers["gather"]


@on_cpu
@pytest.mark.filterwarnings("default")
def test_a_table_too_narrow_or_no_max_len_is_refused_and_a_cpu_is_warned_of():
    blocks = BlockManager(8, 4)
    with pytest.raises(EmberError, match="max_seq_len"):
        TritonPagedKVCache(blocks)
    with pytest.warns(UserWarning, match="interpreter"):
        cache = TritonPagedKVCache(blocks, max_len=8)
    seq = PagedSequence(list(range(12)))
    blocks.admit(seq)
    blocks.reserve(seq, 12)
    with pytest.raises(AssertionError, match="a table holds 2"):
        cache.plan([(seq, 12)])
