"""Tokenizers: round trips (property-based for BPE), specials, save/load, errors."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.data.tokenizer import SPECIAL_TOKENS, Tokenizer, min_vocab_size
from ember.errors import DataError

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 20,
    "naïve café — 東京 🙂 résumé\n\ttabs and  spaces",
    "for i in range(10):\n    print(i ** 2)\n" * 10,
]


@pytest.fixture(scope="module")
def bpe():
    return Tokenizer.train_bpe(CORPUS, vocab_size=400)


@pytest.fixture(scope="module")
def char():
    return Tokenizer.train_char(CORPUS, vocab_size=64)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text())
def test_bpe_round_trips_any_unicode(bpe, s):
    assert bpe.decode(bpe.encode(s)) == s


def test_bpe_basics(bpe):
    assert bpe.kind == "bpe"
    assert 256 + len(SPECIAL_TOKENS) < bpe.vocab_size <= 400  # stops early when no pair repeats
    for i, tok in enumerate(SPECIAL_TOKENS):
        assert bpe.id_to_token(i) == tok
    assert (bpe.bos_id, bpe.eos_id, bpe.pad_id, bpe.unk_id) == (0, 1, 2, 3)
    # merges learned: common text is shorter than its bytes
    assert len(bpe.encode("The quick brown fox")) < len("The quick brown fox")
    # literal special-token text is plain text, never the control id
    ids = bpe.encode("a <|eos|> b")
    assert bpe.eos_id not in ids and bpe.decode(ids) == "a <|eos|> b"
    assert bpe.encode_batch(CORPUS) == [bpe.encode(t) for t in CORPUS]


def test_bpe_training_is_deterministic(bpe):
    assert Tokenizer.train_bpe(CORPUS, vocab_size=400).sha256 == bpe.sha256


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_char_round_trips_over_alphabet(char, data):
    alphabet = sorted({c for t in CORPUS for c in t})
    s = data.draw(st.text(alphabet=alphabet))
    assert char.decode(char.encode(s)) == s
    assert len(char.encode(s)) == len(s)


def test_char_unknown_policy():
    tok = Tokenizer.train_char(["aaab"], vocab_size=len(SPECIAL_TOKENS) + 2)
    assert tok.kind == "char" and tok.vocab_size == len(SPECIAL_TOKENS) + 2
    ids = tok.encode("abz")
    assert ids[2] == tok.unk_id
    assert tok.decode(ids) == "ab\ufffd"
    # when the alphabet is capped, the most frequent characters win
    capped = Tokenizer.train_char(["aaabbc"], vocab_size=len(SPECIAL_TOKENS) + 2)
    assert capped.encode("abc") == [len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + 1, capped.unk_id]


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_save_load_round_trip(tmp_path, kind, bpe, char):
    tok = bpe if kind == "bpe" else char
    sha = tok.save(tmp_path / "tokenizer.json")
    loaded = Tokenizer.load(tmp_path / "tokenizer.json")
    assert sha == tok.sha256 == loaded.sha256
    assert loaded.kind == kind
    text = CORPUS[2]
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.encode("<|bos|>") == tok.encode("<|bos|>") != [0]


def test_vocab_too_small_and_bad_files(tmp_path):
    with pytest.raises(DataError, match=f"at least {min_vocab_size('bpe')}"):
        Tokenizer.train("bpe", CORPUS, vocab_size=100)
    with pytest.raises(DataError, match="too small"):
        Tokenizer.train("char", CORPUS, vocab_size=len(SPECIAL_TOKENS))
    with pytest.raises(DataError, match="not found"):
        Tokenizer.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        Tokenizer.load(tmp_path / "bad.json")


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_token_byte_lengths_sum_to_utf8_bytes(kind, bpe, char):
    tok = bpe if kind == "bpe" else char
    lengths = tok.token_byte_lengths()
    assert lengths[: len(SPECIAL_TOKENS)] == [0] * len(SPECIAL_TOKENS)
    for text in CORPUS:
        assert sum(lengths[i] for i in tok.encode(text)) == len(text.encode("utf-8"))
    # a model's vocabulary rounded up past the tokenizer's: the extra ids stand for no bytes
    assert tok.token_byte_lengths(tok.vocab_size + 5) == lengths + [0] * 5
