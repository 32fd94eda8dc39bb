"""The masked-LM corruption (BERT, Devlin et al. 2019, §3.1): which positions a masked LM predicts,
and what it sees there. ``train.task=mlm`` trains on it and ``ember eval`` scores with it.

    inputs, targets = mask_tokens(x, seeded(seed, step), 0.15, mask_id(tokenizer), text)

The rule, on a batch ``x`` (B, T) of token ids:

- Only *text* tokens are chosen (``text[id]``: the token stands for UTF-8 bytes). ``<|eos|>``
  and the other specials never are, as BERT never masks [CLS]/[SEP] and HF's collator skips
  special tokens; bits per byte is then defined for every masked token.
- Each text position is chosen on its own with probability ``rate`` (a Bernoulli draw, as HF's
  ``DataCollatorForLanguageModeling`` does), so the count varies around ``rate`` per row.
- Of those chosen: 80% become the mask token, 10% a random text token (uniform over text ids),
  10% stay as they are, so the model cannot learn that an unmasked token is never a target.
- ``targets`` holds the original id where chosen, ``IGNORE`` elsewhere: the loss reads the chosen
  positions only.

The mask token is ``<|reserved_0|>`` (id 8), the first of the eight special ids every ember
tokenizer reserves: no tokenizer change, no embedding growth, and the shards stay as prepared.
A foreign tokenizer's own ``[MASK]`` or ``<mask>`` is used if it has one.

Every draw comes from ``generator`` on the CPU in a fixed order, so the corruption of a batch is
a pure function of the generator's seed (``seeded(seed, step, rank)``, a hash): resume stays bitwise.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from ember.errors import DataError

IGNORE = -100  # F.cross_entropy's ignore_index: positions that are not predicted
MASK_TOKENS = ("<|reserved_0|>", "[MASK]", "<mask>")  # ember's reserved id first, then BERT's, RoBERTa's


def mask_id(tokenizer) -> int:
    """The id of the mask token in ``tokenizer`` (module docstring), or a DataError."""
    for token in MASK_TOKENS:
        if (i := tokenizer.hf.token_to_id(token)) is not None:
            return i
    raise DataError(
        f"the tokenizer has none of the mask tokens {', '.join(MASK_TOKENS)}; train.task=mlm needs an "
        "ember tokenizer (`ember data prepare`) or one with [MASK]"
    )


def seeded(seed: int, step: int, rank: int = 0, purpose: str = "train") -> torch.Generator:
    """A CPU generator for the corruption of batch ``step`` on ``rank`` (``purpose``: "train", or
    "eval" for validation and ``ember eval``, so that their masks never repeat training's)."""
    key = hashlib.blake2b(f"{purpose}/{seed}/{step}/{rank}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(key, "little"))


def mask_tokens(
    x: Tensor, generator: torch.Generator, rate: float, mask: int, text: Tensor
) -> tuple[Tensor, Tensor]:
    """(inputs, targets), each like ``x`` (B, T) on x's device: ``x`` corrupted by the rule in the
    module docstring, and the ids to predict (``IGNORE`` where none). ``text`` (V,) bool: which
    ids are text tokens."""
    cpu, text = x.cpu(), text.cpu()
    u = torch.rand((3, *x.shape), generator=generator)  # chosen?, which corruption?, which random token?
    chosen = (u[0] < rate) & text[cpu]
    text_ids = text.nonzero().squeeze(1)
    random_ids = text_ids[(u[2] * len(text_ids)).long().clamp(max=len(text_ids) - 1)]
    inputs = torch.where(chosen & (u[1] < 0.8), mask, cpu)
    inputs = torch.where(chosen & (u[1] >= 0.8) & (u[1] < 0.9), random_ids, inputs)
    targets = torch.where(chosen, cpu, IGNORE)
    return inputs.to(x.device), targets.to(x.device)
