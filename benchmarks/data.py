"""Data pipeline speed and memory: ember against the naive way of doing the same work.

    .venv/bin/python benchmarks/data.py

On the embedded corpus (``embedded:python``, the ``python`` preset, data written to a
temporary directory) it measures, and prints as one table:

1. tokenizer training seconds: ``Tokenizer.train_bpe`` on the corpus' training text,
   vocab 4096 (no naive peer: both sides call the same HF trainer);
2. encode MB/s: ``Tokenizer.encode_batch`` over every document (Rust threads) against
   ``Tokenizer.encode`` one document at a time, same tokenizer, ids checked identical;
3. prepare seconds and peak RSS: ``ember.data.prepare.prepare`` against a naive prepare
   (every document in a list, the same tokenizer, ``encode`` per document, one Python list
   of ids, one numpy array, ``tofile``), the outputs checked identical; then both again on
   synthetic JSONL corpora 1x and 4x the embedded one (every document repeated with a
   ``# copy k`` first line so dedup keeps it; ``tokenizer_train_bytes`` fixed so training
   costs the same) to show whose memory grows with the corpus;
4. loader batches/s: ``TrainLoader(...).batch(step)`` (seq_len 256, batch 32) against
   ``np.fromfile`` of each row at the same random starts, converted to int64 x/y.

Design choices:

- Each prepare runs in a fresh child process (this file with ``--child``), so its peak RSS
  (``VmHWM``) is its own; both children import the same modules before measuring, and
  time only the work, not the interpreter start. torch is imported only by the parent
  (loader benchmark): neither prepare needs it, and its ~200 MB would hide the difference.
- Ratios read "times better for ember": naive/ember for seconds and memory, ember/naive
  for throughput; below 1 means the naive peer won.
- Every timing is warmed up once (page cache, BPE word cache), then the best (throughput)
  or median (prepare) of a few runs is kept.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tokenizers

from ember.config import load_config
from ember.data.clean import Cleaner, content_digest
from ember.data.manifest import read_manifest
from ember.data.prepare import prepare
from ember.data.shards import HEADER_SIZE, read_shard
from ember.data.sources import open_source
from ember.data.splits import plan_splits
from ember.data.tokenizer import Tokenizer

VOCAB_SIZE = 4096
SEQ_LEN, GLOBAL_BATCH = 256, 32
LOADER_STEPS = 500
PREPARE_REPEATS = 3
SCALE_COPIES = 4
SCALE_TRAIN_BYTES = 8_000_000  # below the 1x corpus: 1x and 4x train on the same amount


# ----------------------------------------------------------------------------- machine


def machine() -> str:
    import torch

    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return (
        f"{cpu}, {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, tokenizers {tokenizers.__version__}, numpy {np.__version__}"
    )


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("no VmHWM in /proc/self/status")


# ----------------------------------------------------------------------------- corpus


def data_config(data_dir: Path, sources: list[str] | None = None, train_bytes: int | None = None):
    cfg = load_config("python")
    data = dataclasses.replace(cfg.data, dir=str(data_dir), vocab_size=VOCAB_SIZE)
    if sources is not None:
        data = dataclasses.replace(data, sources=sources)
    if train_bytes is not None:
        data = dataclasses.replace(data, tokenizer_train_bytes=train_bytes)
    return dataclasses.replace(cfg, data=data)


def split_documents(data_cfg) -> list[tuple[str, str]]:
    """(split, text) for every document of the training and test sources that survives cleaning
    and has a split: prepare's rules (``ember.data.splits``), in a list."""
    train = [open_source(spec, data_cfg) for spec in data_cfg.sources]
    test = [open_source(spec, data_cfg) for spec in data_cfg.test_sources]
    plan = plan_splits(train, test, data_cfg)
    cleaner = Cleaner(data_cfg.min_chars, data_cfg.max_nontext_fraction, data_cfg.dedup)
    pairs = []
    for source in train + test:
        for doc in source.documents():
            digest = content_digest(doc.text)
            if cleaner.keep(doc.text, digest) and (split := plan.split_of(doc.stratum, digest)):
                pairs.append((split, doc.text))
    return pairs


def tokenizer_texts(pairs: list[tuple[str, str]], budget: int) -> list[str]:
    """The training split, cut at ``budget`` bytes the way prepare cuts it."""
    out = []
    for split, text in pairs:
        if split != "train":
            continue
        if len(text) > budget:
            text = text[:budget]
        budget -= len(text.encode("utf-8"))
        out.append(text)
        if budget <= 0:
            break
    return out


