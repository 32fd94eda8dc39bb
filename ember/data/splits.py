"""Which document goes to which split: ``train``, ``val`` (model selection) and ``test``
(held out by origin, read by nothing that trains or chooses a model).

    plan = plan_splits(train_sources, test_sources, cfg.data)   # one cheap pass over the text
    plan.split_of(doc.stratum, content_digest(doc.text))        # "train" | "val" | "test" | None

The rules, each a pure function of the documents' content and the config:

- **val** is drawn per *stratum* (a source, or one part of an embedded one: the Python
  documentation, the standard library), so prose and code are both in it: the documents of
  a stratum in ascending order of their content digest (a uniform hash) until they hold
  ``data.val_fraction`` of that stratum's bytes. Sized by bytes, not by documents: twelve
  documents of 2% of 1,000 can be two codec tables, 5% of the bytes is ~170k tokens of
  everything. (Bytes, not tokens, because the tokenizer is trained on the training split
  and so cannot exist before the split does; BPE-4096 gives ~3.5 bytes per token here.)
- **test** comes from ``data.test_sources`` (the ``python`` preset: CPython's own test
  suite, which the training sources leave out): their documents in ascending digest order
  until ``data.test_bytes``, shared between their strata in proportion to their size; a
  test document that duplicates a training one is dropped (deduplication sees the training
  sources first). Without test sources (none given, or ``embedded:python-tests`` missing from
  this Python), ``data.test_fraction`` of each training stratum's bytes is taken from the
  *top* of the digest order instead, so it never meets val. ``plan.rule`` says which rule
  applied and goes into the manifest.
- A stratum always keeps at least one training document.

Choosing by digest means a document's split does not depend on where it sits in a file
listing or on the machine; the per-stratum thresholds do depend on the stratum's total, so
adding documents to a source can move a few documents near the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.data.clean import Cleaner, content_digest


@dataclass
class SplitPlan:
    assign: dict[tuple[str, bytes], str] = field(default_factory=dict)
    rule: dict = field(default_factory=dict)

    def split_of(self, stratum: str, digest: bytes) -> str | None:
        """The split of a kept document; None for a test-source document left out of test."""
        return self.assign.get((stratum, digest))


def _scan(sources, cleaner: Cleaner) -> dict[str, list[tuple[bytes, int]]]:
    """{stratum: [(digest, bytes), ...]} of the documents that survive cleaning."""
    strata: dict[str, list[tuple[bytes, int]]] = {}
    for source in sources:
        for doc in source.documents():
            digest = content_digest(doc.text)
            if cleaner.keep(doc.text, digest):
                strata.setdefault(doc.stratum, []).append((digest, len(doc.text.encode("utf-8"))))
    return strata


def _take(docs: list[tuple[bytes, int]], target: float, reverse: bool, keep: int) -> list[bytes]:
    """Digests in digest order (descending if ``reverse``) until their bytes reach ``target``,
    leaving at least ``keep`` documents behind."""
    taken, total = [], 0
    if target <= 0:
        return taken
    for digest, n in sorted(docs, reverse=reverse):
        if total >= target or len(docs) - len(taken) <= keep:
            break
        taken.append(digest)
        total += n
    return taken


def plan_splits(train_sources, test_sources, data_cfg) -> SplitPlan:
    """Read the sources once (cleaning as ``prepare`` will) and assign every kept document."""
    cleaner = Cleaner(data_cfg.min_chars, data_cfg.max_nontext_fraction, data_cfg.dedup)
    train_strata = _scan(train_sources, cleaner)
    test_strata = _scan(test_sources, cleaner)
    plan = SplitPlan()
    for stratum, docs in train_strata.items():
        for digest, _ in docs:
            plan.assign[(stratum, digest)] = "train"
        target = data_cfg.val_fraction * sum(n for _, n in docs)
        for digest in _take(docs, target, reverse=False, keep=1):
            plan.assign[(stratum, digest)] = "val"
    plan.rule["val"] = f"per stratum, {data_cfg.val_fraction:g} of its bytes by content digest"

    if test_strata:
        available = sum(n for docs in test_strata.values() for _, n in docs)
        budget = data_cfg.test_bytes or available
        for stratum, docs in test_strata.items():
            share = budget * sum(n for _, n in docs) / available
            for digest in _take(docs, share, reverse=False, keep=0):
                plan.assign[(stratum, digest)] = "test"
        plan.rule["test"] = (
            f"held out by origin: {', '.join(s.spec for s in test_sources)}, up to "
            f"{data_cfg.test_bytes or available:,} bytes by content digest"
        )
    elif data_cfg.test_fraction > 0:
        for stratum, docs in train_strata.items():
            pool = [(d, n) for d, n in docs if plan.assign[(stratum, d)] == "train"]
            target = data_cfg.test_fraction * sum(n for _, n in docs)
            for digest in _take(pool, target, reverse=True, keep=1):
                plan.assign[(stratum, digest)] = "test"
        plan.rule["test"] = (
            f"hashed share of the training sources: per stratum, {data_cfg.test_fraction:g} of its "
            "bytes from the top of the content-digest order"
        )
    else:
        plan.rule["test"] = "none (no data.test_sources and data.test_fraction=0)"
    return plan
