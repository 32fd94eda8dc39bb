"""The generation engine: KV-cache parity with the full forward, sampling filters,
determinism, stopping, prompt-length errors, streaming text, loading from a run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ember.config import ModelConfig
from ember.data.tokenizer import Tokenizer
from ember.infer.engine import Engine, KVCache, StaticKVCache
from ember.infer.sampling import Sampling
from ember.model.gpt import GPT

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


def test_compiled_engine_generates_what_the_eager_engine_does(tok):
    model = tiny_model(vocab_size=320, **LLAMA)
    prompts = ["The quick", "def main():\n", "fox"]
    greedy = Sampling(max_new_tokens=12, temperature=0)
    eager = Engine(model, tok).generate(prompts, greedy)
    assert Engine(model, tok, compile=True).generate(prompts, greedy) == eager


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
