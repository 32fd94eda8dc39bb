"""Mamba: the chunked scan against the sequential one (forward and backward), the init anchors,
hybrids, recurrent decoding in the engine against the full forward, HF ``MambaForCausalLM``
parity both ways, the refusals of what is not supported, and a hybrid's exact resume."""

from __future__ import annotations

import math

import pytest
import torch

from ember.config import ModelConfig
from ember.data.tokenizer import Tokenizer
from ember.errors import EmberError
from ember.infer.engine import Engine, KVCache
from ember.infer.sampling import Sampling
from ember.model.gpt import GPT, layer_mixers
from ember.model.mamba import Mamba, chunked_scan, dt_rank, sequential_scan, set_scan

MAMBA = dict(mixer="mamba", pos="none", mlp="none", norm="rmsnorm", bias=False)
HYBRID = dict(pattern="MA", pos="rope", mlp="swiglu", norm="rmsnorm", bias=False)
TEXT = ["The quick brown fox jumps over the lazy dog. " * 4, "def main():\n    return 1\n" * 4]


def tiny(**overrides) -> ModelConfig:
    # init_std 0.2: logits of a few units, so the bounds below mean something
    base = dict(vocab_size=96, n_layer=2, n_head=4, d_model=32, max_seq_len=64, init_std=0.2)
    return ModelConfig(**{**base, **overrides})


