"""Which document goes to which split: ``train``, ``val`` (model selection) and ``test``
(held out by origin, read by nothing that trains or chooses a model).

    plan = plan_splits(train_sources, test_sources, cfg.data)   # one cheap pass over the text
    plan.split_of(doc.stratum, content_digest(doc.text))        # "train" | "val" | "test" | None

The rules, each a pure function of the documents' content and the config (docs/eval.md,
"Three splits", has them at length):

- **val** is drawn per *stratum* (a source, or one part of an embedded one) and within it per
  *group* (a file's top-level folder) by *systematic sampling*: documents in order of size (ties
  by content digest), every 1/``data.val_fraction``-th from an offset hashed from the group's
  digests, so val holds every kind of text in the proportion of its bytes, small and large files
  alike. Why so careful: 2% of the *documents* drew 12 files, two of them codec tables; 5% of
  the bytes by plain hash order still drew four codec tables (19% of val against 13% of train)
  and val loss sat 0.26 nats below the same model's loss on train windows. The size is 5% of the
  bytes in expectation, ~170k tokens here (BPE-4096: ~3.5 bytes a token; tokens cannot be
  counted before the split exists, since the tokenizer is trained on the training split).
- **test** comes from ``data.test_sources`` (CPython's own test suite for the ``python``
  preset), sampled the same way to about ``data.test_bytes``, duplicates of training documents
  dropped; without test sources, ``data.test_fraction`` of each training group is taken from
  what val left. ``plan.rule`` says which rule applied and goes into the manifest.
- A stratum always keeps at least one training document.

Choosing by digest makes a document's split independent of listing order and machine; adding
files to a folder can move that folder's documents between splits, never another folder's.
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
