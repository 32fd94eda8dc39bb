"""``manifest.json``: what a prepared data directory holds and how it was made.

    manifest = read_manifest("data/python")          # validated; DataError if not usable
    tok = load_tokenizer("data/python")               # checked against the manifest's sha256

A data directory is complete exactly when its ``manifest.json`` exists: ``prepare`` writes
the manifest last, inside a temporary directory that is renamed into place, so a reader
never sees shards without the record of what they are.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ember.atomic import write_text_atomic
from ember.data.tokenizer import Tokenizer, file_sha256
from ember.errors import DataError

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
FORMAT = "ember-shards"
FORMAT_VERSION = 2  # 2: a test split, split rules and per-stratum token ranges
_REBUILD = "re-run `ember data prepare CONFIG --force`"


def write_manifest(directory: str | os.PathLike, manifest: dict) -> None:
    write_text_atomic(Path(directory) / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def read_manifest(directory: str | os.PathLike) -> dict:
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        hint = "it is not a prepared data directory" if directory.is_dir() else "it does not exist"
        raise DataError(f"no {MANIFEST} in {directory} ({hint}); run `ember data prepare CONFIG` first")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); {_REBUILD}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path} is not an ember data manifest; {_REBUILD}")
    missing = [k for k in ("splits", "tokenizer", "sources", "cleaning") if k not in manifest]
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}; {_REBUILD}")
    if manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version")
        raise DataError(f"{path} has format version {version}, this ember reads {FORMAT_VERSION}; {_REBUILD}")
    return manifest


def load_tokenizer(directory: str | os.PathLike, manifest: dict | None = None) -> Tokenizer:
    """Load the tokenizer beside the shards, refusing one that is not the one they were made with."""
    directory = Path(directory)
    manifest = manifest or read_manifest(directory)
    path = directory / TOKENIZER
    if not path.is_file():
        raise DataError(f"{path} is missing; {_REBUILD}")
    expected = manifest["tokenizer"]["sha256"]
    actual = file_sha256(path)
    if actual != expected:
        raise DataError(
            f"{path} does not match {directory / MANIFEST} (sha256 {actual[:12]}… vs {expected[:12]}…): "
            f"the shards were encoded with a different tokenizer; restore it or {_REBUILD}"
        )
    return Tokenizer.load(path)
