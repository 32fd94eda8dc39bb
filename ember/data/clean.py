"""Cleaning: drop documents that are too short, mostly non-text, or exact duplicates.

    cleaner = Cleaner(min_chars=1, max_nontext_fraction=0.3, dedup=True)
    kept = [d for d in docs if cleaner.keep(d.text, content_digest(d.text))]
    cleaner.counts  # {"too_short": .., "nontext": .., "duplicate": .., "kept": ..}

Design choices:

- "Non-text" means characters no prose or code contains on purpose: C0/C1 controls other
  than tab, newline and carriage return, the replacement character U+FFFD (left by bytes
  that were not UTF-8), private-use code points and non-characters. They are counted with
  one compiled regex, so the check runs at C speed.
- Exact deduplication keeps a set of 128-bit BLAKE2b digests of the kept texts. That is 16
  bytes of digest per unique document (plus Python's set overhead), so a corpus of tens
  of millions of documents fits; the text itself is never held.
- The same digest orders documents when the splits are drawn (``ember.data.splits``), so a
  document's split depends on its content, not on where it sits in a listing.
- Checks run in a fixed order (length, non-text, duplicate) and each drop is counted once,
  under the first check that failed.
"""

from __future__ import annotations

import hashlib
import re

NONTEXT = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ue000-\uf8ff\ufdd0-\ufdef\ufffd-\uffff]")


def content_digest(text: str) -> bytes:
    """16-byte BLAKE2b digest of the UTF-8 text (surrogates, if any, escaped)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def nontext_fraction(text: str) -> float:
    return len(NONTEXT.findall(text)) / len(text) if text else 0.0


class Cleaner:
    """Stateful filter (the duplicate set grows as documents pass)."""

    def __init__(self, min_chars: int = 1, max_nontext_fraction: float = 0.3, dedup: bool = True):
        self.min_chars = min_chars
        self.max_nontext_fraction = max_nontext_fraction
        self.dedup = dedup
        self.seen: set[bytes] = set()
        self.counts = {"too_short": 0, "nontext": 0, "duplicate": 0, "kept": 0}

    def keep(self, text: str, digest: bytes) -> bool:
        if len(text) < self.min_chars:
            reason = "too_short"
        elif self.max_nontext_fraction < 1.0 and nontext_fraction(text) > self.max_nontext_fraction:
            reason = "nontext"
        elif self.dedup and digest in self.seen:
            reason = "duplicate"
        else:
            if self.dedup:
                self.seen.add(digest)
            self.counts["kept"] += 1
            return True
        self.counts[reason] += 1
        return False
