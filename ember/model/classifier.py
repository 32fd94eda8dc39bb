"""What the image classifiers (mlp.py, cnn.py, vit.py) share: ``Classifier``, their base class.

    model = build_model(ModelConfig(kind="cnn", classes=10, image=[1, 8, 8]), seed=0)  # vision.py
    model.set_normalization([0.13], [0.31])           # the training data's per-channel statistics
    logits = model(images)                            # (B, 1, 8, 8) raw pixels in [0, 1] -> (B, 10) fp32

Design choices:

- The input is raw pixels everywhere: the forward normalises first, (x - mean) / std per channel,
  with ``mean`` and ``std`` persistent buffers, so the statistics travel in the saved weights.
- ``forward`` is stem -> ``layers`` (string-keyed, one tensor in and out, as GPT's, so ember's
  layouts wrap each entry) -> head -> ``output``; a subclass only builds those four.
- Built like GPT (DESIGN rule 1): meta, ``to_empty``, ``init_weights(seed)``, which sets every
  parameter and buffer by ``model.init``: ``default`` PyTorch's own init, U(+-1/sqrt(fan_in)) on
  weight and bias (what ``reset_parameters`` draws, here from a seedable generator); ``he`` Kaiming
  normal, std sqrt(2 / fan_in) (He et al. 2015); ``xavier`` Glorot normal, std
  sqrt(2 / (fan_in + fan_out)) (Glorot & Bengio 2010); biases 0 for both; norms 1 and 0.
  A module holding other tensors defines ``init_weights(std, generator)`` (GPT's contract).
- A file separate from vision.py (which builds by ``model.kind``) because the classifiers import
  this base, and two modules may not import each other (tests/test_architecture.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from ember.config import ModelConfig
from ember.errors import ConfigError

NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d)


@torch.no_grad()
def init_weight(module: nn.Linear | nn.Conv2d, init: str, generator: torch.Generator | None) -> None:
    """One linear or conv by ``model.init`` (the module docstring)."""
    if init == "default":  # kaiming_uniform_(a=sqrt(5)) reduces to this bound
        bound = 1 / math.sqrt(module.weight[0].numel())  # fan_in: in_features, or C_in * k * k
        nn.init.uniform_(module.weight, -bound, bound, generator=generator)
        if module.bias is not None:
            nn.init.uniform_(module.bias, -bound, bound, generator=generator)
        return
    if init == "he":
        nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu", generator=generator)
    else:
        nn.init.xavier_normal_(module.weight, generator=generator)
    if module.bias is not None:
        nn.init.zeros_(module.bias)


class Classifier(nn.Module):
    """Images (B, C, H, W) -> logits (B, classes); a subclass sets stem, layers, head, output."""

    stem: nn.Module
    layers: nn.ModuleDict
    head: nn.Module
    output: nn.Linear

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.classes < 1 or len(cfg.image) != 3:
            raise ConfigError(
                f"model.classes={cfg.classes}, model.image={cfg.image}: the trainer takes them from "
                "the data; code that builds a classifier itself sets both (classes=10, image=[1, 28, 28])"
            )
        self.cfg = cfg
        self.register_buffer("mean", torch.zeros(cfg.image[0]))  # (C,) of the training data
        self.register_buffer("std", torch.ones(cfg.image[0]))
        self._flops: int | None = None  # flops_per_token's count, once

    def forward(self, x: Tensor) -> Tensor:
        """x (B, C, H, W) raw pixels -> logits (B, classes), fp32."""
        x = (x - self.mean[:, None, None]) / self.std[:, None, None]
        x = self.stem(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.head(x)).float()

    @classmethod
    def build(
        cls, cfg: ModelConfig, device: str | torch.device = "cpu", seed: int | None = None
    ) -> Classifier:
        """Construct on the meta device, allocate on ``device``, initialise."""
        with torch.device("meta"):
            model = cls(cfg)
        model.to_empty(device=device)
        model.init_weights(seed)
        return model

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Every parameter and buffer; ``seed`` draws from a private generator, None the global RNG.
        The normalisation is reset to mean 0, std 1 (``set_normalization`` sets the data's)."""
        generator = None if seed is None else torch.Generator(device=self.mean.device).manual_seed(seed)
        self.mean.zero_()
        self.std.fill_(1.0)
        self.init_parameters(generator)

    def init_parameters(self, generator: torch.Generator | None) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                init_weight(module, self.cfg.init, generator)
            elif isinstance(module, NORM_TYPES):
                module.reset_parameters()  # weight 1, bias 0; BatchNorm's running stats 0, 1, count 0
            elif module is not self and [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                module.init_weights(self.cfg.init_std, generator)  # its own tensors (the ViT's tokens)

    @torch.no_grad()
    def set_normalization(self, mean: list[float], std: list[float]) -> None:
        """The training data's per-channel mean and std (over pixels in [0, 1]), C values each."""
        C = self.mean.numel()
        if len(mean) != C or len(std) != C or min(std) <= 0:
            raise ValueError(f"set_normalization wants {C} means and {C} positive stds, got {mean}, {std}")
        self.mean.copy_(torch.tensor(mean))
        self.std.copy_(torch.tensor(std))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward, 3x the forward) per image; ``seq_len`` is ignored (a
        "token" of an image task is an image). Counted once by FlopCounterMode on a meta copy (only
        the shapes matter), so it works wherever the parameters live, sharded or not."""
        if self._flops is None:
            with torch.device("meta"):
                copy, image = type(self)(self.cfg).eval(), torch.empty(1, *self.cfg.image)
            with FlopCounterMode(display=False) as counter:
                copy(image)
            self._flops = 3 * counter.get_total_flops()
        return self._flops
