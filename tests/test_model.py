"""The decoder: shapes, causality, GQA, attention paths, init, accounting, overfitting, errors."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ember.config import ModelConfig, load_config
from ember.errors import ConfigError
from ember.model.gpt import ATTENTION, GPT, RotaryPositions, apply_rotary, mlp_hidden_size

GPT2 = {}
LLAMA = {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}
LAYOUTS = {
    "gpt2": GPT2,
    "gpt2-untied": {**GPT2, "tie_embeddings": False},
    "llama": LLAMA,
    "llama-gqa": {**LLAMA, "n_kv_head": 2},
    "llama-mqa-qknorm": {**LLAMA, "n_kv_head": 1, "qk_norm": True},
    "rope-layernorm-gelu-bias": {"pos": "rope"},
}


def tiny(**overrides) -> ModelConfig:
    # init_std 0.2 so that logits are O(1) and comparisons mean something
    base = dict(vocab_size=64, n_layer=2, n_head=4, d_model=32, max_seq_len=16, init_std=0.2)
    return ModelConfig(**{**base, **overrides})


def tokens(B: int = 2, T: int = 12, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_shape_and_dtype(layout):
    model = GPT.build(tiny(**LAYOUTS[layout]), seed=0).eval()
    logits = model(tokens(B=3, T=16))
    assert logits.shape == (3, 16, 64)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("layout", ["gpt2", "llama", "llama-gqa"])
def test_causal(layout):
    model = GPT.build(tiny(**LAYOUTS[layout]), seed=0).eval()
    idx = tokens()
    t = 5
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % 64
    before, after = model(idx), model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
    assert (after[:, t:] - before[:, t:]).abs().amax(dim=-1).min() > 1e-4  # every later position sees it


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
@pytest.mark.parametrize("layout", ["gpt2", "llama"])
def test_gqa_equals_mha_with_repeated_kv(layout, attention):
    gqa = GPT.build(tiny(**LAYOUTS[layout], n_kv_head=2), seed=0).eval().set_attention(attention)
    mha = GPT.build(tiny(**LAYOUTS[layout], n_kv_head=4), seed=1).eval().set_attention(attention)
    head_dim, n_rep = 8, 2
    state = gqa.state_dict()
    for name, value in list(state.items()):
        if name.endswith((".wk.weight", ".wk.bias", ".wv.weight", ".wv.bias")):
            heads = value.unflatten(0, (-1, head_dim))  # (n_kv_head, head_dim, ...)
            state[name] = heads.repeat_interleave(n_rep, dim=0).flatten(0, 1)  # kv head j serves 2j, 2j+1
    mha.load_state_dict(state)
    idx = tokens()
    assert (gqa(idx) - mha(idx)).abs().max() <= 1e-6


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sdpa_equals_reference(layout):
    model = GPT.build(tiny(**LAYOUTS[layout]), seed=0).eval()
    idx = tokens(T=16)
    fast = model(idx)
    slow = model.set_attention("reference")(idx)
    assert (fast - slow).abs().max() <= 1e-5
    assert fast.abs().max() > 0.5  # the comparison is not between near-zero logits


def test_set_attention_unknown():
    with pytest.raises(ConfigError, match="unknown attention 'flash'"):
        GPT.build(tiny()).set_attention("flash")


class ListCache:
    """The smallest KVCache (see gpt.KVCache): tensors concatenated per layer, attended by
    ``attend`` (every row starts at slot 0, so causal attention needs no mask)."""

    def __init__(self, attend) -> None:
        self.pos, self.attention = 0, attend
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def extend(self, T):
        self.pos += T
        return torch.arange(self.pos - T, self.pos)

    def attend(self, layer, q, k, v):
        if layer in self.kv:
            k = torch.cat([self.kv[layer][0], k], dim=2)
            v = torch.cat([self.kv[layer][1], v], dim=2)
        self.kv[layer] = (k, v)
        return self.attention(q, k, v, 0.0)


def test_sdpa_equals_reference_under_an_explicit_mask():
    from ember.model.gpt import reference_attention, sdpa_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g)  # GQA 4/2
    mask = torch.rand(2, 1, 5, 9, generator=g) < 0.5
    mask[..., 0] = True  # no empty softmax row
    got, want = sdpa_attention(q, k, v, 0.0, mask), reference_attention(q, k, v, 0.0, mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.allclose(got, sdpa_attention(q, k, v, 0.0), atol=1e-3)  # the mask mattered


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
@pytest.mark.parametrize("layout", ["gpt2", "llama-gqa", "llama-mqa-qknorm"])
def test_cache_protocol_matches_full_forward(layout, attention):
    model = GPT.build(tiny(**LAYOUTS[layout]), seed=0).eval().set_attention(attention)
    idx = tokens(T=12)
    full = model(idx)
    cache = ListCache(ATTENTION[attention])
    steps = [model(idx[:, :7], cache)] + [model(idx[:, t : t + 1], cache) for t in range(7, 10)]
    steps.append(model(idx[:, 10:], cache))  # a 2-token chunk after the cache: mask is bottom-right
    assert cache.pos == 12
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5


def test_meta_init_stds_and_buffers():
    cfg = tiny(**LLAMA, n_layer=4, d_model=128, n_head=4, init_std=0.02, vocab_size=256)
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.tok_embeddings.weight.is_meta
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name

    def pooled_std(suffix):
        values = [p.flatten() for n, p in model.named_parameters() if n.endswith(suffix)]
        return torch.cat(values).std().item()

    resid = 0.02 / math.sqrt(2 * 4)
    assert pooled_std("wq.weight") == pytest.approx(0.02, rel=0.05)
    assert pooled_std("w1.weight") == pytest.approx(0.02, rel=0.05)
    assert pooled_std("tok_embeddings.weight") == pytest.approx(0.02, rel=0.05)
    assert pooled_std("wo.weight") == pytest.approx(resid, rel=0.05)
    assert pooled_std("w2.weight") == pytest.approx(resid, rel=0.05)
    assert all((p == 1).all() for n, p in model.named_parameters() if "norm" in n)

    # RoPE tables: pair i at position p turns by p * theta^(-2i/head_dim)
    rope = model.pos
    assert isinstance(rope, RotaryPositions)
    head_dim = 32
    pos = torch.arange(16, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(head_dim // 2, dtype=torch.float64) * 2 / head_dim)
    torch.testing.assert_close(rope.cos, (pos * inv_freq).cos().float())
    torch.testing.assert_close(rope.sin, (pos * inv_freq).sin().float())
    assert "pos.cos" not in model.state_dict()  # recomputed, never saved


def test_init_biases_and_layernorm():
    model = GPT.build(tiny(), seed=0)
    biases = [p for n, p in model.named_parameters() if n.endswith(".bias")]
    assert biases and all((b == 0).all() for b in biases)
    assert model.pos.wpe.weight.std().item() == pytest.approx(0.2, rel=0.1)


def test_init_seeded():
    a, b = GPT.build(tiny(**LLAMA), seed=3), GPT.build(tiny(**LLAMA), seed=3)
    c = GPT.build(tiny(**LLAMA), seed=4)
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if name.endswith("wq.weight"):
            assert not torch.equal(pa, pc)


def test_rope_is_relative():
    # <R(m) q, R(n) k> depends only on m - n
    rope = RotaryPositions(head_dim=16, max_seq_len=32, theta=10000.0)
    q, k = torch.randn(2, 16, dtype=torch.float64).unbind(0)

    def score(m, n):
        table = lambda p: (rope.cos[p : p + 1].double(), rope.sin[p : p + 1].double())  # noqa: E731
        return (apply_rotary(q[None], table(m)) * apply_rotary(k[None], table(n))).sum().item()

    assert score(7, 3) == pytest.approx(score(20, 16), abs=1e-5)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)


def test_tied_weights_survive_meta_build():
    tied = GPT.build(tiny())
    assert tied.output.weight is tied.tok_embeddings.weight
    untied = GPT.build(tiny(tie_embeddings=False))
    assert untied.output.weight is not untied.tok_embeddings.weight
    assert not torch.equal(untied.output.weight, untied.tok_embeddings.weight)


def test_num_params_by_hand():
    # GPT-2 layout, tied: V=64, C=32, T=16, L=2, MLP 128
    V, C, T, L, H = 64, 32, 16, 2, 128
    per_layer = 2 * C + 4 * (C * C + C) + 2 * C + (C * H + H) + (H * C + C)
    expected = V * C + T * C + L * per_layer + 2 * C
    model = GPT.build(tiny())
    assert model.num_params() == expected == 28_032
    assert model.num_params(non_embedding=True) == expected - T * C  # tied table stays, as the head

    # Llama layout, GQA 4/2, untied, SwiGLU hidden int(8*32/3)=85 -> 128
    cfg = tiny(**LLAMA, n_kv_head=2, tie_embeddings=False)
    assert mlp_hidden_size(cfg) == 128
    kv = 2 * 8
    per_layer = C + (C * C + 2 * C * kv + C * C) + C + 3 * C * H
    expected = V * C + L * per_layer + C + C * V
    model = GPT.build(cfg)
    assert model.num_params() == expected == 34_976
    assert model.num_params(non_embedding=True) == expected - V * C


def test_flops_per_token_by_hand():
    model = GPT.build(tiny())
    # PaLM: 6N + 12 L H Q T with N = 28_032 - 16*32 = 27_520, L=2, H=4, Q=8, T=16
    assert model.flops_per_token(16) == 6 * 27_520 + 12 * 2 * 4 * 8 * 16 == 177_408


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT.build(tiny(**LLAMA, n_kv_head=2, d_model=64, init_std=0.02), seed=0)
    idx = tokens(B=4, T=16)
    x, y = idx[:, :-1], idx[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(200):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1


def test_sequence_longer_than_context():
    model = GPT.build(tiny())
    with pytest.raises(ConfigError, match="17 tokens is longer than model.max_seq_len=16"):
        model(tokens(T=17))


def test_vocab_size_zero():
    with pytest.raises(ConfigError, match="vocab_size is 0"):
        GPT(dataclasses.replace(tiny(), vocab_size=0))


@pytest.mark.parametrize(
    "override, key",
    [("model.n_head=5", "n_head"), ("model.n_kv_head=4", "n_kv_head"), ("model.mlp=relu", "model.mlp")],
)
def test_bad_config(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])


def test_model_package_imports_no_distributed_optim_or_io():
    forbidden = ("torch.distributed", "torch.optim", "logging", "os", "pathlib", "io", "json", "shutil")
    assert forbidden[:2] == ("torch.distributed", "torch.optim")
    for path in (Path(__file__).parents[1] / "ember" / "model").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            for name in names:
                root = name.split(".")[0]
                assert root not in forbidden and not name.startswith(forbidden[:2]), f"{path.name}: {name}"


def test_model_package_imports_nothing_distributed_when_run(monkeypatch):
    """What ember/model actually imports, not what its text says: each of its files is run
    afresh and a model built, run forward and backward, with every import made from
    ember.model recorded (module level or inside a function; ``import``, ``from .. import``,
    ``__import__`` or ``importlib.import_module``). The ember modules it pulls in (config,
    errors) are run afresh too, and must not reach torch.distributed or torch.optim either."""
    import builtins
    import importlib
    import importlib.util
    import sys

    forbidden = ("torch.distributed", "torch.optim", "logging", "os", "pathlib", "io", "json", "shutil")
    watched = {"ember.model"}  # importers whose imports are recorded, besides ember.model.*
    recorded: list[tuple[str, str]] = []
    real_import, real_import_module = builtins.__import__, importlib.import_module

    def record(importer: str, name: str) -> None:
        if importer in watched or importer.startswith("ember.model."):
            recorded.append((importer, name))

    def hooked_import(name, globals=None, locals=None, fromlist=(), level=0):
        if globals is None:  # a direct __import__("x") call: the caller's module
            globals = sys._getframe(1).f_globals
        importer, package = globals.get("__name__", ""), globals.get("__package__")
        base = name if not level else importlib.util.resolve_name("." * level + name, package)
        for item in fromlist or ():
            record(importer, f"{base}.{item}")  # from torch import distributed
        record(importer, base)
        return real_import(name, globals, locals, fromlist, level)

    def hooked_import_module(name, package=None):
        record(sys._getframe(1).f_globals.get("__name__", ""), importlib.util.resolve_name(name, package))
        return real_import_module(name, package)

    def run_afresh(name: str, path) -> object:
        watched.add(name)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)  # not put in sys.modules: nothing else sees it
        spec.loader.exec_module(module)
        return module

    files = sorted((Path(__file__).parents[1] / "ember" / "model").glob("*.py"))
    names = ["ember.model" if path.stem == "__init__" else f"ember.model.{path.stem}" for path in files]
    for name in names:  # imported once as usual first: a dataclass looks its module up in sys.modules
        importlib.import_module(name)
    monkeypatch.setattr(builtins, "__import__", hooked_import)
    monkeypatch.setattr(importlib, "import_module", hooked_import_module)
    fresh = {}
    for name, path in zip(names, files, strict=True):
        fresh[path.stem] = run_afresh(name, path)
    model = fresh["gpt"].GPT.build(tiny(**LLAMA, n_kv_head=2, qk_norm=True, logit_softcap=5.0), seed=0)
    model(tokens()).sum().backward()
    model.set_attention("reference")(tokens()).sum().backward()
    model.num_params(non_embedding=True), model.flops_per_token(8)
    in_model = list(recorded)
    while todo := {n for _, n in recorded if n.startswith("ember.") and n in sys.modules} - watched:
        for name in sorted(todo):  # ember modules the model needs, and theirs
            run_afresh(name, sys.modules[name].__file__)
    monkeypatch.undo()

    names = {name for _, name in recorded}
    assert {"torch", "ember.config", "ember.errors"} <= names  # the hook saw the imports
    bad = [(i, n) for i, n in in_model if n.split(".")[0] in forbidden or n.startswith(forbidden[:2])]
    bad += [(i, n) for i, n in recorded if n.startswith(forbidden[:2])]
    assert not bad, bad


def test_relu_squared_mlp_and_logit_softcap_are_what_they_say():
    from ember.model.gpt import ReluSquaredMLP

    cfg = ModelConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=16, mlp="relu2", pos="rope")
    model = GPT.build(cfg, seed=0)
    mlp = model.layers["0"].mlp
    assert isinstance(mlp, ReluSquaredMLP) and mlp.w1.out_features == 4 * 32
    x = torch.randn(2, 5, 32)
    expected = F.linear(
        torch.clamp(F.linear(x, mlp.w1.weight, mlp.w1.bias), min=0) ** 2, mlp.w2.weight, mlp.w2.bias
    )
    torch.testing.assert_close(mlp(x), expected, rtol=0, atol=1e-6)

    capped = GPT.build(dataclasses.replace(cfg, logit_softcap=2.0), seed=0)
    capped.load_state_dict(model.state_dict())  # the cap has no parameters
    idx = torch.randint(0, 64, (2, 7))
    model.output.weight.data.mul_(50)  # logits well beyond the cap
    capped.output.weight.data.mul_(50)
    raw, out = model(idx), capped(idx)
    assert raw.abs().max() > 4 and out.abs().max() <= 2.0
    torch.testing.assert_close(out, 2.0 * torch.tanh(raw / 2.0), rtol=0, atol=1e-5)
    with pytest.raises(ConfigError, match="logit_softcap"):
        ModelConfig(logit_softcap=-1.0)
