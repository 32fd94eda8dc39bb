"""``ember data prepare``: sources → cleaning → tokenizer → train/val/test shards + manifest.

    result = prepare(load_config("python"))   # or: ember data prepare python
    result.manifest["splits"]["train"]["tokens"]

Three streaming passes over the sources, so memory stays bounded whatever the corpus size
(only a 16-byte digest per document is held):

0. clean and hash every document of ``data.sources`` and ``data.test_sources`` and assign
   it to a split (``ember.data.splits``: val per stratum by bytes, test held out by origin);
1. train the tokenizer on the first ``data.tokenizer_train_bytes`` of cleaned training text;
2. read again, clean, encode in parallel (HF ``encode_batch``: Rust threads on all cores,
   while a reader thread fetches and cleans the next batch), append ``<|eos|>`` after each
   document and stream the tokens into ``train``/``val``/``test`` shards. The manifest
   records, per split, the contiguous token range of each stratum, so ``ember eval``
   reports documentation and code separately.

Atomicity: everything is written into a hidden temporary directory beside ``data.dir``,
the manifest last, and the directory is renamed into place only when complete. An
interrupted run leaves no directory that looks prepared (its temp folder is removed on
the next run). Running again with the same inputs (config, source names, sizes and
mtimes, ember's format) reuses the result; ``force=True`` rebuilds it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

import ember
from ember.atomic import check_target, publish_dir, staging_dir
from ember.data.clean import Cleaner, content_digest
from ember.data.manifest import FORMAT, FORMAT_VERSION, MANIFEST, TOKENIZER, read_manifest, write_manifest
from ember.data.prefetch import Prefetcher
from ember.data.shards import ShardSplitWriter, token_dtype
from ember.data.sources import Source, is_image_source, open_source, tests_available
from ember.data.splits import SplitPlan, plan_splits
from ember.data.tokenizer import Tokenizer
from ember.errors import DataError

BATCH_CHARS = 1 << 20  # text per encode_batch call: keeps all cores busy, bounds the in-flight memory
SPLITS = ("train", "val", "test")


@dataclass
class PrepareResult:
    directory: Path
    manifest: dict
    reused: bool


def _fingerprint(data_cfg, sources: list[Source]) -> str:
    key = {
        "format_version": FORMAT_VERSION,
        "data": {k: v for k, v in asdict(data_cfg).items() if k not in ("dir", "sampling")},
        "sources": [s.fingerprint() for s in sources],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def _test_specs(data_cfg, log) -> list[str]:
    """``data.test_sources``, less ``embedded:python-tests`` where this Python does not ship it."""
    specs = list(data_cfg.test_sources)
    if "embedded:python-tests" in specs and not tests_available():
        specs.remove("embedded:python-tests")
        log(
            "note: this Python ships no test suite (Lib/test); the test split is a hashed share "
            f"(data.test_fraction={data_cfg.test_fraction}) of the training sources instead"
        )
    return specs


def _clean_documents(
    sources: list[Source], plan: SplitPlan, cleaner: Cleaner
) -> Iterator[tuple[str, str, str]]:
    """(split, stratum, text) of each document that survives cleaning and has a split, in order."""
    for source in sources:
        for doc in source.documents():
            digest = content_digest(doc.text)
            if cleaner.keep(doc.text, digest):
                split = plan.split_of(doc.stratum, digest)
                if split is not None:
                    yield split, doc.stratum, doc.text


def _tokenizer_texts(sources, plan, data_cfg, sizes: list[int]) -> Iterator[str]:
    """Training text for the tokenizer: cleaned training-split documents, up to the byte budget.
    The UTF-8 size of each text yielded is appended to ``sizes``."""
    budget = data_cfg.tokenizer_train_bytes
    cleaner = Cleaner(data_cfg.min_chars, data_cfg.max_nontext_fraction, data_cfg.dedup)
    for split, _, text in _clean_documents(sources, plan, cleaner):
        if split != "train":
            continue
        if len(text) > budget:
            text = text[:budget]
        sizes.append(len(text.encode("utf-8")))
        budget -= sizes[-1]
        yield text
        if budget <= 0:
            return


def _batches(sources, plan, cleaner) -> Iterator[list[tuple[str, str, str]]]:
    batch, size = [], 0
    for split, stratum, text in _clean_documents(sources, plan, cleaner):
        batch.append((split, stratum, text))
        size += len(text)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _check_target(target: Path, fingerprint: str, force: bool) -> dict | None:
    """Return the existing manifest when it can be reused; refuse to overwrite what is not ours."""
    check_target(target, kind="data", force=True)  # ember/atomic.py: absent, empty, or ember's data
    if not target.exists() or not (target / MANIFEST).exists():
        return None
    try:
        manifest = read_manifest(target)
    except DataError:
        if force or _older_format(target):
            return None
        raise
    if force:
        return None
    if manifest.get("fingerprint") == fingerprint:
        return manifest
    raise DataError(
        f"{target} holds data prepared from different inputs (config or source files changed); "
        "pass --force to rebuild it there, or set data.dir to a new directory"
    )


def _older_format(target: Path) -> bool:
    """An ember data directory written by an older format: rebuilt without --force, since
    nothing can read it any more."""
    try:
        old = json.loads((target / MANIFEST).read_text(encoding="utf-8"))
        return old.get("format") == FORMAT and int(old.get("format_version", 0)) < FORMAT_VERSION
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def prepare(
    cfg, force: bool = False, command: str | None = None, log: Callable[[str], None] = print
) -> PrepareResult:
    """Prepare ``cfg.data`` into ``cfg.data.dir`` (see module docstring)."""
    data_cfg = cfg.data
    if any(map(is_image_source, data_cfg.sources)):  # (train.task=classify reads them itself)
        raise DataError(f"{', '.join(data_cfg.sources)}: images need no preparation; `ember train` reads them as they are, `ember data stats` describes them")  # fmt: skip # noqa: E501
    target = Path(data_cfg.dir)
    sources = [open_source(spec, data_cfg) for spec in data_cfg.sources]  # fails fast on missing paths
    test_sources = [open_source(spec, data_cfg) for spec in _test_specs(data_cfg, log)]
    fingerprint = _fingerprint(data_cfg, sources + test_sources)
    existing = _check_target(target, fingerprint, force)
    if existing is not None:
        log(f"reusing {target}: already prepared from the same inputs (pass --force to rebuild)")
        return PrepareResult(target, existing, reused=True)

    tmp = staging_dir(target)
    try:
        manifest = _build(data_cfg, sources, test_sources, tmp, fingerprint, command, log)
        publish_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PrepareResult(target, manifest, reused=False)


def _build(
    data_cfg, sources: list[Source], test_sources: list[Source], out: Path, fingerprint: str, command, log
) -> dict:
    t0 = time.perf_counter()
    log("assigning documents to train/val/test by content hash")
    plan = plan_splits(sources, test_sources, data_cfg)

    log(
        f"training a {data_cfg.tokenizer} tokenizer (vocab {data_cfg.vocab_size}) "
        f"on up to {data_cfg.tokenizer_train_bytes / 1e6:.0f} MB of text"
    )
    sizes: list[int] = []
    texts = _tokenizer_texts(sources, plan, data_cfg, sizes)
    tokenizer = Tokenizer.train(data_cfg.tokenizer, texts, data_cfg.vocab_size)
    train_bytes = sum(sizes)
    if train_bytes == 0:
        raise DataError(
            f"no training text left after cleaning {', '.join(data_cfg.sources)} "
            "(check data.min_chars, data.max_nontext_fraction and data.val_fraction)"
        )
    tokenizer_sha = tokenizer.save(out / TOKENIZER)
    t_tok = time.perf_counter() - t0

    log(f"encoding into shards of up to {data_cfg.shard_tokens:,} tokens")
    dtype = token_dtype(tokenizer.vocab_size)
    cleaner = Cleaner(data_cfg.min_chars, data_cfg.max_nontext_fraction, data_cfg.dedup)
    writers = {s: ShardSplitWriter(out, s, dtype, data_cfg.shard_tokens) for s in SPLITS}
    counts = {s: {"documents": 0, "bytes": 0, "tokens": 0} for s in SPLITS}
    strata: dict[str, list[dict]] = {s: [] for s in SPLITS}  # contiguous token ranges per stratum
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    # reading and cleaning (a thread) overlap encoding
    for batch in Prefetcher(_batches(sources + test_sources, plan, cleaner), name="ember-prepare-reader"):
        encoded = tokenizer.encode_batch([text for _, _, text in batch])
        for split in SPLITS:
            parts = []
            for (s, stratum, text), ids in zip(batch, encoded, strict=True):
                if s != split:
                    continue
                parts += [np.asarray(ids, dtype=dtype), eos]
                c, runs = counts[split], strata[split]
                if not runs or runs[-1]["name"] != stratum:
                    runs.append(
                        {"name": stratum, "offset": c["tokens"], "documents": 0, "bytes": 0, "tokens": 0}
                    )
                for rec in (c, runs[-1]):
                    rec["documents"] += 1
                    rec["bytes"] += len(text.encode("utf-8"))
                    rec["tokens"] += len(ids) + 1
            if parts:
                writers[split].write(np.concatenate(parts))
    shards = {s: writers[s].close() for s in SPLITS}

    kept = cleaner.counts["kept"]
    if kept == 0:
        raise DataError(
            f"the corpus is empty after cleaning ({json.dumps(cleaner.counts)}); "
            "check data.sources, data.min_chars and data.max_nontext_fraction"
        )
    for split, wanted, fix in (
        ("train", True, "lower data.val_fraction/data.test_fraction"),
        ("val", data_cfg.val_fraction > 0, "raise data.val_fraction"),
        ("test", not plan.rule["test"].startswith("none"), "raise data.test_bytes or data.test_fraction"),
    ):
        if wanted and counts[split]["documents"] == 0:
            raise DataError(
                f"no document fell into the {split} split ({kept} documents); add documents or {fix}"
            )

    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "ember_version": ember.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command or " ".join(sys.argv),
        "config": {"data": asdict(data_cfg)},
        "sources": [s.stats.to_dict() for s in sources],
        "test_sources": [s.stats.to_dict() for s in test_sources],
        "split_rules": plan.rule,
        "cleaning": {"documents_in": sum(cleaner.counts.values()), **cleaner.counts},
        "tokenizer": {
            "file": TOKENIZER,
            "sha256": tokenizer_sha,
            "train_bytes": train_bytes,
            **tokenizer.describe(),
        },
        "dtype": np.dtype(dtype).name,
        "splits": {
            s: {**counts[s], "strata": strata[s], "shards": [asdict(info) for info in shards[s]]}
            for s in SPLITS
        },
        "seconds": {"tokenizer": round(t_tok, 3), "total": round(time.perf_counter() - t0, 3)},
    }
    write_manifest(out, manifest)
    return manifest
