"""Training and validation batches from token shards.

    loader = TrainLoader(TokenDataset("data/tiny", "train"), seq_len=256, global_batch=32,
                         seed=0, rank=rank, world_size=world)
    with loader:
        for step, x, y in loader.iterate(start_step):   # x, y: (B/world, seq_len) int64
            ...

Design choices:

- The global batch at step ``s`` is a pure function of ``(seed, s)`` and the shards; rank ``r``
  takes rows ``[r*B/W, (r+1)*B/W)``. So 1, 2 or 4 processes train on the same rows, and resuming
  needs no saved loader state: ``"random"`` mode draws with ``np.random.default_rng([seed,
  step])``, ``"epoch"`` mode places sample ``step*B + row`` in a seeded per-epoch permutation.
  Every rank draws all ``B`` starts (cheap) but reads only its own rows.
- Windows of ``seq_len + 1`` tokens never cross a shard boundary: one contiguous memmap slice.
- Prefetching is a thread, not worker processes: reading a few memmap slices is cheap, the thread
  only has to hide page faults and the pinned host copy, and a thread shares the memmaps and needs
  no pickling. Host tensors are freshly allocated pinned memory each step; PyTorch's caching host
  allocator does not reuse a pinned block until its non-blocking copy is done, so no buffer is
  overwritten while in flight.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ember.config import SAMPLING_MODES as MODES
from ember.data.prefetch import Prefetcher
from ember.data.shards import read_shard
from ember.errors import ConfigError, DataError

_REBUILD = "re-run `ember data prepare ... --force`"


class TokenDataset:
    """All shards of one split in a data directory, as read-only memmaps. If ``manifest.json``
    exists its shard list is authoritative (files not listed are ignored, listed files must exist
    with the listed token count); otherwise the shards are ``{split}-*.bin`` sorted by name."""

    def __init__(self, data_dir: str | os.PathLike, split: str, *, verify: bool = False):
        self.data_dir = Path(data_dir)
        self.split = split
        entries = self._manifest_entries()
        if entries is None:
            entries = [{"name": p.name} for p in sorted(self.data_dir.glob(f"{split}-*.bin"))]
        if not entries:
            raise DataError(f"no {split} shards in {self.data_dir}; run `ember data prepare`")
        self.names: list[str] = []
        self.shards: list[np.ndarray] = []
        for entry in entries:
            path = self.data_dir / entry["name"]
            if "n_tokens" in entry and not path.is_file():
                raise DataError(
                    f"shard {path} is listed in {self.data_dir / 'manifest.json'} but missing; {_REBUILD}"
                )
            tokens = read_shard(path, verify_sha256=entry.get("sha256") if verify else None)
            if "n_tokens" in entry and len(tokens) != entry["n_tokens"]:
                raise DataError(
                    f"shard {path} has {len(tokens)} tokens but manifest.json lists "
                    f"{entry['n_tokens']}; {_REBUILD}"
                )
            self.names.append(path.name)
            self.shards.append(tokens)
        self.shard_tokens = np.array([len(s) for s in self.shards], dtype=np.int64)
        self.n_tokens = int(self.shard_tokens.sum())

    def _manifest_entries(self) -> list[dict] | None:
        path = self.data_dir / "manifest.json"
        if not path.is_file():
            return None
        try:
            manifest = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"cannot read {path}: {e}; {_REBUILD}") from e
        splits = manifest.get("splits", {}) if isinstance(manifest, dict) else None
        if not isinstance(splits, dict):
            raise DataError(f"{path} has no 'splits' table; {_REBUILD}")
        if self.split not in splits:
            return []
        entries = splits[self.split].get("shards") if isinstance(splits[self.split], dict) else None
        if not isinstance(entries, list):
            raise DataError(f"{path}: splits.{self.split} has no 'shards' list; {_REBUILD}")
        for i, entry in enumerate(entries):
            name = entry.get("name") if isinstance(entry, dict) else None
            if (
                not isinstance(name, str)
                or Path(name).name != name
                or not isinstance(entry.get("n_tokens"), int)
            ):
                raise DataError(
                    f"{path}: splits.{self.split}.shards[{i}] needs a plain file 'name' and an "
                    f"integer 'n_tokens'; {_REBUILD}"
                )
        return entries

    def __len__(self) -> int:
        return self.n_tokens

    def window(self, shard_idx: int, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start+length)`` of one shard (a view, not a copy)."""
        shard = self.shards[shard_idx]
        if start < 0 or length < 0 or start + length > len(shard):
            raise IndexError(
                f"window [{start}, {start + length}) outside shard {self.names[shard_idx]} "
                f"of {len(shard)} tokens"
            )
        return shard[start : start + length]