def write_synthetic(directory: Path, docs: list[str], copies: int) -> None:
    """``copies`` JSONL files, each every document with a ``# copy k`` first line."""
    directory.mkdir(parents=True)
    for k in range(copies):
        with open(directory / f"part-{k}.jsonl", "w", encoding="utf-8") as f:
            for text in docs:
                f.write(json.dumps({"text": f"# copy {k}\n{text}"}, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------- prepare (child)


def naive_prepare(cfg) -> None:
    """Everything in memory: documents, then all ids in one Python list per split."""
    data_cfg = cfg.data
    out = Path(data_cfg.dir)
    out.mkdir(parents=True, exist_ok=True)
    pairs = split_documents(data_cfg)
    tok = Tokenizer.train_bpe(tokenizer_texts(pairs, data_cfg.tokenizer_train_bytes), data_cfg.vocab_size)
    tok.save(out / "tokenizer.json")
    ids: dict[str, list[int]] = {"train": [], "val": [], "test": []}
    for split, text in pairs:
        ids[split].extend(tok.encode(text))
        ids[split].append(tok.eos_id)
    for split, tokens in ids.items():
        np.array(tokens, dtype=np.uint16).tofile(out / f"{split}.bin")


def child(kind: str, spec: dict) -> None:
    cfg = data_config(Path(spec["dir"]), spec["sources"], spec["train_bytes"])
    t0 = time.perf_counter()
    if kind == "ember":
        prepare(cfg, force=True, log=lambda _: None)
    else:
        naive_prepare(cfg)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "peak_rss_mb": peak_rss_mb()}))


def run_child(kind: str, data_dir: Path, sources: list[str], train_bytes: int) -> dict:
    spec = {"dir": str(data_dir), "sources": sources, "train_bytes": train_bytes}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, json.dumps(spec)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- benchmarks


def bench_tokenizer(train_texts: list[str]) -> tuple[float, Tokenizer]:
    Tokenizer.train_bpe(train_texts[:50], VOCAB_SIZE)  # warm-up: imports, thread pool
    times, tok = [], None
    for _ in range(3):
        t0 = time.perf_counter()
        tok = Tokenizer.train_bpe(train_texts, VOCAB_SIZE)
        times.append(time.perf_counter() - t0)
    return min(times), tok


def bench_encode(tok: Tokenizer, docs: list[str]) -> tuple[float, float]:
    mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    expected = tok.encode_batch(docs)  # warm-up (fills the BPE word cache) and reference ids
    best = {"ember": float("inf"), "naive": float("inf")}
    for _ in range(3):
        t0 = time.perf_counter()
        batch = tok.encode_batch(docs)
        best["ember"] = min(best["ember"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        single = [tok.encode(d) for d in docs]
        best["naive"] = min(best["naive"], time.perf_counter() - t0)
        assert batch == expected and single == expected, "encode_batch and encode disagree"
    return mb / best["ember"], mb / best["naive"]


def bench_prepare(work: Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {"ember": [], "naive": []}
    train_bytes = load_config("python").data.tokenizer_train_bytes
    run_child("ember", work / "warmup", ["embedded:python"], train_bytes)  # page cache
    for _ in range(PREPARE_REPEATS):
        for kind in runs:
            runs[kind].append(run_child(kind, work / kind, ["embedded:python"], train_bytes))
    # Same tokenizer, same tokens.
    manifest = read_manifest(work / "ember")
    naive_tok = Tokenizer.load(work / "naive" / "tokenizer.json")
    assert naive_tok.sha256 == manifest["tokenizer"]["sha256"], "naive prepare trained another tokenizer"
    for split in ("train", "val", "test"):
        ember_ids = np.concatenate(
            [read_shard(work / "ember" / s["name"]) for s in manifest["splits"][split]["shards"]]
        )
        naive_ids = np.fromfile(work / "naive" / f"{split}.bin", dtype=np.uint16)
        assert np.array_equal(ember_ids, naive_ids), f"naive and ember {split} tokens differ"
    return runs


def bench_scale(work: Path, docs: list[str]) -> dict[tuple[str, int], dict]:
    """Median of 3 at 1x (cheap); one run at 4x (the naive one takes ~30 s)."""
    out = {}
    for copies, repeats in ((1, 3), (SCALE_COPIES, 1)):
        corpus = work / f"corpus-{copies}x"
        write_synthetic(corpus, docs, copies)
        runs: dict[str, list[dict]] = {"ember": [], "naive": []}
        for _ in range(repeats):
            for kind in runs:
                runs[kind].append(
                    run_child(kind, work / f"{kind}-{copies}x", [str(corpus)], SCALE_TRAIN_BYTES)
                )
        for kind, rs in runs.items():
            out[kind, copies] = {m: statistics.median(r[m] for r in rs) for m in ("seconds", "peak_rss_mb")}
    return out


def bench_loader(data_dir: Path) -> tuple[float, float]:
    import torch

    from ember.data.loader import TokenDataset, TrainLoader

    loader = TrainLoader(TokenDataset(data_dir, "train"), seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, seed=0)
    path = data_dir / "train-000000.bin"
    n_starts = len(read_shard(path)) - SEQ_LEN  # starts with seq_len + 1 tokens of room, as ember draws

    def naive_batch(step: int):
        starts = np.random.default_rng([0, step]).integers(0, n_starts, size=GLOBAL_BATCH)
        rows = [
            np.fromfile(path, dtype=np.uint16, count=SEQ_LEN + 1, offset=HEADER_SIZE + 2 * int(s))
            for s in starts
        ]
        buf = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T+1)
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()

    x0, y0 = loader.batch(0)
    xn, yn = naive_batch(0)
    assert torch.equal(x0, xn) and torch.equal(y0, yn), "naive loader read other windows than ember"
    rates = {}
    for name, fn in (("ember", loader.batch), ("naive", naive_batch)):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for step in range(LOADER_STEPS):
                fn(step)
            best = min(best, time.perf_counter() - t0)
        rates[name] = LOADER_STEPS / best
    return rates["ember"], rates["naive"]


# ----------------------------------------------------------------------------- table


def row(name: str, ember: float, naive: float | None, fmt: str, higher_is_better: bool) -> tuple:
    if naive is None:
        return name, format(ember, fmt), "-", "-"
    ratio = ember / naive if higher_is_better else naive / ember
    return name, format(ember, fmt), format(naive, fmt), f"{ratio:.2f}x"


def print_table(rows: list[tuple]) -> None:
    header = ("benchmark", "ember", "naive", "ratio")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]

    def line(r: tuple) -> str:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        return "| " + " | ".join(cells) + " |"

    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))


