"""The generation engine: KV-cache parity with the full forward, sampling filters,
determinism, stopping, prompt-length errors, streaming text, loading from a run."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from ember.config import ModelConfig
from ember.data.tokenizer import Tokenizer
from ember.errors import EmberError
from ember.infer.engine import TUNED, Engine, KVCache, StaticKVCache, _held_back, filter_logits, sample_next
from ember.infer.sampling import Sampling
from ember.model.gpt import GPT
from ember.run import export_weights

LLAMA = {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}
LAYOUTS = {
    "learned-mha": {},
    "learned-gqa": {"n_kv_head": 2},
    "rope-mha": LLAMA,
    "rope-gqa": {**LLAMA, "n_kv_head": 2},
    "rope-mqa-qknorm": {**LLAMA, "n_kv_head": 1, "qk_norm": True},
}
TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def main():\n    return sum(x * x for x in range(10))\n" * 4,
    "Héllo wörld — naïve café, 😀 emoji and ünïcödé text. " * 4,
]


def tiny_cfg(vocab_size: int = 64, **overrides) -> ModelConfig:
    # init_std 0.1: logits reach ~3, so a bound of 1e-5 is a few fp32 ulps and means something
    # (at 0.2 they reach ~7 and honest roundoff from the differently shaped matmuls nears 1e-5)
    base = dict(vocab_size=vocab_size, n_layer=2, n_head=4, d_model=64, max_seq_len=64, init_std=0.1)
    return ModelConfig(**{**base, **overrides})


def tiny_model(vocab_size: int = 64, **overrides) -> GPT:
    return GPT.build(tiny_cfg(vocab_size, **overrides), seed=0).eval()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train_bpe(TEXT, 300)


def assert_rows_match_alone(model: GPT, cached: torch.Tensor, history: torch.Tensor, pad: list[int]) -> float:
    """cached (B, T, V): logits of the last T slots of history (B, S), rows left-padded by
    ``pad``. Each row's real slots must equal a forward over that row alone, unpadded;
    returns the largest |diff|."""
    B, T, _ = cached.shape
    first_new = history.size(1) - T
    worst = 0.0
    for b in range(B):
        first = max(first_new, pad[b])  # the new slots that hold real tokens
        if first < history.size(1):
            alone = model(history[b : b + 1, pad[b] :])[0]  # (S - pad[b], V), no cache, no padding
            diff = cached[b, first - first_new :] - alone[first - pad[b] :]
            worst = max(worst, diff.abs().max().item())
    return worst


class Recorder(nn.Module):
    """Wraps a model; on every cached call, checks each row's logits against a full forward
    over that row's own tokens so far (without its left padding) and keeps the largest
    difference."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model, self.cfg = model, model.cfg
        self.seen: dict[int, tuple[KVCache, torch.Tensor]] = {}
        self.max_diff, self.max_logit, self.calls, self.padded_calls = 0.0, 0.0, 0, 0

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        assert cache is not None and cache.pos == self.seen.get(id(cache), (None, idx[:, :0]))[1].size(1)
        logits = self.model(idx, cache=cache)
        _, history = self.seen.get(id(cache), (cache, idx[:, :0]))
        history = torch.cat([history, idx], dim=1)  # (B, S)
        self.seen[id(cache)] = (cache, history)
        pad = [0] * idx.size(0) if cache.pad is None else cache.pad.tolist()
        self.max_diff = max(self.max_diff, assert_rows_match_alone(self.model, logits, history, pad))
        self.max_logit = max(self.max_logit, logits.abs().max().item())
        self.calls += 1
        self.padded_calls += any(pad)
        return logits


class Scripted(nn.Module):
    """Wraps a model and forces the i-th generated token of every row to be ``script[i]``."""

    def __init__(self, model: GPT, script: list[int]) -> None:
        super().__init__()
        self.model, self.cfg, self.script = model, model.cfg, script
        self.steps: dict[int, tuple[KVCache, int]] = {}  # id(cache) -> (cache, tokens generated)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        assert cache is not None
        _, step = self.steps.get(id(cache), (cache, 0))
        self.steps[id(cache)] = (cache, step + 1)
        logits = self.model(idx, cache=cache)
        logits[:, -1] = float("-inf")
        logits[:, -1, self.script[step]] = 0.0
        return logits


