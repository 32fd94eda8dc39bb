"""The image classifiers (ember/model/{classifier,mlp,cnn,vit,vision}.py): shapes, seeded init of
every tensor, the init schemes' statistics, input normalisation, norms, FLOPs, compile parity."""

import math

import pytest
import torch
from torch import nn

from ember.config import ModelConfig
from ember.errors import ConfigError
from ember.model.classifier import init_weight
from ember.model.gpt import GPT, Block
from ember.model.vision import build_model

KINDS = {"mlp": "batchnorm", "cnn": "batchnorm", "vit": "layernorm"}


def config(kind: str, **kw) -> ModelConfig:
    base = dict(kind=kind, classes=10, image=[1, 8, 8], n_layer=2, d_model=16, n_head=2, norm=KINDS[kind])
    return ModelConfig(**{**base, **kw})


def images(n: int = 4, image=(1, 8, 8), seed: int = 0) -> torch.Tensor:
    return torch.rand(n, *image, generator=torch.Generator().manual_seed(seed))


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("init", ["default", "he", "xavier"])
@pytest.mark.parametrize("kind", KINDS)
def test_shape_seeded_init_and_every_tensor_set(kind, init):
    model = build_model(config(kind, init=init), seed=1)
    first = tensors(model)  # before a training-mode forward moves BatchNorm's running stats
    logits = model(images())
    assert logits.shape == (4, 10) and logits.dtype == torch.float32
    assert all(v.float().isfinite().all() for v in first.values())
    assert {"mean", "std"} <= first.keys()
    # every parameter and buffer is written by init_weights: garbage in, the seed's weights out
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(float("nan") if t.is_floating_point() else 12345)
    model.init_weights(1)
    assert all(torch.equal(first[k], v) for k, v in model.state_dict().items())
    other = tensors(build_model(config(kind, init=init), seed=2))
    assert any(not torch.equal(first[k], other[k]) for k in first if first[k].is_floating_point())


def test_gpt_kind_is_still_a_gpt():
    assert type(build_model(ModelConfig(vocab_size=64, n_layer=1, d_model=16, n_head=2), seed=0)) is GPT


def test_missing_classes_or_image_is_refused():
    with pytest.raises(ConfigError, match="model.classes"):
        build_model(ModelConfig(kind="mlp", n_layer=1, d_model=8, n_head=1))


@pytest.mark.parametrize("kind", KINDS)
def test_normalization_is_applied_first(kind):
    model = build_model(config(kind, image=[3, 8, 8]), seed=0).eval()
    x = images(image=(3, 8, 8))
    mean, std = [0.1, 0.5, 0.9], [0.2, 0.3, 0.4]
    expected = model((x - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None])
    model.set_normalization(mean, std)
    torch.testing.assert_close(model(x), expected)
    assert model.state_dict()["std"].tolist() == pytest.approx(std)
    with pytest.raises(ValueError):
        model.set_normalization([0.0], [1.0])


def test_default_init_is_pytorchs_reset_parameters():
    for module in (nn.Linear(40, 30), nn.Conv2d(3, 8, 3)):
        torch.manual_seed(0)
        module.reset_parameters()
        reference = tensors(module)
        torch.manual_seed(0)
        init_weight(module, "default", None)
        assert all(torch.equal(reference[k], v) for k, v in module.state_dict().items())


@pytest.mark.parametrize("init", ["he", "xavier"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_he_and_xavier_std(kind, init):
    model = build_model(config(kind, init=init, image=[3, 16, 16], d_model=64, n_layer=2), seed=0)
    weight = model.layers["1"].linear.weight if kind == "mlp" else model.layers["1"].conv2.weight
    fan_in, fan_out = weight[0].numel(), weight.size(0) * weight[0, 0].numel()
    want = math.sqrt(2 / fan_in) if init == "he" else math.sqrt(2 / (fan_in + fan_out))
    assert weight.std().item() == pytest.approx(want, rel=0.1)
    assert all(
        (m.bias == 0).all() for m in model.modules() if isinstance(m, nn.Linear) and m.bias is not None
    )


@pytest.mark.parametrize(("norm", "kind"), [("batchnorm", nn.BatchNorm2d), ("layernorm", nn.GroupNorm),
                                            ("none", nn.Identity)])  # fmt: skip
def test_cnn_norms(norm, kind):
    model = build_model(config("cnn", norm=norm), seed=0)
    stage = model.layers["0"]
    assert type(stage.norm1) is kind and type(stage.norm2) is kind
    assert norm != "layernorm" or stage.norm1.num_groups == 1
    assert (stage.conv1.bias is None) == (norm != "none")
    with pytest.raises(ConfigError, match="rmsnorm"):
        build_model(config("cnn", norm="rmsnorm"))


def test_mlp_norms():
    for norm, kind in [("batchnorm", nn.BatchNorm1d), ("layernorm", nn.LayerNorm), ("none", nn.Identity)]:
        assert type(build_model(config("mlp", norm=norm), seed=0).layers["0"].norm) is kind


@pytest.mark.parametrize(("image", "n_layer", "sides"), [([1, 8, 8], 2, [4, 2]), ([1, 28, 28], 3, [14, 7, 3]),
                                                         ([1, 8, 8], 4, [4, 2, 1, 1])])  # fmt: skip
def test_cnn_spatial_sizes(image, n_layer, sides):
    model = build_model(config("cnn", image=image, n_layer=n_layer, d_model=4), seed=0)
    x = images(2, image)
    for i, side in enumerate(sides):
        x = model.layers[str(i)](x)  # each stage alone
        assert x.shape == (2, 4 * 2**i, side, side)


def test_vit_uses_ember_blocks_bidirectionally():
    model = build_model(config("vit"), seed=0)
    assert all(isinstance(b, Block) and b.attention.causal is False for b in model.layers.values())
    x = images(1)
    y = x.clone()
    y[..., 6:, 6:] = 0.5  # only the last patch
    assert not torch.allclose(model(x), model(y))  # the class token, first, sees the last patch
    tokens = model.stem(x)
    assert tokens.shape == (1, 17, 16) and model.layers["0"](tokens).shape == (1, 17, 16)
    with pytest.raises(ConfigError, match=r"patch=3 does not divide.*\[1, 2, 4, 8\]"):
        build_model(config("vit", patch=3))


def test_mlp_flops_are_six_times_the_macs():
    model = build_model(config("mlp", image=[3, 8, 8], d_model=32, n_layer=3), seed=0)
    macs = 3 * 8 * 8 * 32 + 2 * 32 * 32 + 32 * 10
    assert model.flops_per_token(seq_len=1) == 3 * 2 * macs
    assert build_model(config("vit"), seed=0).flops_per_token(1) > 6 * 2 * 17 * 16 * 16 * 2  # attention too


def test_compiled_cnn_matches_eager():
    model = build_model(config("cnn", d_model=4), seed=0).eval()
    x = images(2)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # inductor: 13 s on CPU
    torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_every_parameter(kind):
    model = build_model(config(kind), seed=0)
    model(images()).logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
