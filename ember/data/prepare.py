"""``ember data prepare``: sources → cleaning → tokenizer → train/val shards + manifest.

    result = prepare(load_config("python"))   # or: ember data prepare python
    result.manifest["splits"]["train"]["tokens"]

Two streaming passes over the sources, so memory stays bounded whatever the corpus size:

1. train the tokenizer on the first ``data.tokenizer_train_bytes`` of cleaned training text;
2. read again, clean, encode in parallel (HF ``encode_batch``: Rust threads on all cores,
   while a reader thread fetches and cleans the next batch), append ``<|eos|>`` after each
   document and stream the tokens into ``train``/``val`` shards.

Atomicity: everything is written into a hidden temporary directory beside ``data.dir``,
the manifest last, and the directory is renamed into place only when complete. An
interrupted run leaves no directory that looks prepared (its temp folder is removed on
the next run). Running again with the same inputs (config, source names, sizes and
mtimes, ember's format) reuses the result; ``force=True`` rebuilds it.
"""

from __future__ import annotations

import hashlib
import json
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

import ember
from ember.atomic import publish_dir, staging_dir
from ember.data.clean import Cleaner, content_digest, is_validation
from ember.data.manifest import FORMAT, FORMAT_VERSION, MANIFEST, TOKENIZER, read_manifest, write_manifest
from ember.data.shards import ShardSplitWriter, token_dtype
from ember.data.sources import Source, open_source
from ember.data.tokenizer import Tokenizer
from ember.errors import DataError

BATCH_CHARS = 1 << 20  # text per encode_batch call: keeps all cores busy, bounds the in-flight memory
SPLITS = ("train", "val")


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


def _clean_documents(sources: list[Source], data_cfg, cleaner: Cleaner) -> Iterator[tuple[str, str]]:
    """Yield (split, text) for every document that survives cleaning, in source order."""
    for source in sources:
        for doc in source.documents():
            digest = content_digest(doc.text)
            if cleaner.keep(doc.text, digest):
                yield ("val" if is_validation(digest, data_cfg.val_fraction) else "train"), doc.text


def _tokenizer_texts(sources, data_cfg) -> Iterator[str]:
    """Training text for the tokenizer: cleaned training-split documents, up to the byte budget."""
    budget = data_cfg.tokenizer_train_bytes
    cleaner = Cleaner(data_cfg.min_chars, data_cfg.max_nontext_fraction, data_cfg.dedup)
    for split, text in _clean_documents(sources, data_cfg, cleaner):
        if split != "train":
            continue
        if len(text) > budget:
            text = text[:budget]
        budget -= len(text.encode("utf-8"))
        yield text
        if budget <= 0:
            return


def _batches(sources, data_cfg, cleaner) -> Iterator[list[tuple[str, str]]]:
    batch, size = [], 0
    for split, text in _clean_documents(sources, data_cfg, cleaner):
        batch.append((split, text))
        size += len(text)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _prefetched(it: Iterator, depth: int = 2) -> Iterator:
    """Run an iterator in a background thread (reading and cleaning overlap encoding)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def put(item) -> bool:
        """Hand over an item unless the consumer has gone away; True when handed over."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for item in it:
                if not put(item):
                    return
            put(done)
        except BaseException as e:  # handed to the consumer, which re-raises it
            put(e)

    thread = threading.Thread(target=work, name="ember-prepare-reader", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


def _check_target(target: Path, fingerprint: str, force: bool) -> dict | None:
    """Return the existing manifest when it can be reused; refuse to overwrite what is not ours."""
    if not target.exists():
        return None
    if not target.is_dir():
        raise DataError(f"data.dir {target} exists and is not a directory; choose another data.dir")
    if not (target / MANIFEST).exists():
        if any(target.iterdir()):
            raise DataError(
                f"data.dir {target} exists, is not empty and holds no {MANIFEST}: it is not an ember "
                "data directory, so it will not be overwritten; choose another data.dir or empty it"
            )
        return None
    try:
        manifest = read_manifest(target)
    except DataError:
        if force:
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


def prepare(
    cfg, force: bool = False, command: str | None = None, log: Callable[[str], None] = print
) -> PrepareResult:
    """Prepare ``cfg.data`` into ``cfg.data.dir`` (see module docstring)."""
    data_cfg = cfg.data
    target = Path(data_cfg.dir)
    sources = [open_source(spec, data_cfg) for spec in data_cfg.sources]  # fails fast on missing paths
    fingerprint = _fingerprint(data_cfg, sources)
    existing = _check_target(target, fingerprint, force)
    if existing is not None:
        log(f"reusing {target}: already prepared from the same inputs (pass --force to rebuild)")
        return PrepareResult(target, existing, reused=True)

    tmp = staging_dir(target)
    try:
        manifest = _build(cfg, sources, tmp, fingerprint, command, log)
        publish_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PrepareResult(target, manifest, reused=False)


def _build(cfg, sources: list[Source], out: Path, fingerprint: str, command: str | None, log) -> dict:
    data_cfg = cfg.data
    t0 = time.perf_counter()

    log(
        f"training a {data_cfg.tokenizer} tokenizer (vocab {data_cfg.vocab_size}) "
        f"on up to {data_cfg.tokenizer_train_bytes / 1e6:.0f} MB of text"
    )
    train_bytes = 0

    def counted(texts):
        nonlocal train_bytes
        for text in texts:
            train_bytes += len(text.encode("utf-8"))
            yield text

    tokenizer = Tokenizer.train(
        data_cfg.tokenizer, counted(_tokenizer_texts(sources, data_cfg)), data_cfg.vocab_size
    )
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
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    for batch in _prefetched(_batches(sources, data_cfg, cleaner)):
        encoded = tokenizer.encode_batch([text for _, text in batch])
        for split in SPLITS:
            parts = []
            for (s, text), ids in zip(batch, encoded, strict=True):
                if s != split:
                    continue
                parts.append(np.asarray(ids, dtype=dtype))
                parts.append(eos)
                c = counts[split]
                c["documents"] += 1
                c["bytes"] += len(text.encode("utf-8"))
                c["tokens"] += len(ids) + 1
            if parts:
                writers[split].write(np.concatenate(parts))
    shards = {s: writers[s].close() for s in SPLITS}

    kept = cleaner.counts["kept"]
    if kept == 0:
        raise DataError(
            f"the corpus is empty after cleaning ({json.dumps(cleaner.counts)}); "
            "check data.sources, data.min_chars and data.max_nontext_fraction"
        )
    for split in SPLITS:
        if counts[split]["documents"] == 0 and (split == "train" or data_cfg.val_fraction > 0):
            raise DataError(
                f"no document fell into the {split} split ({kept} documents, data.val_fraction="
                f"{data_cfg.val_fraction}); add documents or "
                + ("raise" if split == "val" else "lower")
                + " data.val_fraction"
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
        "cleaning": {"documents_in": sum(cleaner.counts.values()), **cleaner.counts},
        "tokenizer": {
            "file": TOKENIZER,
            "sha256": tokenizer_sha,
            "train_bytes": train_bytes,
            **tokenizer.describe(),
        },
        "dtype": np.dtype(dtype).name,
        "splits": {s: {**counts[s], "shards": [asdict(info) for info in shards[s]]} for s in SPLITS},
        "seconds": {"tokenizer": round(t_tok, 3), "total": round(time.perf_counter() - t0, 3)},
    }
    write_manifest(out, manifest)
    return manifest
