"""Tokenizers: byte-level BPE or characters, one interface, one ``tokenizer.json``.

    tok = Tokenizer.train_bpe(texts, vocab_size=4096)      # or Tokenizer.train_char(texts, 512)
    ids = tok.encode("def f(x):\\n    return x")
    assert tok.decode(ids) == "def f(x):\\n    return x"
    tok.save("tokenizer.json"); tok = Tokenizer.load("tokenizer.json")

Design choices:

- Both kinds are HF ``tokenizers`` objects (BPE training and encoding run in Rust, in
  parallel), so both save as one standard ``tokenizer.json`` that other tools can read.
  We wrap it rather than writing BPE by hand: tokenization is not what ember studies.
- Byte-level BPE sees UTF-8 bytes, so ``decode(encode(s)) == s`` for every string.
- The character tokenizer is a BPE model with no merges over the most frequent
  ``vocab_size - len(SPECIAL_TOKENS)`` characters of the training text. Unknown-character
  policy: a character outside that alphabet encodes to ``<|unk|>``, which decodes to
  U+FFFD. Round trips are exact for strings over the alphabet.
- Special tokens sit at fixed ids 0..len(SPECIAL_TOKENS)-1 in both kinds: ``<|bos|>``,
  ``<|eos|>``, ``<|pad|>``, ``<|unk|>``, chat roles reserved for post-training, and spare
  slots. Text that happens to contain ``<|eos|>`` is encoded as ordinary characters
  (``encode_special_tokens``), so documents cannot inject control tokens; special ids are
  added by code (the shard writer appends ``eos_id`` after each document).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ember.atomic import write_text_atomic
from ember.config import TOKENIZER_KINDS as KINDS
from ember.errors import DataError

SPECIAL_TOKENS = [
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|unk|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end_turn|>",
    *(f"<|reserved_{i}|>" for i in range(8)),
]


def min_vocab_size(kind: str) -> int:
    """Specials plus the 256 byte symbols (BPE) or at least one character (char)."""
    return len(SPECIAL_TOKENS) + (256 if kind == "bpe" else 1)


def _check_vocab(kind: str, vocab_size: int) -> None:
    need = min_vocab_size(kind)
    if vocab_size < need:
        raise DataError(
            f"data.vocab_size={vocab_size} is too small for a {kind} tokenizer: "
            f"{len(SPECIAL_TOKENS)} special tokens"
            + (" plus 256 byte symbols" if kind == "bpe" else " plus at least one character")
            + f" need at least {need}; raise data.vocab_size"
        )


class Tokenizer:
    """A trained tokenizer: ``encode``, ``encode_batch``, ``decode`` and the special ids."""

    def __init__(self, hf: HFTokenizer):
        hf.encode_special_tokens = True  # not stored in tokenizer.json; see module docstring
        self.hf = hf
        for i, tok in enumerate(SPECIAL_TOKENS):
            if hf.token_to_id(tok) != i:
                raise DataError(
                    f"tokenizer special token {tok!r} is not at id {i}; this is not an ember tokenizer"
                )
        self.kind = "bpe" if hf.pre_tokenizer is not None else "char"
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = range(4)
        self.vocab_size = hf.get_vocab_size()

    # ------------------------------------------------------------------ training

    @classmethod
    def train(cls, kind: str, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        if kind not in KINDS:
            raise DataError(f"unknown tokenizer kind {kind!r}; choose one of {', '.join(KINDS)}")
        return cls.train_bpe(texts, vocab_size) if kind == "bpe" else cls.train_char(texts, vocab_size)

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        _check_vocab("bpe", vocab_size)
        hf = HFTokenizer(models.BPE())
        # GPT-2's regex split keeps merges inside words, numbers and whitespace runs.
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer=trainer)
        return cls(hf)

    @classmethod
    def train_char(cls, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        _check_vocab("char", vocab_size)
        counts: Counter[str] = Counter()
        for text in texts:
            counts.update(text)
        for tok in SPECIAL_TOKENS:  # never let a literal special string's chars steal ids twice
            counts.pop(tok, None)
        # Most frequent first, ties by code point; ids then follow code point order.
        alphabet = sorted(sorted(counts, key=lambda c: (-counts[c], c))[: vocab_size - len(SPECIAL_TOKENS)])
        if not alphabet:
            raise DataError("cannot train a char tokenizer on empty text; check data.sources")
        vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
        vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(alphabet)})
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
        hf.add_special_tokens(SPECIAL_TOKENS)
        hf.decoder = decoders.Sequence([decoders.Replace("<|unk|>", "\ufffd"), decoders.Fuse()])
        return cls(hf)

    # ------------------------------------------------------------------ use

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts in parallel (Rust threads, all cores)."""
        return [e.ids for e in self.hf.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def token_byte_lengths(self, vocab_size: int | None = None) -> list[int]:
        """UTF-8 bytes each id stands for, the table behind every bits per byte; 0 for special
        tokens and for ids up to ``vocab_size`` (a model's, rounded up) beyond the tokenizer's.
        Byte-level BPE tokens are strings over a 256-symbol alphabet, one symbol per byte, so
        their length is exact even for tokens that are only part of a multi-byte character."""
        tokens = [self.hf.id_to_token(i) for i in range(len(SPECIAL_TOKENS), self.vocab_size)]
        lengths = [len(t if self.kind == "bpe" else t.encode()) for t in tokens]
        return [0] * len(SPECIAL_TOKENS) + lengths + [0] * ((vocab_size or self.vocab_size) - self.vocab_size)

    def id_to_token(self, i: int) -> str | None:
        return self.hf.id_to_token(i)

    # ------------------------------------------------------------------ files

    def to_str(self) -> str:
        return self.hf.to_str()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_str().encode("utf-8")).hexdigest()

    def save(self, path: str | os.PathLike) -> str:
        """Write atomically (temp file then rename); returns the sha256 of the file written."""
        text = self.to_str()
        write_text_atomic(path, text)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer file {path} not found; run `ember data prepare` to create it")
        try:
            hf = HFTokenizer.from_str(path.read_text(encoding="utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise DataError(
                f"{path} is not a valid tokenizer.json ({e}); re-run `ember data prepare --force`"
            ) from None
        return cls(hf)

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "special_tokens": {tok: i for i, tok in enumerate(SPECIAL_TOKENS)},
        }


def file_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