# ---------------------------------------------------------------------------
# KV cache parity
# ---------------------------------------------------------------------------


CACHES = {"eager": KVCache, "static": StaticKVCache}


@pytest.mark.parametrize("cache_type", CACHES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cache_matches_full_forward_at_every_step(layout, cache_type):
    model = tiny_model(**LAYOUTS[layout])
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 64, (3, 40), generator=g)
    cache = CACHES[cache_type](max_len=40)
    worst, largest = 0.0, 0.0
    with torch.inference_mode():
        # prefill 10, a chunk of 5 (queries after a cache: bottom-right causal mask), then one at a time
        cuts = [0, 10, 15, *range(16, 41)]
        for a, b in zip(cuts, cuts[1:], strict=False):
            cached = model(seq[:, a:b], cache=cache)  # (3, b - a, V)
            full = model(seq[:, :b])[:, a:b]
            worst = max(worst, (cached - full).abs().max().item())
            largest = max(largest, full.abs().max().item())
    assert int(cache.pos) == 40 and largest > 1
    assert worst <= 1e-5, f"{layout}: cached vs full max |diff| {worst:.2e}"


@pytest.mark.parametrize("cache_type", CACHES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_left_padded_rows_match_each_row_alone_at_every_step(layout, cache_type):
    # A ragged batch in one cache: row b is its own sequence after pad[b] pad slots. Chunks
    # cross the pad boundary (prefill 10 holds only pads for row 2), then one token at a time.
    model = tiny_model(**LAYOUTS[layout])
    g = torch.Generator().manual_seed(2)
    pad = [0, 7, 12]
    seq = torch.randint(0, 64, (3, 40), generator=g)
    for b, n in enumerate(pad):
        seq[b, :n] = 63  # any id: the mask must hide it
    Cache = CACHES[cache_type]
    cache = Cache(max_len=40, pad=pad)
    worst, largest = 0.0, 0.0
    with torch.inference_mode():
        cuts = [0, 10, 15, *range(16, 41)]
        for a, b in zip(cuts, cuts[1:], strict=False):
            cached = model(seq[:, a:b], cache=cache)  # (3, b - a, V)
            assert torch.isfinite(cached).all()
            worst = max(worst, assert_rows_match_alone(model, cached, seq[:, :b], pad))
            largest = max(largest, cached.abs().max().item())
        # and the pad ids do not matter: other pad ids, same logits for the real slots
        other = seq.clone()
        for b, n in enumerate(pad):
            other[b, :n] = 5
        again = model(other, cache=Cache(max_len=40, pad=pad))
        first = model(seq, cache=Cache(max_len=40, pad=pad))
    for b, n in enumerate(pad):
        torch.testing.assert_close(again[b, n:], first[b, n:], rtol=0, atol=1e-6)
    assert largest > 1
    assert worst <= 1e-5, f"{layout}: padded cached vs row alone max |diff| {worst:.2e}"


def test_cache_positions_and_mask_for_padded_rows():
    cache = KVCache(max_len=6, pad=[0, 2])
    assert cache.extend(4).tolist() == [[0, 1, 2, 3], [0, 0, 0, 1]]
    assert cache.mask.shape == (2, 1, 4, 4)
    assert cache.mask[0, 0].tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()
    assert cache.mask[1, 0].int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert cache.extend(1).tolist() == [[4], [2]] and cache.mask[1, 0].int().tolist() == [[0, 0, 1, 1, 1]]
    plain = KVCache(max_len=6, pad=[0, 0])
    assert plain.extend(4).tolist() == [0, 1, 2, 3] and plain.mask is None
    static, eager = StaticKVCache(max_len=6, pad=[0, 2]), KVCache(max_len=6, pad=[0, 2])
    assert static.extend(4).tolist() == eager.extend(4).tolist()
    assert static.mask.shape == (2, 1, 4, 6)  # the same mask over all 6 slots, the unwritten ones hidden
    assert torch.equal(static.mask[..., :4], eager.mask) and not static.mask[..., 4:].any()
    with pytest.raises(ValueError):
        KVCache(max_len=6, pad=[0, 6])


class Unweighted(nn.Module):
    """A linear behind a wrapper with no ``.weight`` (as a LoRA, quantized or packed linear)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.inner = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("cache_type", CACHES)
def test_cache_is_sized_from_the_keys_it_receives(cache_type):
    model = tiny_model(**LLAMA, n_kv_head=2)
    for layer in model.layers.values():
        layer.attention.wk = Unweighted(layer.attention.wk)
    seq = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    cache = CACHES[cache_type](max_len=9)
    with torch.inference_mode():
        steps = [model(seq[:, :5], cache=cache)]
        steps += [model(seq[:, t : t + 1], cache=cache) for t in range(5, 9)]
        full = model(seq)
    assert set(cache.k) == {"0", "1"}
    assert cache.k["0"].shape == cache.v["1"].shape == (2, 2, 9, 16)  # (B, n_kv_head, max_len, head_dim)
    assert full.abs().max() > 1
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5
    if cache_type == "eager":
        with pytest.raises(IndexError), torch.inference_mode():
            model(seq[:, :1], cache=cache)  # all 9 slots are held


def test_static_cache_decode_compiles_to_one_graph_that_matches_the_eager_cache():
    # fullgraph=True raises on any graph break. The position is a tensor and the shapes never
    # change, so every step, and a second cache of the same size, runs the one graph.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = tiny_model(**LLAMA, n_kv_head=2)
    counter = CompileCounterWithBackend("inductor")
    decode = torch.compile(model, backend=counter, fullgraph=True)
    seq = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(5))
    worst, largest, graphs = 0.0, 0.0, []
    with torch.inference_mode():
        for pad in ([0, 3], [0, 3], None):
            static, eager = StaticKVCache(max_len=20, pad=pad), KVCache(max_len=20, pad=pad)
            model(seq[:, :8], cache=static), model(seq[:, :8], cache=eager)  # the prefill, eager
            for t in range(8, 20):
                got, want = decode(seq[:, t : t + 1], cache=static), model(seq[:, t : t + 1], cache=eager)
                worst = max(worst, (got - want).abs().max().item())
                largest = max(largest, want.abs().max().item())
            graphs.append(counter.frame_count)
    assert graphs == [1, 1, 2]  # 12 steps of two padded caches: one graph; no pads (pad shape 1): one more
    assert largest > 1 and worst <= 1e-5, f"compiled static vs eager cache max |diff| {worst:.2e}"


def test_compiled_training_blocks_run_eagerly_with_a_cache():
    """train.compile=true compiles each block for training's fixed shapes; a forward with a KV
    cache (GRPO's rollouts, evaluation by generation) must not trace them: every step's shapes and
    cache state differ, and GRPO with compiled blocks stopped at dynamo's recompile limit. With
    a cache the blocks run eagerly and give the eager model's logits; without one, compiled."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from ember.parallel.parallelize import apply_compile

    torch._dynamo.reset()
    eager = tiny_model(**LLAMA, n_kv_head=2)
    model = tiny_model(**LLAMA, n_kv_head=2)
    counter = CompileCounterWithBackend("eager")
    real = torch.compile
    try:  # apply_compile as the trainer calls it, counting what dynamo traces
        torch.compile = lambda m, **kw: real(m, backend=counter, **kw)
        apply_compile(model)
    finally:
        torch.compile = real
    seq = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache, reference = KVCache(max_len=24), KVCache(max_len=24)
        for a, b in [(0, 9), *((t, t + 1) for t in range(9, 24))]:  # 16 shapes and cache states
            torch.testing.assert_close(model(seq[:, a:b], cache=cache), eager(seq[:, a:b], cache=reference))
        assert counter.frame_count == 0  # nothing traced: the cache forwards ran eagerly
        torch.testing.assert_close(model(seq), eager(seq))
    assert counter.frame_count == 1  # the training-shaped forward: one graph, shared by the blocks


def test_compiled_engine_generates_what_the_eager_engine_does(tok):
    model = tiny_model(vocab_size=320, **LLAMA)
    prompts = ["The quick", "def main():\n", "fox"]
    greedy = Sampling(max_new_tokens=12, temperature=0)
    eager = Engine(model, tok).generate(prompts, greedy)
    assert Engine(model, tok, compile=True).generate(prompts, greedy) == eager


def test_tuned_compile_generates_what_the_eager_engine_does(tok):
    """compile_options=TUNED (frozen weights, q/k/v fused, kernels picked by timing): the same
    greedy tokens as the eager engine; the frozen graph reads the weights of its compile."""
    model = tiny_model(vocab_size=320, **LLAMA)
    prompts, greedy = ["The quick", "def main():\n"], Sampling(max_new_tokens=12, temperature=0)
    tuned = Engine(model, tok, compile=True, compile_options=TUNED)  # (generate runs in inference mode)
    assert tuned.generate(prompts, greedy) == Engine(model, tok).generate(prompts, greedy)


def test_compiled_engines_of_two_models_keep_their_own_graphs(tok):
    """The compiled step drops dynamo's guards on the model, so each engine's step must be a code
    object of its own: two models with the same parameters and cache shapes but a different
    logit soft-cap (a constant baked into the graph) would otherwise share one graph, silently."""
    a = tiny_model(vocab_size=320, **LLAMA)
    b = tiny_model(vocab_size=320, logit_softcap=0.05, **LLAMA)
    sampled = Sampling(max_new_tokens=12, temperature=1.0, seed=0)
    want = [Engine(m, tok).generate(["The quick"], sampled) for m in (a, b)]
    assert want[0] != want[1]
    compiled = [Engine(m, tok, compile=True) for m in (a, b)]
    for _ in range(2):  # and again, each engine's graph is found again
        assert [e.generate(["The quick"], sampled) for e in compiled] == want


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_parity_for_a_batch_of_mixed_length_prompts(tok, layout):
    recorder = Recorder(tiny_model(vocab_size=320, **LAYOUTS[layout]))
    engine = Engine(recorder, tok)
    prompts = ["The quick", "The lazy", "def main():\n", "The dog", "Héllo wörld 😀", "fox jumps"]
    lengths = {len(tok.encode(p)) for p in prompts}
    assert len(lengths) < len(prompts) and len(lengths) > 1  # shared and distinct lengths
    out = engine.generate(prompts, Sampling(max_new_tokens=20, temperature=1.0, seed=3, ignore_eos=True))
    assert recorder.calls == 20 and recorder.padded_calls == recorder.calls  # one ragged stream
    assert recorder.max_logit > 1 and recorder.max_diff <= 1e-5, f"max |diff| {recorder.max_diff:.2e}"
    assert all(len(c.token_ids) == 20 for c in out)


def greedy_without_cache(model: GPT, ids: list[int], n: int, tok: Tokenizer) -> list[int]:
    """The plain path: a full forward per token, greedy over the tokenizer's ids, ending where the
    engine ends a row (``<|eos|>`` or ``<|end_turn|>``)."""
    ends, n_valid = {tok.eos_id, tok.hf.token_to_id("<|end_turn|>")}, tok.vocab_size
    seq = torch.tensor([ids])
    out = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(seq)[0, -1, :n_valid]
            nxt = int(logits.argmax())
            if nxt in ends:
                break
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return out


def test_batched_greedy_equals_each_prompt_alone_and_the_uncached_loop(tok):
    model = tiny_model(vocab_size=320, **LLAMA)
    engine = Engine(model, tok)
    prompts = ["The quick", "def main():\n", "fox", "The lazy", "café 😀"]
    batch = engine.generate(prompts, Sampling(max_new_tokens=16, temperature=0))
    for prompt, got in zip(prompts, batch, strict=True):
        [alone] = engine.generate([prompt], Sampling(max_new_tokens=16, temperature=0))
        assert got == alone
        ref = greedy_without_cache(model, tok.encode(prompt), 16, tok)
        assert got.token_ids == ref


class Rows(nn.Module):
    """Wraps a model and records the number of rows of every call."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model, self.cfg, self.rows = model, model.cfg, []

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        self.rows.append(idx.size(0))
        return self.model(idx, cache=cache)


@pytest.mark.parametrize("compile", [False, True])
def test_repeated_prompts_are_prefilled_once_and_sample_as_rows_of_their_own(tok, compile):
    """GRPO's group: G rows of one prompt prefill one row, then decode apart; every row gives
    what it gives alone with its seed (seed + row), greedy rows included."""
    rows = Rows(tiny_model(vocab_size=320, **LLAMA))
    engine = Engine(rows, tok, compile=compile)
    prompts = ["The quick"] * 3 + ["def main():\n"] * 2 + ["fox"]
    for temperature in (1.0, 0.0):
        rows.rows.clear()
        sampling = Sampling(max_new_tokens=12, temperature=temperature, seed=5, ignore_eos=True)
        batch = engine.generate(prompts, sampling)
        assert rows.rows[0] == 3 and (compile or set(rows.rows[1:]) == {6})  # 3 distinct prompts
        for i, (prompt, got) in enumerate(zip(prompts, batch, strict=True)):
            [alone] = engine.generate([prompt], dataclasses.replace(sampling, seed=5 + i))
            assert got == alone
    sampled = engine.generate(prompts, Sampling(max_new_tokens=12, temperature=1.0, seed=5))
    assert len({tuple(c.token_ids) for c in sampled[:3]}) > 1  # one prefill, different samples


# ---------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 1.5, -0.5]])


def draws(n: int = 4000, **kwargs) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.cat([sample_next(LOGITS.expand(n, -1), generator=g, **kwargs)])


def test_greedy_is_argmax():
    assert sample_next(LOGITS, temperature=0).tolist() == [3]
    assert sample_next(LOGITS, temperature=0, top_k=1, top_p=0.1).tolist() == [3]


def test_top_k_samples_exactly_the_k_largest_with_renormalised_probabilities():
    got = draws(top_k=3)
    assert set(got.tolist()) == {3, 0, 6}  # logits 3.0, 2.0, 1.5
    kept = LOGITS[0, [3, 0, 6]]
    expected = (kept.exp() / kept.exp().sum()).tolist()
    freq = [(got == i).float().mean().item() for i in (3, 0, 6)]
    for f, p in zip(freq, expected, strict=True):
        assert abs(f - p) < 0.03
    probs = filter_logits(LOGITS, top_k=3).softmax(-1)
    assert torch.allclose(
        probs[0, [3, 0, 6]], torch.tensor(expected)
    ) and probs.sum().item() == pytest.approx(1)


def test_top_p_samples_exactly_the_nucleus():
    probs = LOGITS[0].softmax(-1)
    order = probs.argsort(descending=True).tolist()  # [3, 0, 6, 1, 2, 5, 7, 4]
    cum = probs[order].cumsum(0).tolist()
    top_p = (cum[2] + cum[3]) / 2  # needs the 4th token to reach it, clear of the boundaries
    nucleus = set(order[:4])
    got = draws(top_p=top_p)
    assert set(got.tolist()) == nucleus
    kept = filter_logits(LOGITS, top_p=top_p)
    assert set(torch.isfinite(kept[0]).nonzero().flatten().tolist()) == nucleus
    # top-k first, then top-p on the renormalised top-k distribution: the top 2 of
    # softmax([3, 2, 1.5]) = [.63, .23, .14] reach 0.8, so token 6 is dropped
    assert set(draws(top_k=3, top_p=0.8).tolist()) == {3, 0}
    # a tiny top_p keeps the most likely token
    assert set(draws(n=200, top_p=1e-6).tolist()) == {3}


def test_temperature_flattens_and_sharpens():
    cold = (draws(temperature=0.2) == 3).float().mean().item()
    hot = (draws(temperature=5.0) == 3).float().mean().item()
    assert cold > 0.9 and hot < 0.35


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"temperature": math.nan},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"max_new_tokens": 0},
        {"stop": ["ok", ""]},
    ],
)
def test_bad_sampling_arguments_raise(kwargs):
    with pytest.raises(EmberError):
        Sampling(**kwargs)


def test_greedy_is_deterministic_and_seeds_reproduce(tok):
    engine = Engine(tiny_model(vocab_size=320), tok)
    prompts = ["The quick", "def"]
    a = engine.generate(prompts, Sampling(24, temperature=0))
    assert a == engine.generate(prompts, Sampling(24, temperature=0, seed=123))
    s1 = engine.generate(prompts, Sampling(24, temperature=1.0, seed=1))
    assert s1 == engine.generate(prompts, Sampling(24, temperature=1.0, seed=1))
    s2 = engine.generate(prompts, Sampling(24, temperature=1.0, seed=2))
    assert [c.token_ids for c in s1] != [c.token_ids for c in s2]
    # a row samples with seed + row, whatever else is in the batch
    [alone] = engine.generate(["def"], Sampling(24, temperature=1.0, seed=2))
    assert alone == s1[1]


def test_seeds_beyond_the_generator_range_raise(tok):
    engine = Engine(tiny_model(vocab_size=320), tok)
    top = 2**64 - 1
    assert len(engine.generate(["a", "b"], Sampling(2, seed=top - 1))) == 2  # rows take top - 1 and top
    for seed, prompts in ((top, ["a", "b"]), (2**64, ["a"]), (-(2**63) - 1, ["a"])):
        with pytest.raises(EmberError, match="out of range"):
            engine.generate(prompts, Sampling(2, seed=seed))


def test_ids_beyond_the_tokenizer_are_never_sampled(tok):
    model = tiny_model(vocab_size=320)
    with torch.no_grad():  # make the 20 padding ids of the vocab by far the most likely
        model.output.weight[300:] = model.output.weight[300:] * 0 + model.tok_embeddings.weight.mean(0) * 1e3
    out = Engine(model, tok).generate(["The"], Sampling(16, temperature=2.0))
    assert all(i < 300 for i in out[0].token_ids)


# ---------------------------------------------------------------------------
# Stopping and streaming
# ---------------------------------------------------------------------------


def scripted_engine(tok: Tokenizer, text: str, then: list[int] | None = None) -> Engine:
    script = tok.encode(text) + (then if then is not None else [tok.encode(".")[0]] * 64)
    return Engine(Scripted(tiny_model(vocab_size=320), script), tok)


def test_stops_on_eos(tok):
    engine = scripted_engine(tok, "the lazy dog", then=[tok.eos_id] + [5] * 64)
    [c] = engine.generate(["The"], Sampling(30))
    assert c.text == "the lazy dog" and c.finish_reason == "eos"
    assert c.token_ids == tok.encode("the lazy dog")


def test_stops_on_a_stop_string_across_tokens_and_excludes_it(tok):
    engine = scripted_engine(tok, "return x\n\ndef main")
    [c, d] = engine.generate(["def", "The quick"], Sampling(30, stop=["\n\n", "zzz"]))
    assert c.text == d.text == "return x" and c.finish_reason == "stop"
    [e] = engine.generate(["def"], Sampling(30, stop="main"))  # a single string works too
    assert e.text == "return x\n\ndef " and e.finish_reason == "stop"
    [f] = engine.generate(["def"], Sampling(5, stop=["never"]))
    assert f.finish_reason == "length" and len(f.token_ids) == 5


def llama_style_tokenizer() -> Tokenizer:
    """A SentencePiece-style tokenizer as imported Llama checkpoints bring: byte-fallback tokens,
    "▁" for spaces, and a decoder that strips the text's first space, so a token's text depends
    on whether it comes first."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    words = ["▁", "▁the", "▁a", "b", "é", "▁x"]
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *words]
    hf = HFTokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True))
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return Tokenizer(hf, {"bos": "<s>", "eos": "</s>", "unk": "<unk>"})


