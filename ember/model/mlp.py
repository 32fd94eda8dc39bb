"""The multilayer perceptron: flatten, ``n_layer`` hidden units, a linear head (``model.kind=mlp``).

    model.kind=mlp model.n_layer=2 model.d_model=256 model.norm=batchnorm model.init=he

A hidden unit is relu(norm(W x + b)), W (d_model, in); ``model.norm`` picks LayerNorm, RMSNorm,
BatchNorm1d (Ioffe & Szegedy 2015) or none. Softmax regression, no hidden unit, would be
n_layer=0, which the config does not allow (n_layer >= 1).
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from ember.config import ModelConfig
from ember.model.classifier import Classifier


def make_norm1d(cfg: ModelConfig, dim: int) -> nn.Module:
    norms = {
        "layernorm": lambda: nn.LayerNorm(dim, eps=cfg.norm_eps),
        "rmsnorm": lambda: nn.RMSNorm(dim, eps=cfg.norm_eps),
        "batchnorm": lambda: nn.BatchNorm1d(dim, eps=cfg.norm_eps),
        "none": nn.Identity,
    }
    return norms[cfg.norm]()


class Dense(nn.Module):
    """(B, d_in) -> relu(norm(linear(x))) (B, d_out)."""

    def __init__(self, cfg: ModelConfig, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.norm = make_norm1d(cfg, d_out)
        self.act = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.norm(self.linear(x)))


class MLP(Classifier):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        widths = [math.prod(cfg.image)] + [cfg.d_model] * cfg.n_layer
        self.stem = nn.Flatten()  # (B, C, H, W) -> (B, C*H*W)
        self.layers = nn.ModuleDict(
            {str(i): Dense(cfg, widths[i], widths[i + 1]) for i in range(cfg.n_layer)}
        )
        self.head = nn.Identity()
        self.output = nn.Linear(widths[-1], cfg.classes)
