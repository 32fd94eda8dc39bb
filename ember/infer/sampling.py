"""How to continue a prompt: one ``Sampling`` for ``Engine.generate`` and ``stream``,
``ember generate``, ``ember chat`` and, later, the server.

    engine.generate(["def main("], Sampling(max_new_tokens=64, temperature=0.8, top_k=50, seed=0))

Every option is checked once, here, when a ``Sampling`` is built, so a bad one fails before
any forward pass. No torch import: the CLI shows these defaults in ``--help`` without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.errors import EmberError


@dataclass(frozen=True)
class Sampling:
    """The options of one generation call; the CLI flags are these names with dashes."""

    max_new_tokens: int = 128  # tokens to generate at most per prompt
    temperature: float = 0.8  # 0 = greedy
    top_k: int | None = None  # sample among the k most likely tokens (None or 0: all)
    top_p: float | None = None  # nucleus: the smallest set of likeliest tokens with mass p (None or 1: all)
    seed: int = 0  # row i of a call samples with seed + i: same seed, same text
    stop: tuple[str, ...] = ()  # end a row where one of these appears (excluded from the text)
    ignore_eos: bool = False  # decode past <|eos|>, so every row makes max_new_tokens (benchmarks)

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)  # one string works too
        object.__setattr__(self, "stop", stop)
        if self.max_new_tokens < 1:
            raise EmberError(f"--max-new-tokens must be >= 1; got {self.max_new_tokens}")
        if not 0 <= self.temperature < float("inf"):  # also catches NaN
            raise EmberError(f"--temperature must be finite and >= 0 (0 = greedy); got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise EmberError(f"--top-k must be a number of tokens >= 0 (0/None: all); got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise EmberError(f"--top-p must be in (0, 1] (1 = no nucleus filter); got {self.top_p}")
        if any(not s for s in stop):
            raise EmberError("a stop string is empty; it would end every row at once")

    def check_seed(self, rows: int) -> None:
        """Row i samples with seed + i, which torch.Generator takes in [-2**63, 2**64 - 1]."""
        if not -(2**63) <= self.seed or self.seed + rows - 1 > 2**64 - 1:
            raise EmberError(
                f"--seed {self.seed} is out of range: row i of {rows} samples with seed + i, which must lie "
                f"in [-2**63, 2**64 - 1]; use a seed from -2**63 to {2**64 - rows}"
            )