@pytest.mark.parametrize("kind", ["ember-bpe", "llama-style"])
def test_the_incremental_decoder_equals_decoding_every_id(tok, kind):
    """``Row.decoded`` reads a window of the latest ids, where the old road decoded them all at
    every token: after each id it must equal ``decode(ids)`` exactly, over random ids that split
    multi-byte characters (byte tokens, a 4-byte emoji's bytes one by one) and, for the
    SentencePiece-style decoder, leading spaces that it strips only from the text's start. And
    ``push`` must emit the same pieces and stop where it did, on the same ids, with stop
    strings."""
    import random

    from ember.infer.engine import Row

    tokenizer = tok if kind == "ember-bpe" else llama_style_tokenizer()
    rng = random.Random(0)
    specials = {tokenizer.eos_id}
    pool = [i for i in range(3, tokenizer.vocab_size) if i not in specials]
    if kind == "llama-style":  # its words 3 times in 4 (random byte tokens are mostly not UTF-8)
        pool += [tokenizer.vocab_size - 1 - i for i in range(6)] * 150
    emoji = tokenizer.encode("😀 é") if kind == "ember-bpe" else [3 + b for b in "😀".encode()]
    windows = 0
    for trial in range(40):
        ids = []
        for _ in range(60):
            ids += emoji if rng.random() < 0.1 else [rng.choice(pool)]
        row = Row(0, [], 0, None)
        for n, token in enumerate(ids, 1):
            row.ids.append(token)
            assert row.decoded(tokenizer) == tokenizer.decode(ids[:n]), (kind, trial, n)
        windows += row.start > 0
        stop = [tokenizer.decode(ids[20:23]), "é"]
        old, new = Row(0, [], 0, None), Row(0, [], 0, None)
        for token in ids:
            got = new.push(token, tokenizer, specials, stop, 50)
            # the old road, inlined: decode every id, search the whole text
            if old.finish_reason is None:
                old.ids.append(token)
                full = tokenizer.decode(old.ids)
                hits = [i for i in (full.find(s) for s in stop) if i >= 0]
                if hits:
                    old.finish_reason, full = "stop", full[: max(min(hits), len(old.text))]
                elif len(old.ids) == 50:
                    old.finish_reason = "length"
                end = len(full) if old.finish_reason else len(full) - _held_back(full, stop)
                want = full[len(old.text) : end] if end > len(old.text) else ""
                old.text += want
            else:
                want = ""
            assert got == want, (kind, trial)
        assert (new.text, new.finish_reason) == (old.text, old.finish_reason)
    # every row's window moved on: the decoder did not fall back to whole decodes (a run of byte
    # tokens that is not UTF-8 decodes to one U+FFFD each, a text that only its end decides, and
    # holds the window where it is until a word token ends the run)
    assert windows == 40