def scan_inputs(T: int, batch: int = 2, d_inner: int = 6, d_state: int = 4, seed: int = 0):
    """Inputs as a Mamba layer makes them: Δ > 0 of a size that decays the state over a few steps
    to a few tens (so both a long memory and a near-total forgetting are exercised)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(batch, T, d_inner, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(batch, T, d_inner, generator=g) - 1)
    A = -torch.exp(torch.randn(d_inner, d_state, generator=g))
    B, C = torch.randn(batch, T, d_state, generator=g), torch.randn(batch, T, d_state, generator=g)
    h0 = torch.randn(batch, d_inner, d_state, generator=g)
    return [t.requires_grad_() for t in (u, dt, A, B, C, h0)]


@pytest.mark.parametrize("T", [1, 7, 16, 33, 64])
@pytest.mark.parametrize("chunk", [4, 16])
def test_chunked_scan_equals_the_sequential_scan_forward_and_backward(T, chunk):
    inputs = scan_inputs(T)
    y_ref, h_ref = sequential_scan(*inputs)
    y, h = chunked_scan(*inputs, chunk=chunk)
    assert y_ref.abs().max() > 1 and (y - y_ref).abs().max() <= 1e-5 and (h - h_ref).abs().max() <= 1e-5
    g = torch.Generator().manual_seed(1)
    wy, wh = torch.randn(y.shape, generator=g), torch.randn(h.shape, generator=g)
    ref = torch.autograd.grad((y_ref * wy).sum() + (h_ref * wh).sum(), inputs)
    got = torch.autograd.grad((y * wy).sum() + (h * wh).sum(), inputs)
    for name, a, b in zip(("u", "dt", "A", "B", "C", "h0"), got, ref, strict=True):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item()), name


def test_model_gradients_equal_under_both_scans():
    model = GPT.build(tiny(**MAMBA), seed=0)
    idx = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(0))
    grads = {}
    for kind in ("sequential", "chunked"):
        model.zero_grad()
        logits = set_scan(model, kind)(idx)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten()).backward()
        grads[kind] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (la, ga), (lb, gb) = grads["sequential"], grads["chunked"]
    assert (la - lb).abs().max() <= 1e-5
    for name in ga:
        assert (ga[name] - gb[name]).abs().max() <= 1e-5, name


def test_init_anchors_and_names():
    cfg = tiny(**MAMBA, d_model=64)
    model = GPT.build(cfg, seed=0)
    mixer = model.layers["0"].attention
    assert isinstance(mixer, Mamba) and dt_rank(64) == 4 == mixer.rank
    assert torch.equal(mixer.A_log, torch.log(torch.arange(1.0, 17.0)).expand(128, -1))
    assert torch.equal(mixer.D, torch.ones(128))
    dt = torch.nn.functional.softplus(mixer.dt_proj.bias)  # the bias is softplus^-1 of dt
    assert dt.min() >= 1e-3 - 1e-7 and dt.max() <= 1e-1 + 1e-6
    assert mixer.out_proj.weight.std() < mixer.in_proj.weight.std() / 1.5  # residual projection scaled
    names = {n.removeprefix("layers.0.") for n, _ in model.named_parameters() if n.startswith("layers.0.")}
    mixer_names = {"in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
                   "dt_proj.bias", "A_log", "D", "out_proj.weight"}  # fmt: skip
    assert names == {"attention_norm.weight"} | {f"attention.{n}" for n in mixer_names}
    assert model.flops_per_token(64) > 6 * model.num_params(non_embedding=True)


def test_hybrid_pattern_builds_each_mixer():
    cfg = tiny(**HYBRID, n_layer=3)
    assert layer_mixers(cfg) == ["mamba", "attention", "mamba"]
    model = GPT.build(cfg, seed=0)
    kinds = [type(layer.attention).__name__ for layer in model.layers.values()]
    assert kinds == ["Mamba", "Attention", "Mamba"]
    assert model(torch.randint(0, 96, (2, 16))).shape == (2, 16, 96)


# ------------------------------------------------------------------ decoding with the state


@pytest.mark.parametrize("layout", [MAMBA, HYBRID], ids=["mamba", "hybrid"])
def test_prefill_then_recurrent_steps_equal_the_full_forward(layout):
    model = GPT.build(tiny(**layout), seed=0).eval()
    idx = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(30)
        steps = [model(idx[:, :20], cache=cache)]  # a prefill of 20 (one chunk and a part), then steps
        steps += [model(idx[:, t : t + 1], cache=cache) for t in range(20, 30)]
    assert full.abs().max() > 1 and (torch.cat(steps, 1) - full).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train_bpe(TEXT, 300)


def greedy_without_cache(model: GPT, ids: list[int], n: int, n_valid: int) -> list[int]:
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq)[0, -1, :n_valid].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    return seq[0, len(ids) :].tolist()


@pytest.mark.parametrize("layout", [MAMBA, HYBRID], ids=["mamba", "hybrid"])
def test_engine_greedy_equals_the_full_forward_for_ragged_batches(tok, layout):
    """Left-padded rows of different lengths: each row's greedy tokens are the full forward's argmax
    over that row alone, so the pads never reach the recurrent state."""
    model = GPT.build(tiny(**layout, vocab_size=320), seed=0).eval()
    engine = Engine(model, tok)
    prompts = ["The quick brown", "def", "fox jumps over the lazy", "The"]
    out = engine.generate(prompts, Sampling(max_new_tokens=12, temperature=0, ignore_eos=True))
    for prompt, got in zip(prompts, out, strict=True):
        assert got.token_ids == greedy_without_cache(model, tok.encode(prompt), 12, tok.vocab_size)
    many = engine.generate(["The quick"] * 3, Sampling(max_new_tokens=8, temperature=0, ignore_eos=True))
    assert many[0].token_ids == many[2].token_ids == greedy_without_cache(model, tok.encode("The quick"), 8,
                                                                           tok.vocab_size)  # fmt: skip


def test_engine_refuses_compile_and_graphs_for_mamba(tok):
    model = GPT.build(tiny(**HYBRID, vocab_size=320), seed=0)
    for kwargs in ({"compile": True}, {"graphs": True}):
        with pytest.raises(EmberError, match="Mamba"):
            Engine(model, tok, **kwargs)


def test_dt_rank_is_ceil_d_model_over_16():
    assert [dt_rank(d) for d in (16, 17, 768)] == [1, 2, 48] and math.ceil(768 / 16) == 48
