"""Which document goes to which split: ``train``, ``val`` (model selection) and ``test``
(held out by origin, read by nothing that trains or chooses a model).

    plan = plan_splits(train_sources, test_sources, cfg.data)   # one cheap pass over the text
    plan.split_of(doc.stratum, content_digest(doc.text))        # "train" | "val" | "test" | None

The rules, each a pure function of the documents' content and the config:

- **val** is drawn per *stratum* (a source, or one part of an embedded one: the Python
  documentation, the standard library), so prose and code are both in it, and within a
  stratum per *group* (the top-level folder a file sits in: ``encodings/``, ``email/``, the
  modules at the root). In each group every document has the same chance,
  ``data.val_fraction``, by *systematic sampling*: the documents in order of size (ties by
  content digest), every 1/fraction-th one from an offset given by a hash of the group's
  digests. Each document is then in val with probability ``val_fraction``, so val holds every
  kind of text in the proportion of its bytes in the corpus, and the size order spreads the
  picks over small and large files (a folder of big easy tables and small hard modules gives
  both). Why so careful: a split of 2% of the *documents* drew 12 files, two of them codec
  tables; 5% of the bytes by plain hash order still drew four codec tables (19% of val
  against 13% of train) and val loss sat 0.26 nats below the same model's loss on train
  windows. The size follows: 5% of the bytes in expectation, ~170k tokens here (BPE-4096
  gives ~3.5 bytes per token; the tokenizer is trained on the training split, so tokens
  cannot be counted before the split exists).
- **test** comes from ``data.test_sources`` (the ``python`` preset: CPython's own test
  suite, which the training sources leave out), sampled the same way from every group of
  them (``test_asyncio/``, the root ``test_*.py``, ...) with the fraction that makes about
  ``data.test_bytes``; a test document that duplicates a training one is dropped
  (deduplication sees the training sources first). Without test sources (none given, or
  ``embedded:python-tests`` missing from this Python), ``data.test_fraction`` of each
  training group is sampled the same way from what val left. ``plan.rule`` says which rule
  applied and goes into the manifest.
- A stratum always keeps at least one training document.
- Adding files to a folder can move documents of that folder between splits (the size ranks
  shift); other folders are untouched.

Choosing by digest means a document's split does not depend on where it sits in a file
listing or on the machine; the per-stratum thresholds do depend on the stratum's total, so
adding documents to a source can move a few documents near the threshold.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from ember.data.clean import Cleaner, content_digest


@dataclass
class SplitPlan:
    assign: dict[tuple[str, bytes], str] = field(default_factory=dict)
    rule: dict = field(default_factory=dict)

    def split_of(self, stratum: str, digest: bytes) -> str | None:
        """The split of a kept document; None for a test-source document left out of test."""
        return self.assign.get((stratum, digest))


Doc = tuple[bytes, int]  # (content digest, UTF-8 bytes)


def _scan(sources, cleaner: Cleaner) -> dict[str, dict[str, list[Doc]]]:
    """{stratum: {group: [(digest, bytes), ...]}} of the documents that survive cleaning."""
    strata: dict[str, dict[str, list[Doc]]] = {}
    for source in sources:
        for doc in source.documents():
            digest = content_digest(doc.text)
            if cleaner.keep(doc.text, digest):
                group = strata.setdefault(doc.stratum, {}).setdefault(doc.group, [])
                group.append((digest, len(doc.text.encode("utf-8"))))
    return strata


def _sample(docs: list[Doc], fraction: float, salt: bytes) -> list[bytes]:
    """Systematic sample: the documents by size (ties by digest), each taken when the running
    count ``(i + 1) * fraction + u`` crosses an integer; ``u`` in [0, 1) is hashed from the
    group's digests and ``salt``. Every document has probability ``fraction``."""
    if fraction <= 0 or not docs:
        return []
    order = sorted(docs, key=lambda d: (d[1], d[0]))
    seed = hashlib.blake2b(salt + b"".join(sorted(d for d, _ in docs)), digest_size=8).digest()
    u = int.from_bytes(seed, "big") / 2.0**64
    return [
        d
        for i, (d, _) in enumerate(order)
        if math.floor((i + 1) * fraction + u) > math.floor(i * fraction + u)
    ]


def _keep_one(plan: SplitPlan, stratum: str, groups: dict[str, list[Doc]], split: str) -> None:
    """If no training document is left in the stratum, give one back (the smallest digest)."""
    digests = sorted(d for docs in groups.values() for d, _ in docs)
    if digests and all(plan.assign[(stratum, d)] != "train" for d in digests):
        plan.assign[(stratum, next(d for d in digests if plan.assign[(stratum, d)] == split))] = "train"


def plan_splits(train_sources, test_sources, data_cfg) -> SplitPlan:
    """Read the sources once (cleaning as ``prepare`` will) and assign every kept document."""
    cleaner = Cleaner(data_cfg.min_chars, data_cfg.max_nontext_fraction, data_cfg.dedup)
    train_strata = _scan(train_sources, cleaner)
    test_strata = _scan(test_sources, cleaner)
    plan = SplitPlan()
    for stratum, groups in train_strata.items():
        for docs in groups.values():
            plan.assign.update({(stratum, digest): "train" for digest, _ in docs})
            plan.assign.update({(stratum, d): "val" for d in _sample(docs, data_cfg.val_fraction, b"val")})
        _keep_one(plan, stratum, groups, "val")
    plan.rule["val"] = (
        f"per stratum and top-level folder, a systematic sample of {data_cfg.val_fraction:g} of the "
        "documents by size, hashed offset"
    )

    if test_strata:
        available = sum(n for groups in test_strata.values() for docs in groups.values() for _, n in docs)
        share = min(1.0, (data_cfg.test_bytes or available) / available)
        for stratum, groups in test_strata.items():
            for docs in groups.values():
                plan.assign.update({(stratum, d): "test" for d in _sample(docs, share, b"test")})
        plan.rule["test"] = (
            f"held out by origin: {', '.join(s.spec for s in test_sources)}, per top-level folder a "
            f"systematic sample of {share:.3g} of the documents by size "
            f"(data.test_bytes={data_cfg.test_bytes:,})"
        )
    elif data_cfg.test_fraction > 0:
        share = data_cfg.test_fraction / (1.0 - data_cfg.val_fraction)
        for stratum, groups in train_strata.items():
            for docs in groups.values():
                pool = [(d, n) for d, n in docs if plan.assign[(stratum, d)] == "train"]
                plan.assign.update({(stratum, d): "test" for d in _sample(pool, share, b"test")})
            _keep_one(plan, stratum, groups, "test")
        plan.rule["test"] = (
            f"hashed share of the training sources: per stratum and top-level folder, a systematic "
            f"sample of {data_cfg.test_fraction:g} of the documents by size, from what val left"
        )
    else:
        plan.rule["test"] = "none (no data.test_sources and data.test_fraction=0)"
    return plan