@pytest.mark.parametrize("graphs", [False, True], ids=["cache", "graphed-wrapper"])
def test_lookahead_generates_what_one_token_at_a_time_does(tok, graphs):
    """``generate`` with ``lookahead`` k (CUDA's default 8: k steps between reads of the device)
    against k = 1: the same completions for mixed-length prompts, greedy, seeded sampling, a stop
    string and a length that k does not divide; and an end id inside a chunk ends its row there
    while the row beside it goes on."""
    model, prompts = tiny_model(vocab_size=320), ["The quick", "A", "def main():"]
    one, ahead = Engine(model, tok, graphs=graphs), Engine(model, tok, graphs=graphs)
    assert one.lookahead == 1  # a CPU: nothing to overlap
    ahead.lookahead = 5
    samplings = [Sampling(13, temperature=0), Sampling(13, temperature=0.9, seed=3), Sampling(12, stop=["e"])]
    for sampling in samplings:
        assert one.generate(prompts, sampling) == ahead.generate(prompts, sampling)
    engine = scripted_engine(tok, "the lazy dog", then=[tok.eos_id] + [5] * 64)
    engine.lookahead = 4
    [c] = engine.generate(["The"], Sampling(30))
    assert c.text == "the lazy dog" and c.finish_reason == "eos" and c.token_ids == tok.encode("the lazy dog")