def _stride_counts(shard_tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping windows per shard: starts k*seq_len with k*seq_len + seq_len + 1 <= n."""
    return np.maximum(shard_tokens - 1, 0) // seq_len


def _locate(counts: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Global index over the concatenated per-shard ranges -> (shard, index within shard)."""
    ends = np.cumsum(counts)
    shard = np.searchsorted(ends, index, side="right")  # skips shards with count 0
    return shard, index - (ends[shard] - counts[shard])


def _too_small(dataset: TokenDataset, seq_len: int) -> DataError:
    return DataError(
        f"the {dataset.split} split in {dataset.data_dir} is too small for seq_len={seq_len}: "
        f"a window needs {seq_len + 1} tokens inside one shard and the largest shard has "
        f"{int(dataset.shard_tokens.max())}; lower seq_len or prepare more data"
    )


class _RandomSampler:
    """Uniform over every valid start of every shard, independently per step."""

    def __init__(self, dataset: TokenDataset, seq_len: int, global_batch: int, seed: int):
        self.counts = np.maximum(dataset.shard_tokens - seq_len, 0)  # starts with seq_len+1 room
        self.total = int(self.counts.sum())
        if self.total == 0:
            raise _too_small(dataset, seq_len)
        self.global_batch, self.seed = global_batch, seed

    def locate(self, step: int, rows: slice) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.total, size=self.global_batch)  # all ranks draw all rows
        return _locate(self.counts, starts[rows])


class _EpochSampler:
    """Each stride-seq_len window once per epoch, in a seeded permutation per epoch."""

    def __init__(self, dataset: TokenDataset, seq_len: int, global_batch: int, seed: int):
        self.counts = _stride_counts(dataset.shard_tokens, seq_len)
        self.n_windows = int(self.counts.sum())
        if self.n_windows == 0:
            raise _too_small(dataset, seq_len)
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self._perms: dict[int, np.ndarray] = {}  # a batch spans at most two epochs
        self._lock = threading.Lock()  # batch() and the prefetch thread may both ask

    def _perm(self, epoch: int) -> np.ndarray:
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is None:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
                if len(self._perms) >= 2:
                    self._perms.pop(min(self._perms))
                self._perms[epoch] = perm
            return perm

    def locate(self, step: int, rows: slice) -> tuple[np.ndarray, np.ndarray]:
        sample = step * self.global_batch + np.arange(self.global_batch)[rows]
        epochs, pos = np.divmod(sample, self.n_windows)
        window = np.empty_like(sample)
        for epoch in np.unique(epochs).tolist():
            mask = epochs == epoch
            window[mask] = self._perm(epoch)[pos[mask]]
        shard, k = _locate(self.counts, window)
        return shard, k * self.seq_len


