"""Token shards: the on-disk format between the tokenizer and the loader.

A shard is a 64-byte little-endian header (``b"EMBERTOK"``, version, itemsize, n_tokens; docs/data.md
has the layout), then the tokens as raw ``uint16`` (vocab <= 65536) or ``uint32``.

    with ShardSplitWriter("data/tiny", "train", token_dtype(vocab_size)) as w:
        for doc in docs:
            w.write(tokenizer.encode(doc))
    tokens = read_shard("data/tiny/train-000000.bin")   # read-only np.memmap

Design choices:

- Raw tokens after a fixed header, not ``.npy``: a reader needs nothing but
  ``np.memmap(offset=64)``, the file size alone proves the file is complete,
  and the format is trivial to read from any language.
- A writer streams to ``<name>.tmp`` and renames it over the final name only
  after the header holds the final count and the bytes are fsynced, so a crash
  or an exception never leaves a half-written shard where a good one stood.
- The sha256 covers the token payload only (not the header), so it names the
  data itself; it is computed while writing, so checking it later costs one
  read of the file and no second pass at write time.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import numpy as np

from ember.errors import DataError

MAGIC = b"EMBERTOK"
VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sIIQ")  # magic, version, itemsize, n_tokens; then zero padding
_FIX = "re-run `ember data prepare ... --force` to rebuild it"
_HASH_CHUNK = 1 << 24  # bytes read per hashlib update when verifying


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest shard dtype that holds every token id of a vocabulary."""
    if vocab_size < 1 or vocab_size > 2**32:
        raise ValueError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def _check_dtype(dtype: np.dtype | type | str) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.kind != "u" or dt.itemsize not in (2, 4):
        raise ValueError(f"shard dtype must be uint16 or uint32, got {dt}")
    return dt.newbyteorder("<")


def _pack_header(itemsize: int, n_tokens: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, itemsize, n_tokens).ljust(HEADER_SIZE, b"\0")


@dataclass(frozen=True)
class ShardInfo:
    """What a manifest records about one shard."""

    name: str  # file name inside the data directory, e.g. "train-000000.bin"
    n_tokens: int
    sha256: str  # hex digest of the token payload (the bytes after the header)


class _Sealing:
    """``with``: ``close()`` (seal) on success, ``abort()`` (discard) on an exception."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class ShardWriter(_Sealing):
    """Streams tokens into one shard file; ``close()`` seals it and returns its info."""

    def __init__(self, path: str | os.PathLike, dtype: np.dtype | type | str):
        self.path = Path(path)
        self.dtype = _check_dtype(dtype)
        self.n_tokens = 0
        self._hash = hashlib.sha256()
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._file = open(self._tmp, "wb")
        self._file.write(_pack_header(self.dtype.itemsize, 0))  # count filled in by close()
        self._info: ShardInfo | None = None

    def write(self, tokens: np.ndarray | Sequence[int]) -> None:
        if self._file is None:
            raise RuntimeError(f"ShardWriter for {self.path} is closed")
        arr = np.asarray(tokens)
        if arr.size == 0:
            return
        if arr.dtype != self.dtype:
            if arr.dtype.kind not in "iu":
                raise DataError(
                    f"tokens for {self.path} must be integers, got dtype {arr.dtype}; "
                    "pass token ids from the tokenizer"
                )
            lo, hi = int(arr.min()), int(arr.max())
            limit = 2 ** (8 * self.dtype.itemsize)
            if lo < 0 or hi >= limit:
                raise DataError(
                    f"token id {lo if lo < 0 else hi} does not fit the {self.dtype.name} "
                    f"shard {self.path} (valid ids are 0..{limit - 1}); build shards with "
                    "token_dtype(vocab_size) of the tokenizer that produced these ids"
                )
            arr = arr.astype(self.dtype)
        arr = np.ascontiguousarray(arr.reshape(-1))
        self._file.write(arr.data)
        self._hash.update(arr.data)
        self.n_tokens += arr.size

    def close(self) -> ShardInfo:
        if self._info is not None:
            return self._info
        f = self._file
        f.seek(0)
        f.write(_pack_header(self.dtype.itemsize, self.n_tokens))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._file = None
        os.replace(self._tmp, self.path)
        self._info = ShardInfo(self.path.name, self.n_tokens, self._hash.hexdigest())
        return self._info

    def abort(self) -> None:
        """Drop everything written so far; a file already at ``path`` is left untouched."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._tmp.unlink(missing_ok=True)