def test_stream_pieces_join_to_the_text_and_never_split_characters(tok):
    text = "Héllo wörld 😀 café\n\nrest"
    engine = scripted_engine(tok, text)
    prompts = ["The", "def main", "fox"]
    pieces: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for row, piece in engine.stream(prompts, Sampling(40, stop=["\n\n"])):
        assert piece and "\ufffd" not in piece and "\n" not in piece  # held back, then cut
        pieces[row].append(piece)
    completions = engine.generate(prompts, Sampling(40, stop=["\n\n"]))
    for row, c in enumerate(completions):
        assert "".join(pieces[row]) == c.text == "Héllo wörld 😀 café"
        assert len(pieces[row]) > 3  # incremental, not one piece at the end
    # the emoji is several byte tokens; it was never emitted half-done
    assert len(tok.encode("😀")) > 1


def test_stream_checks_arguments_before_the_first_step(tok):
    engine = Engine(tiny_model(vocab_size=320), tok)
    with pytest.raises(EmberError, match="empty"):
        engine.stream([""], Sampling(4))
    with pytest.raises(EmberError, match="stop string"):
        engine.stream(["a"], Sampling(4, stop=[""]))


# ---------------------------------------------------------------------------
# Prompt length
# ---------------------------------------------------------------------------


def test_prompt_too_long_raises_and_truncate_keeps_the_tail(tok):
    model = tiny_model(vocab_size=320)  # max_seq_len 64
    engine = Engine(model, tok)
    prompt = TEXT[1]
    ids = tok.encode(prompt)
    assert len(ids) > 64
    with pytest.raises(EmberError, match=f"prompt 1 is {len(ids)} tokens.*max_seq_len=64.*--truncate"):
        engine.generate([prompt], Sampling(10))
    [c] = engine.generate([prompt], Sampling(10, temperature=0), truncate=True)
    assert c.prompt_tokens == 54 and c.dropped_tokens == len(ids) - 54
    ref = greedy_without_cache(model, ids[-54:], 10, tok)
    assert c.token_ids == ref
    # a prompt that fits alone but not with the new tokens: 40 + 30 > 64
    short = tok.decode(ids[:40])
    assert len(tok.encode(short)) == 40
    with pytest.raises(EmberError, match=r"40 tokens.*that is 70.*max_seq_len=64.*--max-new-tokens to 24"):
        engine.generate(["ok", short], Sampling(30))
    [_, d] = engine.generate(["ok", short], Sampling(30, temperature=0), truncate=True)
    assert d.prompt_tokens == 34 and d.dropped_tokens == 6
    with pytest.raises(EmberError, match="max-new-tokens"):
        engine.generate(["a"], Sampling(64), truncate=True)
    with pytest.raises(EmberError, match="max-new-tokens"):
        engine.generate(["a"], Sampling(0))