def _gather(
    dataset: TokenDataset, shards: np.ndarray, starts: np.ndarray, seq_len: int, pin: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read windows into (rows, seq_len) int64 host tensors x and y = x shifted by one."""
    rows = len(starts)
    x = torch.empty((rows, seq_len), dtype=torch.int64, pin_memory=pin)
    y = torch.empty((rows, seq_len), dtype=torch.int64, pin_memory=pin)
    xn, yn = x.numpy(), y.numpy()  # write straight into the (pinned) tensors: no extra copy
    for r, (shard, start) in enumerate(zip(shards.tolist(), starts.tolist(), strict=True)):
        w = dataset.window(shard, start, seq_len + 1)
        xn[r] = w[:-1]
        yn[r] = w[1:]
    return x, y


def _to_device(x: torch.Tensor, y: torch.Tensor, device: torch.device, non_blocking: bool):
    if device.type == "cpu":
        return x, y
    return x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking)


class TrainLoader:
    """Training batches: ``batch(step)`` or ``iterate(start_step)`` -> (x, y) of shape
    (global_batch // world_size, seq_len), int64, on ``device``."""

    def __init__(
        self,
        dataset: TokenDataset,
        seq_len: int,
        global_batch: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        mode: str = "random",
        device: str | torch.device = "cpu",
        prefetch: bool | None = None,
        prefetch_depth: int = 2,
    ):
        if seq_len < 1 or global_batch < 1 or seed < 0 or prefetch_depth < 1:
            raise ConfigError(
                f"TrainLoader needs seq_len >= 1, global_batch >= 1, seed >= 0 and "
                f"prefetch_depth >= 1, got {seq_len}, {global_batch}, {seed}, {prefetch_depth}"
            )
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world_size {world_size}")
        if global_batch % world_size != 0:
            raise DataError(
                f"global_batch {global_batch} is not divisible by world_size {world_size}; "
                f"set the global batch to a multiple of {world_size}"
            )
        if mode not in MODES:
            raise ConfigError(f"unknown sampling mode {mode!r}; choose one of {MODES}")
        self.dataset, self.seq_len, self.global_batch = dataset, seq_len, global_batch
        self.local_batch = global_batch // world_size
        self.seed, self.rank, self.world_size, self.mode = seed, rank, world_size, mode
        self.device = torch.device(device)
        self.prefetch = self.device.type == "cuda" if prefetch is None else bool(prefetch)
        self.prefetch_depth = prefetch_depth
        self._pin = self.device.type == "cuda"
        self._rows = slice(rank * self.local_batch, (rank + 1) * self.local_batch)
        sampler_cls = _RandomSampler if mode == "random" else _EpochSampler
        self._sampler = sampler_cls(dataset, seq_len, global_batch, seed)
        self._worker: Prefetcher | None = None

    def _host_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        shards, starts = self._sampler.locate(step, self._rows)
        return _gather(self.dataset, shards, starts, self.seq_len, self._pin)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the global batch at ``step`` (synchronous, no prefetch)."""
        return _to_device(*self._host_batch(step), self.device, non_blocking=False)

    def iterate(self, start_step: int = 0) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(step, x, y)`` for ``start_step, start_step + 1, ...`` forever."""
        if not self.prefetch:
            for step in itertools.count(start_step):
                yield (step, *self.batch(step))
        self.close()  # one prefetch thread per loader: a new iteration replaces the old one
        host = ((step, *self._host_batch(step)) for step in itertools.count(start_step))
        worker = self._worker = Prefetcher(host, self.prefetch_depth)
        try:
            for step, x, y in worker:
                yield (step, *_to_device(x, y, self.device, non_blocking=self._pin))
        finally:
            worker.stop()
            if self._worker is worker:
                self._worker = None

    def close(self) -> None:
        """Stop the prefetch thread, if one runs."""
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def __enter__(self) -> TrainLoader:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()


class ValLoader:
    """A fixed list of validation windows, yielded in order as (x, y) batches: the non-overlapping
    stride-``seq_len`` windows from the start of the split, evenly spaced ones if there are more
    than ``max_windows``. Rank ``r`` takes windows ``i`` with ``i % world_size == r``, so ranks may
    differ by one window (and then by one batch)."""

    def __init__(
        self,
        dataset: TokenDataset,
        seq_len: int,
        batch_size: int,
        max_windows: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
    ):
        if seq_len < 1 or batch_size < 1 or (max_windows is not None and max_windows < 1):
            raise ConfigError(
                f"ValLoader needs seq_len >= 1, batch_size >= 1 and max_windows >= 1 or None, "
                f"got {seq_len}, {batch_size}, {max_windows}"
            )
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world_size {world_size}")
        counts = _stride_counts(dataset.shard_tokens, seq_len)
        total = int(counts.sum())
        if total == 0:
            raise _too_small(dataset, seq_len)
        if max_windows is None or total <= max_windows:
            chosen = np.arange(total)
        else:
            chosen = np.arange(max_windows) * total // max_windows  # evenly spaced, distinct
        self.n_windows_total = len(chosen)
        shards, k = _locate(counts, chosen[rank::world_size])
        self.shards, self.starts = shards, k * seq_len
        self.dataset, self.seq_len, self.batch_size = dataset, seq_len, batch_size
        self.device = torch.device(device)

    @property
    def n_windows(self) -> int:
        """Windows this rank evaluates."""
        return len(self.starts)

    def __len__(self) -> int:
        return -(-self.n_windows // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for lo in range(0, self.n_windows, self.batch_size):
            hi = lo + self.batch_size
            x, y = _gather(self.dataset, self.shards[lo:hi], self.starts[lo:hi], self.seq_len, False)
            yield _to_device(x, y, self.device, non_blocking=False)
