"""Where text comes from: source strings resolved to a deterministic stream of documents.

A source string is ``embedded:python-docs`` (the documentation topics inside every CPython),
``embedded:python-stdlib`` (the standard library's ``.py`` files, without test suites,
``idlelib`` and ``site-packages``), ``embedded:python`` (both), ``embedded:python-tests``
(CPython's ``Lib/test``: the held-out ``test`` split of the ``python`` preset, see
``ember.data.splits``; ``tests_available()`` says whether this Python ships it), or a path: a
file, a directory (recursively, hidden entries skipped) or a glob; ``*.jsonl`` and ``*.parquet``
give one document per line or row (docs/data.md, "Sources").

    docs = list(open_source("embedded:python-docs", cfg.data).documents())

Design choices:

- Every listing is sorted, so the document order is the same on every machine and run.
- Files are read as bytes. A file with a NUL byte in its first 8 KiB is binary: it is
  skipped and counted. Bytes that are not UTF-8 are replaced with U+FFFD and counted.
- Each source hashes the raw bytes it read (sha256) for the manifest, and offers a cheap
  ``fingerprint`` (paths, sizes, mtimes) so ``prepare`` can tell when nothing changed
  without reading everything again.
- A plain text file is one document, read whole; corpora larger than memory come as many
  files, JSONL or Parquet, which stream.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import stat
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ember.errors import DataError

PARTS = {
    "python": ["docs", "stdlib"],
    "python-docs": ["docs"],
    "python-stdlib": ["stdlib"],
    "python-tests": ["tests"],
}
EMBEDDED = tuple(f"embedded:{name}" for name in PARTS)
STDLIB_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}
)
BINARY_SNIFF_BYTES = 8192


@dataclass
class Document:
    """One unit of text; ``origin`` says where it came from (file, file:line, topic), ``stratum``
    which part of a source it belongs to (``embedded:python-docs``, ``embedded:python-stdlib``,
    or the source string itself): splits are drawn, and evaluations reported, per stratum."""

    text: str
    origin: str
    stratum: str = ""
    group: str = ""  # the top-level folder below the source's root ("" at the root): see splits.py


@dataclass
class SourceStats:
    """What reading one source found; goes into the manifest."""

    spec: str
    files: int = 0
    documents: int = 0
    bytes: int = 0
    binary_skipped: int = 0
    invalid_utf8: int = 0
    _hash: object = field(default_factory=hashlib.sha256, repr=False)

    def to_dict(self) -> dict:
        counts = ("files", "documents", "bytes", "binary_skipped", "invalid_utf8")
        return {"spec": self.spec, "sha256": self._hash.hexdigest(), **{k: getattr(self, k) for k in counts}}

    def read(self, raw: bytes) -> None:
        """Count and hash bytes read from the source."""
        self._hash.update(raw)
        self.bytes += len(raw)


def is_image_source(spec: str) -> bool:
    """True for the four image forms (ember/data/images.py reads them; a malformed DIR is its
    to report): here, beside the text sources, so that what reads text can refuse them cheaply."""
    prefix, _, _ = spec.partition(":")
    return spec == "embedded:digits" or prefix in ("mnist", "cifar10", "imagefolder")


def _decode(raw: bytes, stats: SourceStats) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.invalid_utf8 += 1
        return raw.decode("utf-8", errors="replace")


def _stat_key(path: Path) -> list:
    st = path.stat()
    return [str(path), st.st_size, st.st_mtime_ns]


class Source:
    """A resolved source string. ``documents()`` may be called more than once."""

    def __init__(self, spec: str, jsonl_field: str = "text", parquet_column: str = "text"):
        self.spec, self.jsonl_field, self.parquet_column = spec, jsonl_field, parquet_column
        self.stats = SourceStats(spec)
        self.parts: list[str] = []  # "docs", "stdlib", "tests"
        self.files: list[Path] = []
        self.root: Path | None = None  # a folder the files sit under, for Document.group
        if spec.startswith("embedded:"):
            if spec not in EMBEDDED:
                raise DataError(f"unknown embedded source {spec!r}; choose one of: {', '.join(EMBEDDED)}")
            self.parts = PARTS[spec.split(":", 1)[1]]
            if "stdlib" in self.parts:
                self.files, self.root = _stdlib_files(), Path(sysconfig.get_paths()["stdlib"])
            if "tests" in self.parts:
                self.files, self.root = _test_files(), _test_root()
        else:
            self.files = _resolve_path(spec)
            self.root = Path(spec).expanduser() if Path(spec).expanduser().is_dir() else None

    def _read(self, stats: SourceStats) -> Iterator[Document]:
        if "docs" in self.parts:
            yield from _pydoc_topics(stats)
        stratum = f"embedded:python-{self.parts[-1]}" if self.parts else self.spec
        for path in self.files:
            stats.files += 1
            suffix = path.suffix.lower()
            if suffix == ".jsonl":
                docs = _jsonl_documents(path, self.jsonl_field, stats)
            elif suffix == ".parquet":
                docs = _parquet_documents(path, self.parquet_column, stats)
            else:
                docs = _text_document(path, stats)
            parts = path.relative_to(self.root).parts if self.root else ()
            for doc in docs:
                doc.stratum, doc.group = stratum, parts[0] if len(parts) > 1 else ""
                yield doc

    def fingerprint(self) -> list:
        """Cheap identity of the inputs: names, sizes and mtimes, plus the Python version for
        embedded text (which is what decides the embedded content)."""
        key: list = [self.spec, self.jsonl_field, self.parquet_column]
        if self.parts:
            key.append(sys.version)
        key.extend(_stat_key(p) for p in self.files)
        return key

    def documents(self) -> Iterator[Document]:
        """Stream the documents in order; resets and refills ``self.stats``."""
        self.stats = stats = SourceStats(self.spec)
        for doc in self._read(stats):
            stats.documents += 1
            yield doc
        if stats.documents == 0 and stats.binary_skipped:
            raise DataError(
                f"source {self.spec!r} holds only binary files ({stats.binary_skipped} skipped); "
                "point data.sources at text, .jsonl or .parquet files"
            )


def open_source(spec: str, data_cfg=None) -> Source:
    """Resolve a source string (raises DataError when it names nothing)."""
    if data_cfg is None:
        return Source(spec)
    return Source(spec, data_cfg.jsonl_field, data_cfg.parquet_column)


def _pydoc_topics(stats: SourceStats) -> Iterator[Document]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        raw = topics[key].encode("utf-8")
        stats.read(raw)
        yield Document(topics[key], f"pydoc_data.topics:{key}", "embedded:python-docs")


def _test_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / "test"


def tests_available() -> bool:
    """Whether this Python ships its test suite (``Lib/test`` with ``.py`` files)."""
    root = _test_root()
    return root.is_dir() and any(root.glob("test_*.py"))


def _walk(root: Path, keep_file: Callable[[str], bool], skip_dirs: frozenset = frozenset()) -> list[Path]:
    """The files below ``root`` that ``keep_file`` accepts, by relative path; hidden folders and
    ``skip_dirs`` are not entered."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        files.extend(Path(dirpath, f) for f in filenames if keep_file(f))
    for path in files:
        if kind := unreadable_kind(path):
            raise DataError(f"{path} (under source {str(root)!r}) is {kind}, not a text file; remove it")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _test_files() -> list[Path]:
    if not tests_available():
        raise DataError(
            f"embedded:python-tests: this Python has no test suite under {_test_root()} (some distributions "
            "strip it); drop it from data.test_sources to hold out a hashed share of the training "
            "sources instead (data.test_fraction)"
        )
    return _walk(_test_root(), lambda name: name.endswith(".py"), frozenset({"__pycache__"}))


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _walk(root, lambda name: name.endswith(".py"), STDLIB_EXCLUDED_DIRS)
    if not files:
        raise DataError(
            f"no standard library .py files found under {root}; this Python ships without sources"
        )
    return files