def test_empty_prompt_raises(tok):
    engine = Engine(tiny_model(vocab_size=320), tok)
    with pytest.raises(EmberError, match="prompt 2 is empty"):
        engine.generate(["fine", ""], Sampling(4))
    with pytest.raises(EmberError):
        engine.generate([], Sampling(4))
    with pytest.raises(EmberError, match="list"):
        engine.generate("a string, not a list", Sampling(4))


def test_engine_leaves_a_training_model_in_training_mode(tok):
    model = tiny_model(vocab_size=320).train()
    Engine(model, tok).generate(["The"], Sampling(3))
    assert model.training


# ---------------------------------------------------------------------------
# Loading from a run directory
# ---------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path, tok):
    cfg = tiny_cfg(vocab_size=320, **LLAMA)
    model = GPT.build(cfg, seed=0)
    tok_path = tmp_path / "tokenizer.json"
    tok.save(tok_path)
    export_weights(model, tmp_path / "run" / "model", dataclasses.asdict(cfg), {"tokenizer.json": tok_path})
    return tmp_path / "run", model


def test_from_run_generates_what_the_model_in_memory_does(run_dir, tok):
    path, model = run_dir
    loaded = Engine.from_run(path)
    got = loaded.generate(["The quick", "def"], Sampling(12, temperature=0))
    assert got == Engine(model.eval(), tok).generate(["The quick", "def"], Sampling(12, temperature=0))
    assert all(c.token_ids for c in got)
    sampled = loaded.generate(["The quick"], Sampling(12, temperature=0.8, top_k=20, top_p=0.9, seed=5))
    assert sampled == loaded.generate(
        ["The quick"], Sampling(12, temperature=0.8, top_k=20, top_p=0.9, seed=5)
    )


def test_from_run_errors(run_dir, tmp_path):
    path, _ = run_dir
    with pytest.raises(EmberError, match="does not exist"):
        Engine.from_run(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(EmberError, match="model_config.json not found"):
        Engine.from_run(empty)
    # a tokenizer bigger than the weights' vocabulary
    config_path = path / "model" / "model_config.json"
    cfg = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**cfg, "vocab_size": 256}))
    with pytest.raises(EmberError, match="tokenizer does not match the weights"):
        Engine.from_run(path)
    config_path.write_text(json.dumps({**cfg, "not_a_key": 1}))
    with pytest.raises(EmberError, match="not a valid model config"):
        Engine.from_run(path)
    config_path.write_text(json.dumps(cfg))
    (path / "model" / "tokenizer.json").unlink()
    with pytest.raises(EmberError, match="no tokenizer.json"):
        Engine.from_run(path)
    (path / "model" / "model.safetensors").unlink()
    (path / "tokenizer.json").write_text((tmp_path / "tokenizer.json").read_text())
    with pytest.raises(EmberError, match="model.safetensors not found"):
        Engine.from_run(path)
