"""``ember data stats``: check a prepared data directory and show its manifest as tables.

manifest = verify("data/python", check_sha256=True)
print_manifest(manifest, Path("data/python"))
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from ember.data.manifest import load_tokenizer, read_manifest
from ember.data.shards import read_shard
from ember.errors import DataError


def verify(directory: str | Path, check_sha256: bool = False) -> dict:
    """Validate the manifest, the tokenizer hash and every shard header (and payload hash)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    load_tokenizer(directory, manifest)
    for split, info in manifest["splits"].items():
        total = 0
        for shard in info["shards"]:
            path = directory / shard["name"]
            if not path.is_file():
                raise DataError(
                    f"shard {path} listed in the manifest is missing; re-run `ember data prepare --force`"
                )
            tokens = read_shard(path, verify_sha256=shard["sha256"] if check_sha256 else None)
            if len(tokens) != shard["n_tokens"]:
                raise DataError(
                    f"shard {path} holds {len(tokens)} tokens, the manifest says {shard['n_tokens']}; "
                    "re-run `ember data prepare --force`"
                )
            total += len(tokens)
        if total != info["tokens"]:
            raise DataError(f"{split} shards hold {total} tokens, the manifest says {info['tokens']}")
    return manifest


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB"


def _table(title: str, *columns: str) -> Table:
    return Table(*columns, title=title, title_justify="left")


def print_manifest(manifest: dict, directory: Path, console: Console | None = None) -> None:
    console = console or Console(width=max(Console().width, 120))
    console.print(f"[bold]{directory}[/bold]  (ember {manifest['ember_version']}, {manifest['created']})")

    sources = _table(
        "sources", "source", "files", "documents", "size", "binary skipped", "invalid UTF-8", "sha256"
    )
    for s in manifest["sources"]:
        files, documents, skipped, invalid = (
            f"{s[k]:,}" for k in ("files", "documents", "binary_skipped", "invalid_utf8")
        )
        sources.add_row(s["spec"], files, documents, _mb(s["bytes"]), skipped, invalid, s["sha256"][:16])
    console.print(sources)

    c = manifest["cleaning"]
    cleaning = _table("cleaning", "documents in", "too short", "non-text", "duplicate", "kept")
    cleaning.add_row(*(f"{c[k]:,}" for k in ("documents_in", "too_short", "nontext", "duplicate", "kept")))
    console.print(cleaning)

    t = manifest["tokenizer"]
    console.print(
        f"[bold]tokenizer[/bold] {t['kind']}, vocab {t['vocab_size']:,}, trained on {_mb(t['train_bytes'])}, "
        f"sha256 {t['sha256'][:16]}, shards {manifest['dtype']}"
    )

    splits = _table("splits", "split", "documents", "size", "tokens", "bytes/token", "shards")
    for name, s in manifest["splits"].items():
        ratio = f"{s['bytes'] / s['tokens']:.2f}" if s["tokens"] else "-"
        splits.add_row(
            name, f"{s['documents']:,}", _mb(s["bytes"]), f"{s['tokens']:,}", ratio, f"{len(s['shards'])}"
        )
    console.print(splits)
    secs = manifest.get("seconds", {})
    if secs:
        console.print(f"prepared in {secs['total']:.1f} s (tokenizer {secs['tokenizer']:.1f} s)")
