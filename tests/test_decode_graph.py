"""The graph-captured decode step (``Engine(..., graphs=True)``, ``GraphedDecode``) against the
plain path: the same logits (1e-5) and greedy tokens, with its static buffers reused by prompts
of different lengths back to back and taken over by interleaved streams. On a CPU the wrapper
runs the step eagerly on its static cache (no CUDA graphs); ``TracedDecode`` stands in for
capture and replay there; the CUDA cases replay real graphs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ember.config import ModelConfig
from ember.data.tokenizer import Tokenizer
from ember.infer.engine import Engine, GraphedDecode, KVCache, StaticKVCache
from ember.infer.sampling import Sampling
from ember.model.gpt import GPT

LLAMA = {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}
TEXT = ["The quick brown fox jumps over the lazy dog. " * 4, "def main():\n    return sum(range(10))\n" * 4]
NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
KINDS = ["cpu", "traced", pytest.param("cuda", marks=NO_GPU)]  # eager wrapper, stand-in graph, real graph


class TracedDecode(GraphedDecode):
    """A CPU stand-in for a CUDA graph: the step traced once by ``make_fx`` (its Python frozen at
    capture, as a graph's kernel launches are), its static tensors baked in as the same objects,
    and replayed on them. State the step kept in Python, or a binding that replaced a static
    tensor instead of copying into it, would give wrong logits here and pass eagerly."""

    def capture(self, idx: torch.Tensor, cache: StaticKVCache):
        g = super().capture(idx, cache)
        traced = make_fx(lambda ids: self.step(ids, cache=g.cache))(g.idx)  # runs a step: bind overwrites it
        g.logits = traced(g.idx)
        g.graph = SimpleNamespace(replay=lambda: g.logits.copy_(traced(g.idx)))
        return g


def graphed_decode(kind: str, step) -> GraphedDecode:
    return TracedDecode(step) if kind == "traced" else GraphedDecode(step)


def tiny_model(device: str = "cpu", **layout) -> GPT:
    # init_std 0.1: logits reach ~3, so 1e-5 is a few fp32 ulps (as tests/test_engine.py)
    cfg = ModelConfig(vocab_size=320, n_layer=2, n_head=4, d_model=64, max_seq_len=64, init_std=0.1, **layout)
    return GPT.build(cfg, device=device, seed=0).eval()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train_bpe(TEXT, 300)


def decode(model: GPT, step, cache: KVCache, seq: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits (B, S - prefill, V) of decoding seq (B, S) one token at a time after a prefill."""
    model(seq[:, :prefill], cache=cache)
    return torch.cat([step(seq[:, t : t + 1], cache=cache).clone() for t in range(prefill, seq.size(1))], 1)


@pytest.mark.parametrize(
    "kind, layout",
    [("cpu", {}), ("cpu", LLAMA), ("traced", LLAMA)]
    + [pytest.param("cuda", layout, marks=NO_GPU) for layout in ({}, LLAMA)],
)
@torch.inference_mode()
def test_graphed_step_gives_the_plain_logits_with_its_buffers_reused(kind, layout):
    device = "cuda" if kind == "cuda" else "cpu"
    model = tiny_model(device, **layout)
    graphed = graphed_decode(kind, model)
    gen = torch.Generator().manual_seed(0)
    worst, largest = 0.0, 0.0
    # back to back on one (batch, cache length): prompts of 9, 4 and 13 tokens, pads or none
    for prefill, pad in [(9, None), (4, [0, 2]), (13, [3, 0])]:
        seq = torch.randint(0, 320, (2, 24), generator=gen).to(device)
        want = decode(model, model, KVCache(32, pad, device), seq, prefill)
        got = decode(model, graphed, StaticKVCache(32, pad, device), seq, prefill)
        worst = max(worst, (got - want).abs().max().item())
        largest = max(largest, want.abs().max().item())
    assert largest > 1 and worst <= 1e-5, f"graphed vs plain max |diff| {worst:.2e}"
    [(key, g)] = graphed.graphed.items()  # one static state served all three
    assert key == (2, 32) and (g.graph is not None) == (kind != "cpu")


@pytest.mark.parametrize("kind", KINDS)
def test_graphed_engine_generates_the_plain_engines_tokens_back_to_back(tok, kind):
    model = tiny_model("cuda" if kind == "cuda" else "cpu", **LLAMA, n_kv_head=2)
    plain, graphed = Engine(model, tok), Engine(model, tok, graphs=True)
    graphed.decode = graphed_decode(kind, model)
    calls = [
        (["The quick"], Sampling(max_new_tokens=12, temperature=0)),
        (["def main():\n    return sum("], Sampling(max_new_tokens=7, temperature=0)),  # longer prompt
        (["fox", "The lazy dog.", "fox"], Sampling(max_new_tokens=9, temperature=0)),  # ragged, repeated
        (["The quick"], Sampling(max_new_tokens=12, temperature=1.0, seed=3)),  # sampled
    ]
    for prompts, sampling in calls:
        want = plain.generate(prompts, sampling)
        assert graphed.generate(prompts, sampling) == want
    assert sorted(graphed.decode.graphed) == [(1, 64), (3, 64)]  # one per batch size: the length rounds up


@pytest.mark.parametrize("kind", ["cpu", "traced"])
def test_interleaved_streams_take_the_static_buffers_over_and_get_their_own_back(tok, monkeypatch, kind):
    """Two live streams of one batch size share one static state: each step of the other evicts
    the one bound (its cache gets private copies) and binds itself."""
    evictions, evict = [], GraphedDecode.evict
    monkeypatch.setattr(GraphedDecode, "evict", staticmethod(lambda cache: evictions.append(evict(cache))))
    model = tiny_model(**LLAMA)
    plain, graphed = Engine(model, tok), Engine(model, tok, graphs=True)
    graphed.decode = graphed_decode(kind, model)
    greedy = Sampling(max_new_tokens=10, temperature=0, ignore_eos=True)
    prompts = ["The quick brown", "def main():\n"]
    want = [plain.generate([p], greedy)[0].text for p in prompts]
    streams, texts = [graphed.stream([p], greedy) for p in prompts], ["", ""]
    live = [0, 1]
    while live:
        for i in list(live):
            try:
                texts[i] += next(streams[i])[1]
            except StopIteration:
                live.remove(i)
    assert texts == want and len(evictions) >= 8


def test_graphed_decode_refuses_a_cache_with_python_state():
    model = tiny_model()
    cache = KVCache(8)
    with torch.inference_mode():
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache)
        with pytest.raises(TypeError, match="StaticKVCache"):
            GraphedDecode(model)(torch.zeros(1, 1, dtype=torch.long), cache)
