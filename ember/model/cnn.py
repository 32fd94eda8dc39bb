"""A small VGG-style CNN (Simonyan & Zisserman 2014) (``model.kind=cnn``).

    model.kind=cnn model.n_layer=3 model.d_model=32 model.norm=batchnorm model.init=he

``n_layer`` stages; stage i is d_model * 2**i channels wide: conv3x3 -> norm -> relu -> conv3x3 ->
norm -> relu -> 2x2 max-pool while the side is still >= 2 (8x8 with 2 stages: 8 -> 4 -> 2; 28x28
with 3: 28 -> 14 -> 7 -> 3). Then a global average pool and a linear head on the last width.
``model.norm``: batchnorm = BatchNorm2d (Ioffe & Szegedy 2015, statistics over the batch and the
pixels), layernorm = GroupNorm(1, C), which is LayerNorm over each image's (C, H, W) with a
per-channel scale and shift; none = no norm and biases in the convs (a norm makes them redundant).
"""

from __future__ import annotations

from torch import Tensor, nn

from ember.config import ModelConfig
from ember.errors import ConfigError
from ember.model.classifier import Classifier


def make_norm2d(cfg: ModelConfig, channels: int) -> nn.Module:
    norms = {
        "batchnorm": lambda: nn.BatchNorm2d(channels, eps=cfg.norm_eps),
        "layernorm": lambda: nn.GroupNorm(1, channels, eps=cfg.norm_eps),
        "none": nn.Identity,
    }
    if cfg.norm not in norms:
        raise ConfigError(f"model.norm={cfg.norm} is not built for model.kind=cnn; use {', '.join(norms)}")
    return norms[cfg.norm]()


class Stage(nn.Module):
    """(B, c_in, S, S) -> (B, c_out, S // 2, S // 2), or (B, c_out, S, S) without ``pool``."""

    def __init__(self, cfg: ModelConfig, c_in: int, c_out: int, pool: bool) -> None:
        super().__init__()
        bias = cfg.norm == "none"
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=bias)
        self.norm1 = make_norm2d(cfg, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=bias)
        self.norm2 = make_norm2d(cfg, c_out)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = self.act(self.norm1(self.conv1(x)))
        x = self.act(self.norm2(self.conv2(x)))
        return self.pool(x)


class CNN(Classifier):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        channels = [cfg.image[0]] + [cfg.d_model * 2**i for i in range(cfg.n_layer)]
        side, stages = min(cfg.image[1:]), {}
        for i in range(cfg.n_layer):
            stages[str(i)] = Stage(cfg, channels[i], channels[i + 1], pool=side >= 2)
            side = side // 2 if side >= 2 else side
        self.stem = nn.Identity()
        self.layers = nn.ModuleDict(stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())  # (B, C, S, S) -> (B, C)
        self.output = nn.Linear(channels[-1], cfg.classes)
