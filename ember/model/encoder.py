"""The pieces a BERT-style encoder adds to ``GPT`` (``model.causal=false``, ``train.task=mlm``).

    ember train tiny train.task=mlm model.causal=false model.head=mlm model.norm_position=post \\
        model.gelu=erf model.pos=learned model.norm=layernorm model.mlp=gelu

BERT (Devlin et al. 2019) is ``GPT`` with four choices made at construction: bidirectional attention
(``gpt.full_attention``), post-norm blocks with a norm on the embeddings and none at the end
(``gpt.PostNormBlock``, ``model.norm_position=post``), the exact erf GELU (``model.gelu=erf``) and
the masked-LM head below (``model.head=mlm``), whose decoder is ``GPT.output``: tied to the word
embeddings, with a bias of its own. HF's token-type embeddings are not modelled: with one type
everywhere they are a constant vector, folded into the position embeddings on import
(ember/model/hf.py). This module imports nothing of ``gpt.py`` (which imports it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ember.config import ModelConfig


class MLMTransform(nn.Module):
    """BERT's prediction head transform, before the tied decoder: norm(gelu(dense(x))) (HF's
    ``cls.predictions.transform``). It gives the output layer a representation of its own, so
    the last block's output need not double as input embeddings of the vocabulary."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.approximate = {"tanh": "tanh", "erf": "none"}[cfg.gelu]

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        nn.init.normal_(self.dense.weight, mean=0.0, std=std, generator=generator)
        if self.dense.bias is not None:
            nn.init.zeros_(self.dense.bias)
        self.norm.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(F.gelu(self.dense(x), approximate=self.approximate))  # (..., C)
