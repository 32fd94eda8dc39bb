"""Parity with HF transformers: GPT-2 and Llama layouts give the same logits (fp32, CPU, eval)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ember.config import ModelConfig
from ember.errors import ConfigError
from ember.model.gpt import GPT, mlp_hidden_size

transformers = pytest.importorskip("transformers")

from ember.model.hf import from_hf, to_hf  # noqa: E402

LLAMA = {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}
LAYOUTS = {
    "gpt2": {},
    "gpt2-untied-mlp96": {"tie_embeddings": False, "mlp_hidden": 96},
    "llama-gqa-untied": {**LLAMA, "n_kv_head": 2, "tie_embeddings": False, "rope_theta": 500.0},
    "llama-gqa-tied": {**LLAMA, "n_kv_head": 2},
    "llama-mqa-bias": {**LLAMA, "n_kv_head": 1, "bias": True},
}
TOL = 1e-5


def tiny(**overrides) -> ModelConfig:
    # init_std 0.2: logits of a few units, so a 1e-5 bound is a real test
    base = dict(vocab_size=96, n_layer=2, n_head=4, d_model=64, max_seq_len=32, init_std=0.2, norm_eps=1e-5)
    return ModelConfig(**{**base, **overrides})


def tokens(vocab: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_to_hf_same_logits(layout):
    model = GPT.build(tiny(**LAYOUTS[layout]), seed=0).eval()
    hf = to_hf(model).eval()
    expected = "GPT2LMHeadModel" if model.cfg.pos == "learned" else "LlamaForCausalLM"
    assert type(hf).__name__ == expected
    idx = tokens()
    ours = model(idx)
    with torch.no_grad():
        theirs = hf(idx).logits
    assert ours.abs().max() > 1.0
    assert (ours - theirs).abs().max() <= TOL
    if model.cfg.tie_embeddings:
        assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight


@pytest.mark.parametrize("layout", LAYOUTS)
def test_from_hf_round_trip(layout):
    cfg = tiny(**LAYOUTS[layout])
    model = GPT.build(cfg, seed=0).eval()
    back = from_hf(to_hf(model).eval())
    assert not back.training
    assert dataclasses.replace(back.cfg, mlp_hidden=0) == dataclasses.replace(cfg, mlp_hidden=0)
    assert mlp_hidden_size(back.cfg) == mlp_hidden_size(cfg)
    assert back.state_dict().keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    assert (back.output.weight is back.tok_embeddings.weight) == cfg.tie_embeddings
    idx = tokens()
    assert torch.equal(back(idx), model(idx))


def test_from_hf_gpt2_initialised_by_hf():
    config = transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4, initializer_range=0.2
    )
    hf = transformers.GPT2LMHeadModel(config).eval()
    model = from_hf(hf)
    assert model.cfg.pos == "learned" and model.cfg.tie_embeddings
    idx = tokens()
    with torch.no_grad():
        assert (model(idx) - hf(idx).logits).abs().max() <= TOL


def test_from_hf_llama_initialised_by_hf():
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
        rope_theta=1000.0,
        initializer_range=0.2,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    model = from_hf(hf)
    assert (model.cfg.n_kv_head, model.cfg.mlp_hidden, model.cfg.rope_theta) == (2, 160, 1000.0)
    idx = tokens()
    with torch.no_grad():
        theirs = hf(idx).logits
    assert theirs.abs().max() > 0.1
    assert (model(idx) - theirs).abs().max() <= TOL


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"qk_norm": True}, "qk_norm"),
        ({"mlp": "swiglu"}, "model.mlp=swiglu"),
        ({"bias": False}, "model.bias=False"),
        ({"n_kv_head": 2}, "model.n_kv_head=2"),
        ({"pos": "rope"}, "model.norm=layernorm, model.mlp=gelu"),
    ],
)
def test_unrepresentable_layouts(overrides, message):
    with pytest.raises(ConfigError, match=message):
        to_hf(GPT.build(tiny(**overrides)))


def test_from_hf_rejects_other_models():
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4
    )
    config.hidden_act = "gelu"
    with pytest.raises(ConfigError, match="hidden_act"):
        from_hf(transformers.LlamaForCausalLM(config))


@pytest.mark.parametrize(
    ("family", "config", "field", "needs"),
    [
        ("gpt2", transformers.GPT2Config(activation_function="relu"), "GPT-2 config activation_function='relu'", "'gelu_new'"),  # noqa: E501
        ("llama", transformers.LlamaConfig(mlp_bias=True), "Llama config mlp_bias=True", "False"),
        ("mixtral", transformers.MixtralConfig(sliding_window=64), "Mixtral config sliding_window=64", "None"),  # noqa: E501
        ("mamba", transformers.MambaConfig(use_conv_bias=False), "Mamba config use_conv_bias=False", "True"),
        ("bert", transformers.BertConfig(is_decoder=True), "BERT config is_decoder=True", "False"),
    ],
)  # fmt: skip
def test_each_family_names_the_field_it_cannot_map(family, config, field, needs):
    from ember.model.hf import IMPORTS

    with pytest.raises(ConfigError) as e:
        IMPORTS[family](config)
    assert str(e.value) == f"{field} has no ember equivalent (ember needs {needs})"