def main() -> None:
    print(f"machine: {machine()}")
    load_before = os.getloadavg()[0]
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ember-bench-data-") as tmp:
        work = Path(tmp)
        data_cfg = data_config(work / "unused").data
        docs = [d.text for d in open_source("embedded:python", data_cfg).documents()]
        pairs = split_documents(data_cfg)
        train_texts = tokenizer_texts(pairs, data_cfg.tokenizer_train_bytes)
        corpus_mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
        train_mb = sum(len(t.encode("utf-8")) for t in train_texts) / 1e6
        print(
            f"corpus: embedded:python, {len(docs)} documents, {corpus_mb:.1f} MB; "
            f"tokenizer training text {train_mb:.1f} MB; vocab {VOCAB_SIZE}"
        )

        train_s, tok = bench_tokenizer(train_texts)
        enc_ember, enc_naive = bench_encode(tok, docs)
        prep = bench_prepare(work)
        scale = bench_scale(work, docs)
        load_ember, load_naive = bench_loader(work / "ember")

    def pair(results: dict, metric: str) -> tuple[float, float]:
        return results["ember"][metric], results["naive"][metric]

    med = {
        k: {m: statistics.median(r[m] for r in rs) for m in ("seconds", "peak_rss_mb")}
        for k, rs in prep.items()
    }
    one = {kind: scale[kind, 1] for kind in ("ember", "naive")}
    big = {kind: scale[kind, SCALE_COPIES] for kind in ("ember", "naive")}
    n, reps = SCALE_COPIES, PREPARE_REPEATS
    rows = [
        row("tokenizer training, s (best of 3)", train_s, None, ".2f", False),
        row("encode, MB/s (best of 3)", enc_ember, enc_naive, ".2f", True),
        row(f"prepare, s (median of {reps})", *pair(med, "seconds"), ".2f", False),
        row(f"prepare, peak RSS MB (median of {reps})", *pair(med, "peak_rss_mb"), ".0f", False),
        row("prepare 1x JSONL, s (median of 3)", *pair(one, "seconds"), ".2f", False),
        row(f"prepare {n}x JSONL, s (1 run)", *pair(big, "seconds"), ".2f", False),
        row("prepare 1x JSONL, peak RSS MB (median of 3)", *pair(one, "peak_rss_mb"), ".0f", False),
        row(f"prepare {n}x JSONL, peak RSS MB (1 run)", *pair(big, "peak_rss_mb"), ".0f", False),
        row(f"loader, batches/s ({GLOBAL_BATCH}x{SEQ_LEN}, best of 3)", load_ember, load_naive, ".0f", True),
    ]
    print_table(rows)
    print(
        f"ratio: times better for ember (>1 ember wins). JSONL rows: synthetic corpora, "
        f"tokenizer_train_bytes={SCALE_TRAIN_BYTES:,}. "
        f"1-min load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after (other processes "
        f"on these cores skew the parallel figures). total {time.perf_counter() - t_start:.0f} s"
    )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], json.loads(sys.argv[3]))
    else:
        main()
