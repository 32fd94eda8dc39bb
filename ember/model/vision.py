"""``build_model``: the one constructor every caller uses, whatever ``model.kind`` says.

    model = build_model(cfg.model, device="cuda", seed=0)   # gpt: GPT.build; mlp, cnn, vit: a Classifier

The classifiers (mlp.py, cnn.py, vit.py, on the base in classifier.py) take images (B, C, H, W)
in [0, 1] and give logits (B, model.classes); ``model.classes`` and ``model.image`` come from the
data (the trainer fills them, ``replace(cfg.model, classes=..., image=[C, H, W])``, before building).
"""

from __future__ import annotations

import torch
from torch import nn

from ember.config import ModelConfig
from ember.model.cnn import CNN
from ember.model.gpt import GPT
from ember.model.mlp import MLP
from ember.model.vit import ViT

MODELS = {"gpt": GPT, "mlp": MLP, "cnn": CNN, "vit": ViT}  # model.kind


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int | None = None) -> nn.Module:
    """``model.kind``'s model, built on meta, allocated on ``device`` and initialised (seed None:
    the global RNG; a seed: a private generator, the same weights every time)."""
    return MODELS[cfg.kind].build(cfg, device, seed)