class ShardSplitWriter(_Sealing):
    """Writes one split as ``{split}-000000.bin``, ``{split}-000001.bin``, ... of at most
    ``max_tokens`` tokens each. A document may straddle two shards: the loader samples windows
    inside a shard, so a split document only loses the windows that would cross the boundary."""

    def __init__(
        self,
        out_dir: str | os.PathLike,
        split: str,
        dtype: np.dtype | type | str,
        max_tokens: int = 100_000_000,
    ):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.out_dir = Path(out_dir)
        self.split = split
        self.dtype = _check_dtype(dtype)
        self.max_tokens = max_tokens
        self.infos: list[ShardInfo] = []
        self._current: ShardWriter | None = None
        self._closed = False
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def write(self, tokens: np.ndarray | Sequence[int]) -> None:
        if self._closed:
            raise RuntimeError(f"ShardSplitWriter for {self.split} is closed")
        arr = np.asarray(tokens).reshape(-1)
        pos = 0
        while pos < arr.size:  # a shard is opened only when a token needs it: no empty shards
            if self._current is None:
                name = f"{self.split}-{len(self.infos):06d}.bin"
                self._current = ShardWriter(self.out_dir / name, self.dtype)
            take = min(self.max_tokens - self._current.n_tokens, arr.size - pos)
            self._current.write(arr[pos : pos + take])
            pos += take
            if self._current.n_tokens == self.max_tokens:
                self.infos.append(self._current.close())
                self._current = None

    def close(self) -> list[ShardInfo]:
        if self._current is not None:
            self.infos.append(self._current.close())
            self._current = None
        self._closed = True
        return list(self.infos)

    def abort(self) -> None:
        """Remove the shard in progress and the shards this writer already sealed:
        half a split is not a split."""
        if self._current is not None:
            self._current.abort()
            self._current = None
        for info in self.infos:
            (self.out_dir / info.name).unlink(missing_ok=True)
        self.infos = []
        self._closed = True


def _corrupt(path: Path, problem: str) -> DataError:
    return DataError(f"corrupt shard {path}: {problem}; {_FIX}")


def read_shard(path: str | os.PathLike, verify_sha256: str | None = None) -> np.memmap:
    """Validate a shard's header and size and return its tokens as a read-only memmap; with
    ``verify_sha256`` the payload is hashed (one full read) and compared."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"shard {path} does not exist; run `ember data prepare` to create it")
    size = path.stat().st_size
    if size < HEADER_SIZE:
        raise _corrupt(path, f"file is {size} bytes, shorter than the {HEADER_SIZE}-byte header")
    with open(path, "rb") as f:
        header = f.read(HEADER_SIZE)
    magic, version, itemsize, n_tokens = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise _corrupt(path, f"bad magic {magic!r}, expected {MAGIC!r} (not an ember shard)")
    if version != VERSION:
        raise _corrupt(path, f"unknown format version {version}, this ember reads version {VERSION}")
    if itemsize not in (2, 4):
        raise _corrupt(path, f"itemsize {itemsize} is neither 2 (uint16) nor 4 (uint32)")
    expected = HEADER_SIZE + n_tokens * itemsize
    if size != expected:
        what = "truncated" if size < expected else "trailing bytes after the tokens"
        raise _corrupt(path, f"{what}: header says {n_tokens} tokens = {expected} bytes, file has {size}")
    if verify_sha256 is not None:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            f.seek(HEADER_SIZE)
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != verify_sha256:
            raise _corrupt(path, f"sha256 {digest.hexdigest()} does not match the manifest's {verify_sha256}")
    dtype = np.dtype("<u2") if itemsize == 2 else np.dtype("<u4")
    if n_tokens == 0:  # mmap cannot map zero bytes; an empty read-only array behaves the same
        empty = np.zeros(0, dtype=dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_SIZE, shape=(n_tokens,))
