"""A small Vision Transformer (Dosovitskiy et al. 2020, "An Image is Worth 16x16 Words") (``model.kind=vit``).

    model.kind=vit model.patch=4 model.n_layer=4 model.d_model=64 model.n_head=4

The image is cut into N = (H/p)(W/p) patches of p x p pixels, each projected to d_model (a
Conv2d with stride p); a learned class token goes first and learned positions (N + 1, d_model)
are added. Then ``n_layer`` of ember's own pre-norm ``Block`` (gpt.py), attention bidirectional
(``causal=False``, no RoPE), a final norm, and the linear head reads the class token.
``model.init=default`` is GPT's init at ``init_std`` (residual projections scaled down); he and
xavier apply to every linear and conv, as in the other classifiers. Tokens and positions are
always drawn N(0, init_std).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor, nn

from ember.config import ModelConfig
from ember.errors import ConfigError
from ember.model.classifier import Classifier
from ember.model.gpt import Block, init_module, make_norm


class Patches(nn.Module):
    """(B, C, H, W) -> (B, N + 1, d_model): class token, then the patches, plus positions."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        C, H, W = cfg.image
        p = cfg.patch
        if H % p or W % p:
            fits = [q for q in range(1, math.gcd(H, W) + 1) if math.gcd(H, W) % q == 0]
            raise ConfigError(
                f"model.patch={p} does not divide the {H}x{W} image; choose a patch that divides both: {fits}"
            )
        self.proj = nn.Conv2d(C, cfg.d_model, p, stride=p)
        self.cls = nn.Parameter(torch.empty(1, 1, cfg.d_model))
        self.pos = nn.Parameter(torch.empty(1, (H // p) * (W // p) + 1, cfg.d_model))

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        nn.init.normal_(self.proj.weight, std=std, generator=generator)
        nn.init.zeros_(self.proj.bias)
        nn.init.normal_(self.cls, std=std, generator=generator)
        nn.init.normal_(self.pos, std=std, generator=generator)

    def forward(self, x: Tensor) -> Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)  # (B, d, H/p, W/p) -> (B, N, d)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1)  # (B, N + 1, d)
        return x + self.pos


class EncoderBlock(Block):
    """gpt.Block with one tensor in and out (no RoPE, no cache), as ``model.layers`` entries are."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x, None)


class ClassToken(nn.Module):
    """(B, N + 1, d_model) -> the final norm of the class token, (B, d_model)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = make_norm(cfg, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x[:, 0])


class ViT(Classifier):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        encoder = replace(cfg, kind="gpt", causal=False, pos="none")  # every patch sees every patch
        self.stem = Patches(cfg)
        self.layers = nn.ModuleDict({str(i): EncoderBlock(encoder, str(i)) for i in range(cfg.n_layer)})
        self.head = ClassToken(cfg)
        self.output = nn.Linear(cfg.d_model, cfg.classes)

    def init_parameters(self, generator: torch.Generator | None) -> None:
        if self.cfg.init != "default":
            return super().init_parameters(generator)
        for module in self.children():
            init_module(module, self.cfg.init_std, generator)
