"""Tokenizers: byte-level BPE or characters, one interface, one ``tokenizer.json``.

    tok = Tokenizer.train_bpe(texts, vocab_size=4096)      # or Tokenizer.train_char(texts, 512)
    ids = tok.encode("def f(x):\\n    return x")
    assert tok.decode(ids) == "def f(x):\\n    return x"
    tok.save("tokenizer.json"); tok = Tokenizer.load("tokenizer.json")

Design choices (docs/data.md, "Tokenizers", has the details):

- Both kinds are HF ``tokenizers`` objects (Rust, parallel), saved as one standard
  ``tokenizer.json``: tokenization is not what ember studies, so we wrap rather than write BPE.
- Byte-level BPE sees UTF-8 bytes, so ``decode(encode(s)) == s`` for every string. The
  character tokenizer is a BPE model with no merges over the most frequent characters; one
  outside that alphabet encodes to ``<|unk|>`` (decoded as U+FFFD).
- Special tokens sit at fixed ids 0..len(SPECIAL_TOKENS)-1 in both kinds. Text that happens to
  contain ``<|eos|>`` is encoded as ordinary characters (``encode_special_tokens``), so
  documents cannot inject control tokens; special ids are added by code.
- A *foreign* tokenizer (imported by ``ember import hf``) keeps its own ``tokenizer.json``
  untouched, with a small ``specials.json`` beside it naming its bos/eos/pad/unk, which
  ``Tokenizer.load`` reads, so every verb reads an imported run with nothing else. eos is
  required; a missing pad is eos, as transformers users set it. Text is encoded without the
  tokenizer's template, the same ids as transformers' ``add_special_tokens=False``.
- ``token_byte_lengths`` counts the UTF-8 bytes a token stands for, 0 for special and added
  ones, so bits per byte compare across tokenizers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

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


SPECIALS_FILE = "specials.json"  # beside a foreign tokenizer.json: its special tokens by role
ROLES = ("bos", "eos", "pad", "unk")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode alphabet, inverted: each printable stand-in back to its byte
    (the table HF ``tokenizers``' ByteLevel uses; openai/gpt-2 encoder.py ``bytes_to_unicode``)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]  # stand in as chr(256), chr(257), ...
    return {chr(b): b for b in keep} | {chr(256 + i): b for i, b in enumerate(shifted)}


def _parts(component) -> list[dict]:
    """A tokenizer.json component (pre_tokenizer, decoder, ...) and its nested parts, flat."""
    if not isinstance(component, dict):
        return []
    parts = [component]
    for key in ("pretokenizers", "decoders", "normalizers", "processors"):
        for sub in component.get(key) or []:
            parts += _parts(sub)
    return parts


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

    def __init__(self, hf: HFTokenizer, specials: dict[str, str | None] | None = None):
        """``specials`` None: ember's own layout (its special tokens at ids 0..15). Otherwise a
        foreign tokenizer's special tokens by role (``bos``, ``eos``, ``pad``, ``unk``; token
        strings or None), as ``specials.json`` stores them."""
        hf.encode_special_tokens = True  # not stored in tokenizer.json; see module docstring
        self.hf = hf
        self._inner: HFTokenizer | None = None  # encode_after_special's tokenizer, made on first use
        self.vocab_size = hf.get_vocab_size()
        self.specials = None if specials is None else {role: specials.get(role) for role in ROLES}
        if specials is None:
            for i, tok in enumerate(SPECIAL_TOKENS):
                if hf.token_to_id(tok) != i:
                    raise DataError(
                        f"tokenizer special token {tok!r} is not at id {i}; this is not an ember tokenizer"
                    )
            self.kind = "bpe" if hf.pre_tokenizer is not None else "char"
            self.bos_id, self.eos_id, self.pad_id, self.unk_id = range(4)
            return
        unknown = sorted(set(specials) - set(ROLES))
        if unknown:
            raise DataError(f"special token roles {unknown} are not known; use {', '.join(ROLES)}")
        ids = {}
        for role, tok in self.specials.items():
            if tok is not None and (not isinstance(tok, str) or hf.token_to_id(tok) is None):
                raise DataError(f"{role} token {tok!r} is not in the tokenizer's vocabulary")
            ids[role] = None if tok is None else hf.token_to_id(tok)
        if ids["eos"] is None:
            raise DataError("the tokenizer has no eos token; ember needs one to end documents and generation")
        self.kind = "bpe"  # BPE-family subwords; ember's config knows no other foreign kind
        self.bos_id, self.eos_id, self.unk_id = ids["bos"], ids["eos"], ids["unk"]
        self.pad_id = ids["pad"] if ids["pad"] is not None else ids["eos"]  # as transformers users do

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

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_after_special(self, text: str) -> list[int]:
        """The ids of ``text`` where it follows a special token in a longer text (a chat turn's
        content), as transformers tokenizes a rendered chat template. That is ``encode(text)``
        except for a Metaspace tokenizer that prepends ``▁`` only at the start of a text
        (Llama's ``prepend_scheme="first"``), which prepends nothing there."""
        if self._inner is None:
            spec = json.loads(self.to_str())
            firsts = [p for p in _parts(spec.get("pre_tokenizer")) if p.get("prepend_scheme") == "first"]
            for part in firsts:
                part["prepend_scheme"] = "never"
            self._inner = HFTokenizer.from_str(json.dumps(spec)) if firsts else self.hf
            self._inner.encode_special_tokens = True
        return self._inner.encode(text, add_special_tokens=False).ids

    def add_special_tokens(self, tokens: Sequence[str]) -> list[str]:
        """Append those of ``tokens`` the vocabulary lacks as special tokens (matched only when
        code adds their ids, never in text); returns them, in id order."""
        missing = [t for t in tokens if self.hf.token_to_id(t) is None]
        self.hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        self.vocab_size, self._inner = self.hf.get_vocab_size(), None
        return missing

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
        pad = [0] * ((vocab_size or self.vocab_size) - self.vocab_size)
        if self.specials is not None:
            return self._foreign_byte_lengths() + pad
        tokens = [self.hf.id_to_token(i) for i in range(len(SPECIAL_TOKENS), self.vocab_size)]
        lengths = [len(t if self.kind == "bpe" else t.encode()) for t in tokens]
        return [0] * len(SPECIAL_TOKENS) + lengths + pad

    def _foreign_byte_lengths(self) -> list[int]:
        spec = json.loads(self.to_str())
        parts = _parts(spec.get("pre_tokenizer")) + _parts(spec.get("decoder"))
        byte_level = any(p.get("type") == "ByteLevel" for p in parts)
        byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
        space = next((p["replacement"] for p in parts if p.get("type") == "Metaspace"), "\u2581")
        to_byte = _byte_decoder()
        added = set(self.hf.get_added_tokens_decoder())
        lengths = []
        for i in range(self.vocab_size):
            tok = self.hf.id_to_token(i)
            if i in added or tok is None:
                lengths.append(0)
            elif byte_level:  # one alphabet symbol per byte
                lengths.append(sum(1 if c in to_byte else len(c.encode()) for c in tok))
            elif byte_fallback and _BYTE_TOKEN.fullmatch(tok):
                lengths.append(1)
            else:
                lengths.append(len(tok.replace(space, " ").encode()))
        return lengths

    def id_to_token(self, i: int) -> str | None:
        return self.hf.id_to_token(i)

    def to_str(self) -> str:
        return self.hf.to_str()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_str().encode("utf-8")).hexdigest()

    def save(self, path: str | os.PathLike) -> str:
        """Write atomically (temp file then rename); returns the sha256 of the file written. A
        foreign tokenizer also writes its ``specials.json`` beside ``path``."""
        text = self.to_str()
        self.save_specials(Path(path).parent)
        write_text_atomic(path, text)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def save_specials(self, directory: str | os.PathLike) -> None:
        """Write ``specials.json`` into ``directory`` (nothing for ember's own layout)."""
        if self.specials is not None:
            write_text_atomic(Path(directory) / SPECIALS_FILE, json.dumps(self.specials, indent=2) + "\n")

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
        specials_path = path.with_name(SPECIALS_FILE)
        if not specials_path.is_file():
            return cls(hf)
        try:
            specials = json.loads(specials_path.read_text(encoding="utf-8"))
            if not isinstance(specials, dict):
                raise ValueError("not a JSON object")
            return cls(hf, specials)
        except (OSError, ValueError, DataError) as e:  # ValueError: bad JSON or UTF-8
            raise DataError(
                f"{specials_path} is not valid ({e}); write its bos/eos/pad/unk tokens again "
                "(`ember import hf` writes it)"
            ) from None

    def special_tokens(self) -> dict[str, str | None]:
        """The special token strings by role (``bos``, ``eos``, ``pad``, ``unk``), pad resolved."""
        ids = {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id, "unk": self.unk_id}
        return {role: None if i is None else self.hf.id_to_token(i) for role, i in ids.items()}

    def describe(self) -> dict:
        if self.specials is None:
            specials = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
        else:
            specials = {tok: self.hf.token_to_id(tok) for tok in self.special_tokens().values() if tok}
        return {"kind": self.kind, "vocab_size": self.vocab_size, "special_tokens": specials}


def file_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