def unreadable_kind(path: Path) -> str | None:
    """What ``path`` is if it exists but is no file or folder to read (a symbolic link loop or a
    broken link, a FIFO that would block, a device, a socket); None otherwise."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        loop = e.errno == errno.ELOOP
        return "a symbolic link loop" if loop else "a broken symbolic link" if path.is_symlink() else None
    kinds = {stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}  # fmt: skip # noqa: E501
    return next((kind for test, kind in kinds.items() if test(mode)), None)


def _resolve_path(spec: str) -> list[Path]:
    path = Path(spec).expanduser()
    if path.is_dir():
        return _walk(path, lambda name: not name.startswith("."))
    if path.is_file():
        return [path]
    if any(ch in spec for ch in "*?["):
        matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise DataError(
                f"source glob {spec!r} matches no files; check the pattern (use ** for subfolders)"
            )
        return files
    if kind := unreadable_kind(path):
        raise DataError(f"source {spec!r} is {kind}, not a file or folder; point data.sources at text files")
    raise DataError(
        f"source {spec!r} not found: no such file or directory "
        f"(use a path, a glob, or one of {', '.join(EMBEDDED)})"
    )


def _text_document(path: Path, stats: SourceStats) -> Iterator[Document]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(
            f"cannot read source file {path} ({e.strerror or e}); fix its permissions or remove it"
        ) from None
    stats.read(raw)
    if b"\x00" in raw[:BINARY_SNIFF_BYTES]:
        stats.binary_skipped += 1
        return
    yield Document(_decode(raw, stats), str(path))


def _jsonl_documents(path: Path, field_name: str, stats: SourceStats) -> Iterator[Document]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            stats.read(raw)
            if not raw.strip():
                continue
            try:
                record = json.loads(_decode(raw, stats))
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove that line"
                ) from None
            if not isinstance(record, dict) or field_name not in record:
                keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
                raise DataError(
                    f"{path}:{lineno}: record has no field {field_name!r} (found: {keys}); "
                    f"set data.jsonl_field to the field that holds the text"
                )
            text = record[field_name]
            if not isinstance(text, str):
                raise DataError(
                    f"{path}:{lineno}: field {field_name!r} is {type(text).__name__}, expected a string"
                )
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:  # a JSON "\ud800" escape: a lone surrogate, not text
                    stats.invalid_utf8 += 1
                    text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
            yield Document(text, f"{path}:{lineno}")


def _parquet_documents(path: Path, column: str, stats: SourceStats) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading Parquet needs pyarrow; install it with `pip install 'ember[data]'`"
        ) from None
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            stats.read(block)
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    names = pf.schema_arrow.names
    if column not in names:
        raise DataError(
            f"{path}: no column {column!r} (columns: {', '.join(names)}); set data.parquet_column"
        )
    row = 0
    for batch in pf.iter_batches(columns=[column], batch_size=1024):
        for text in batch.column(0).to_pylist():
            row += 1
            yield Document(text if isinstance(text, str) else "", f"{path}#{row}")
