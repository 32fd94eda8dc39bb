"""Batch invariance (ember.kernels.invariant, ``serve.batch_invariant``): the fixed-order product
against PyTorch's and row by row against itself; then a served request's logits against the
batch-1 engine's, bit for bit, with a control that shows the plain road differs. The kernels run
under Triton's interpreter here (gpu.sh kernels-test runs the product's test on a GPU)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytest.importorskip("triton", reason="the kernels are Triton's: pip install 'ember[kernels]'")
pytestmark = pytest.mark.filterwarnings("ignore:serve.paged_attention=triton on a CPU")

from ember.errors import EmberError  # noqa: E402
from ember.infer import engine as engine_module  # noqa: E402
from ember.infer import scheduler as scheduler_module  # noqa: E402
from ember.infer.engine import Engine  # noqa: E402
from ember.infer.sampling import Sampling  # noqa: E402
from ember.infer.scheduler import Scheduler  # noqa: E402
from ember.kernels import triton_ready  # noqa: E402
from ember.kernels.invariant import batch_invariant, matmul  # noqa: E402
from ember.model.quant import QuantSpec, quantize  # noqa: E402
from tests.test_scheduler import engine, serve  # noqa: E402, F401 (a fixture)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the kernels run: a GPU, or the interpreter
ready = pytest.mark.skipif(not triton_ready(DEVICE)[0], reason=triton_ready(DEVICE)[1])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float64, 1e-12)])  # noqa: E501
def test_the_product_equals_torch_and_a_row_is_the_same_bits_in_any_batch(dtype, tol):
    """70 x 100 @ (130 x 100)^T + bias: ragged against every block; then rows taken alone, in
    threes at other offsets, and inside a batch of 200 at the far end: the same bits."""
    torch.manual_seed(0)
    x = torch.randn(70, 100, device=DEVICE, dtype=dtype)
    w, b = torch.randn(130, 100, device=DEVICE, dtype=dtype), torch.randn(130, device=DEVICE, dtype=dtype)
    y = matmul(x, w.t(), b)
    want = x.double() @ w.double().t() + b.double()
    assert y.dtype == dtype and ((y.double() - want).abs() / want.abs().clamp(min=1)).max() < tol
    for rows in ([5], [6, 5, 69], list(range(37, 70))):
        alone = matmul(x[rows], w.t(), b)
        assert torch.equal(alone, y[rows])
    big = torch.cat([torch.randn(130, 100, device=DEVICE, dtype=dtype), x])
    assert torch.equal(matmul(big, w.t(), b)[130:], y)
    assert torch.equal(matmul(x, w.t().contiguous(), b), y)  # strides change the addresses, not the sums


def test_the_mode_runs_linear_addmm_and_mm_through_the_product_and_lets_the_rest_by():
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 40).to(DEVICE)
    x = torch.randn(3, 9, 48, device=DEVICE)
    for context in (torch.inference_mode, torch.enable_grad):  # linear whole, or as view + addmm
        with context(), batch_invariant():
            full, part = layer(x), layer(x[1:, 4:7])
        assert torch.equal(part, full[1:, 4:7]) and (full - layer(x)).abs().max() < 1e-5
    a, b, c = (torch.randn(*shape, device=DEVICE) for shape in ((5, 48), (48, 40), (5, 40)))
    ints = torch.randint(0, 9, (5, 48))  # (on the CPU: CUDA has no integer products)
    batch = torch.randn(2, 5, 48, device=DEVICE)
    with batch_invariant():
        scaled = torch.addmm(c, a, b, beta=0.5, alpha=2.0)  # a bias the kernel does not take: added after
        product = a @ b
        counted = ints @ ints.t()  # integers: PyTorch's own
        nan = torch.addmm(torch.full_like(c, float("nan")), a, b, beta=0)  # beta 0: the bias unread
        folded = batch @ b  # matmul: (10, 48) @ b, the product's rows
        with pytest.raises(EmberError, match="bmm"):
            torch.bmm(batch, batch.transpose(1, 2))
    with torch.inference_mode(), batch_invariant():  # where einsum and @ reach the mode whole
        with pytest.raises(EmberError, match="bmm"):
            torch.einsum("bij,bkj->bik", batch, batch)
        with pytest.raises(EmberError, match="mv"):
            a @ b[:, 0]
    assert (scaled - torch.addmm(c, a, b, beta=0.5, alpha=2.0)).abs().max() < 1e-4
    assert torch.equal(product, matmul(a, b)) and torch.equal(counted, ints @ ints.t())
    assert torch.equal(nan, matmul(a, b))
    assert torch.equal(folded, matmul(batch.view(10, 48), b).view(2, 5, 40))


def recorded(monkeypatch) -> list[torch.Tensor]:
    """Every logits tensor a greedy token is drawn from, by the engine or the scheduler, in order."""
    seen, draw = [], engine_module.sample_next

    def spy(logits, *args, **kwargs):
        seen.append(logits.clone())
        return draw(logits, *args, **kwargs)

    monkeypatch.setattr(engine_module, "sample_next", spy)
    monkeypatch.setattr(scheduler_module, "sample_next", spy)
    return seen


def on_device(engine: Engine) -> Engine:  # noqa: F811
    """The fixture's engine, or on a GPU machine a copy of its model there (the fixture's stays)."""
    if DEVICE == "cpu":
        return engine
    return Engine(copy.deepcopy(engine.model).to(DEVICE), engine.tokenizer)


@ready
def test_the_invariant_engine_gives_a_row_the_logits_it_has_alone(engine, monkeypatch):  # noqa: F811
    """Three prompts of 3, 11 and 18 tokens in one call (left pads), and 2 answers to one prompt
    (prefilled once, then copied): each row's logits the bits of its prompt run alone, with
    the graph road's static cache; the tokens those of PyTorch's own road."""
    seen, engine = recorded(monkeypatch), on_device(engine)
    inv = Engine(engine.model, engine.tokenizer, graphs=True, batch_invariant=True)  # (CUDA graphs on a GPU)
    prompts = [list(range(40, 43)), list(range(60, 71)), list(range(80, 98))]
    greedy = Sampling(4, temperature=0, ignore_eos=True)
    together = inv.generate(prompts, greedy)
    batched = torch.stack(seen)  # (steps, rows, V)
    for i, prompt in enumerate(prompts):
        seen.clear()
        [alone] = inv.generate([prompt], greedy)
        assert alone.token_ids == together[i].token_ids and torch.equal(torch.cat(seen), batched[:, i])
        assert alone.token_ids == engine.generate([prompt], greedy)[0].token_ids
    seen.clear()
    twice = inv.generate([prompts[1], prompts[1]], greedy)
    assert twice[0].token_ids == twice[1].token_ids == together[1].token_ids
    for step, together_step in zip(seen, batched, strict=True):
        assert torch.equal(step[0], step[1]) and torch.equal(step[0], together_step[1])


@pytest.mark.slow
@ready
def test_served_logits_equal_the_invariant_engine_bit_for_bit_and_the_plain_road_does_not(engine, monkeypatch):  # noqa: E501, F811
    """Five requests arriving over 3 steps into a pool of 7 blocks of 8 (preemptions), two of
    them sharing a 17-token prefix, prompt chunks of up to 24 tokens beside decodes, decode
    steps padded to buckets: every logit of
    every served token the bits of the batch-1 invariant engine's. With PyTorch's products in
    place of the fixed-order ones, the same run's logits differ in their last bits (on this CPU;
    on a GPU, whose steps replay from CUDA graphs there, cuBLAS may happen to agree)."""
    seen, engine = recorded(monkeypatch), on_device(engine)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 30))] for _ in range(5)]
    prompts[3] = prompts[1][:17] + prompts[3]  # a shared prefix: two blocks of 8 read from the cache
    requests = [(rng.randint(0, 3), prompt, rng.randint(1, 8)) for prompt in prompts]
    greedy = lambda i, n: Sampling(n, temperature=0, ignore_eos=True)  # noqa: E731
    mismatched = {}
    for invariant in (True, False):
        inv = Engine(engine.model, engine.tokenizer, batch_invariant=invariant)
        alone = []
        for i, (_, prompt, n) in enumerate(requests):
            seen.clear()
            alone.append((inv.generate([prompt], greedy(i, n))[0].token_ids, torch.cat(seen)))
        s = Scheduler(inv, num_blocks=7, block_size=8, max_batch_tokens=24, max_seqs=4,
                      paged_attention="triton", decode_buckets=(1, 2, 4), batch_invariant=invariant)
        served: dict[int, list[torch.Tensor]] = {}
        take = s._take

        def spy(request, logits, token, served=served, take=take):
            served.setdefault(request.id, []).append(logits)
            return take(request, logits, token)

        s._take = spy
        got = serve(s, requests, greedy)
        assert s.preemptions > 0
        order = [i for i, _ in sorted(enumerate(requests), key=lambda r: r[1][0])]  # ids: arrival order
        logits = {order[r]: torch.stack(rows) for r, rows in served.items()}
        assert [c.token_ids for c in got] == [tokens for tokens, _ in alone]
        mismatched[invariant] = [i for i, (_, mine) in enumerate(alone) if not torch.equal(logits[i], mine)]
    assert mismatched[True] == [] and (mismatched[False] != [] or DEVICE != "cpu")


def test_batch_invariance_is_refused_where_it_cannot_hold(engine):  # noqa: F811
    with pytest.raises(EmberError, match="paged_attention=triton"):
        Scheduler(engine, num_blocks=8, paged_attention="gather", batch_invariant=True)
    for kwargs in ({"compile": True}, {"kernels": "triton"}):
        with pytest.raises(EmberError, match="drop compile"):
            Engine(engine.model, engine.tokenizer, batch_invariant=True, **kwargs)
    quantized = quantize(copy.deepcopy(engine.model), QuantSpec("int8-weight"))
    with pytest.raises(EmberError, match="float weights"):
        Engine(quantized, engine.tokenizer, batch_invariant=True)
