import dataclasses
import itertools
import json

import numpy as np
import pytest
import torch

from ember.data.loader import TokenDataset, TrainLoader, ValLoader
from ember.data.shards import ShardWriter
from ember.errors import DataError

SEQ = 4
SHARD_STRIDE = 10_000  # shard i holds i*10_000 + arange(n): a token names its shard and offset


def make_split(data_dir, split, sizes, manifest=True):
    """Shards whose tokens reveal (shard, offset); returns the ShardInfos."""
    infos = []
    for i, n in enumerate(sizes):
        with ShardWriter(data_dir / f"{split}-{i:06d}.bin", np.uint32) as w:
            w.write(np.arange(n) + i * SHARD_STRIDE)
        infos.append(w.close())
    if manifest:
        path = data_dir / "manifest.json"
        doc = json.loads(path.read_text()) if path.exists() else {"splits": {}}
        doc["splits"][split] = {"shards": [dataclasses.asdict(i) for i in infos]}
        path.write_text(json.dumps(doc))
    return infos


@pytest.fixture
def ds(tmp_path):
    # shard 1 is too small for a window of SEQ+1 tokens and must never be sampled
    make_split(tmp_path, "train", [23, 3, 40, 9])
    return TokenDataset(tmp_path, "train")


def stride_windows(sizes):
    """First tokens of the non-overlapping stride-SEQ windows, in shard order."""
    return [s * SHARD_STRIDE + k * SEQ for s, n in enumerate(sizes) for k in range((n - 1) // SEQ)]


def check_windows(x, y, sizes):
    """y is x shifted by one, and each row is one contiguous run inside one shard."""
    x, y = x.numpy(), y.numpy()
    assert x.shape == y.shape and x.shape[1] == SEQ
    window = np.concatenate([x, y[:, -1:]], axis=1)  # (rows, SEQ + 1)
    np.testing.assert_array_equal(y, window[:, 1:])
    np.testing.assert_array_equal(np.diff(window, axis=1), 1)  # consecutive tokens
    shard, offset = np.divmod(window, SHARD_STRIDE)
    assert (shard == shard[:, :1]).all()  # never crosses a shard boundary
    assert (offset[:, -1] < np.asarray(sizes)[shard[:, 0]]).all()


def test_dataset_reads_manifest(ds):
    assert ds.n_tokens == 23 + 3 + 40 + 9
    assert ds.names == [f"train-{i:06d}.bin" for i in range(4)]
    np.testing.assert_array_equal(ds.window(2, 5, 3), [20_005, 20_006, 20_007])
    with pytest.raises(IndexError):
        ds.window(0, 20, 4)


def test_dataset_ignores_files_not_in_manifest(tmp_path):
    make_split(tmp_path, "train", [10, 10])
    with ShardWriter(tmp_path / "train-000009.bin", np.uint16) as w:  # a stale leftover
        w.write(range(50))
    assert TokenDataset(tmp_path, "train").n_tokens == 20


def test_dataset_globs_without_manifest(tmp_path):
    make_split(tmp_path, "val", [7, 5], manifest=False)
    ds = TokenDataset(tmp_path, "val")
    assert ds.names == ["val-000000.bin", "val-000001.bin"] and ds.n_tokens == 12


def test_manifest_count_mismatch(tmp_path):
    make_split(tmp_path, "train", [10, 10])
    doc = json.loads((tmp_path / "manifest.json").read_text())
    doc["splits"]["train"]["shards"][1]["n_tokens"] = 11
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(DataError, match="train-000001.bin has 10 tokens but manifest.json lists 11"):
        TokenDataset(tmp_path, "train")


def test_manifest_missing_shard(tmp_path):
    make_split(tmp_path, "train", [10, 10])
    (tmp_path / "train-000000.bin").unlink()
    with pytest.raises(DataError, match="train-000000.bin is listed .* but missing"):
        TokenDataset(tmp_path, "train")


def test_verify_catches_corrupt_payload(tmp_path):
    make_split(tmp_path, "train", [10])
    path = tmp_path / "train-000000.bin"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    TokenDataset(tmp_path, "train")  # sizes still agree
    with pytest.raises(DataError, match="sha256"):
        TokenDataset(tmp_path, "train", verify=True)


@pytest.mark.parametrize("manifest", [True, False])
def test_no_shards(tmp_path, manifest):
    make_split(tmp_path, "train", [10], manifest=manifest)
    with pytest.raises(DataError, match=f"no val shards in {tmp_path}"):
        TokenDataset(tmp_path, "val")


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_split_too_small(tmp_path, mode):
    make_split(tmp_path, "train", [4, 3])  # no shard holds SEQ + 1 = 5 tokens
    ds = TokenDataset(tmp_path, "train")
    with pytest.raises(DataError, match="too small for seq_len=4"):
        TrainLoader(ds, SEQ, 2, seed=0, mode=mode)
    with pytest.raises(DataError, match="too small for seq_len=4"):
        ValLoader(ds, SEQ, 2)


def test_global_batch_must_divide(ds):
    with pytest.raises(DataError, match="not divisible by world_size 4"):
        TrainLoader(ds, SEQ, 6, seed=0, rank=0, world_size=4)


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_batches_are_deterministic_and_correct(ds, mode):
    a = TrainLoader(ds, SEQ, 8, seed=3, mode=mode)
    b = TrainLoader(ds, SEQ, 8, seed=3, mode=mode)
    for step in (0, 1, 17):
        x, y = a.batch(step)
        assert x.dtype == y.dtype == torch.int64 and x.shape == (8, SEQ)
        assert x.is_contiguous() and y.is_contiguous()
        check_windows(x, y, [23, 3, 40, 9])
        xb, yb = b.batch(step)
        assert torch.equal(x, xb) and torch.equal(y, yb)
    assert not torch.equal(a.batch(0)[0], a.batch(1)[0])
    assert not torch.equal(a.batch(0)[0], TrainLoader(ds, SEQ, 8, seed=4, mode=mode).batch(0)[0])


def test_random_mode_covers_every_valid_start(ds):
    loader = TrainLoader(ds, SEQ, 16, seed=0)
    starts = set()
    for step in range(200):
        x, _ = loader.batch(step)
        starts.update(x[:, 0].tolist())
    valid = {s * SHARD_STRIDE + o for s, n in enumerate([23, 3, 40, 9]) for o in range(n - SEQ)}
    assert starts == valid  # uniform over all starts, none outside (shard 1 has none)


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_rank_slices_concatenate_to_global_batch(ds, mode):
    for step in (0, 5):
        full_x, full_y = TrainLoader(ds, SEQ, 8, seed=1, mode=mode).batch(step)
        for world in (2, 4):
            parts = [
                TrainLoader(ds, SEQ, 8, seed=1, rank=r, world_size=world, mode=mode).batch(step)
                for r in range(world)
            ]
            assert all(p[0].shape == (8 // world, SEQ) for p in parts)
            assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
            assert torch.equal(torch.cat([p[1] for p in parts]), full_y)


def test_epoch_mode_visits_each_window_once_per_epoch(ds):
    # stride windows per shard: (23-1)//4=5, 0, (40-1)//4=9, (9-1)//4=2 -> 16 windows
    expected = stride_windows([23, 3, 40, 9])
    assert len(expected) == 16
    loader = TrainLoader(ds, SEQ, 6, seed=2, mode="epoch")  # 6 does not divide 16: batches straddle epochs
    order = np.concatenate([loader.batch(step)[0][:, 0].numpy() for step in range(8)])  # 48 = 3 epochs
    epochs = order.reshape(3, 16)
    for e in epochs:
        assert sorted(e.tolist()) == expected
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[1], epochs[2])


def test_iterate_resumes_at_any_step(ds):
    loader = TrainLoader(ds, SEQ, 4, seed=0)
    it = loader.iterate(7)
    for want in (7, 8, 9):
        step, x, y = next(it)
        assert step == want
        bx, by = loader.batch(want)
        assert torch.equal(x, bx) and torch.equal(y, by)


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_prefetch_matches_plain(ds, mode):
    plain = TrainLoader(ds, SEQ, 4, seed=5, rank=1, world_size=2, mode=mode, prefetch=False)
    with TrainLoader(ds, SEQ, 4, seed=5, rank=1, world_size=2, mode=mode, prefetch=True) as fast:
        it = fast.iterate(3)
        for want in range(3, 13):
            step, x, y = next(it)
            px, py = plain.batch(want)
            assert step == want and torch.equal(x, px) and torch.equal(y, py)
        worker = fast._worker
        assert worker is not None and worker.alive
    assert not worker.alive  # close() on exit stopped the thread


def test_prefetch_worker_error_reaches_caller(ds):
    class Boom(Exception):
        pass

    loader = TrainLoader(ds, SEQ, 4, seed=0, prefetch=True)
    produce = loader._host_batch

    def failing(step):
        if step == 2:
            raise Boom(f"bad step {step}")
        return produce(step)

    loader._host_batch = failing
    it = loader.iterate(0)
    assert [next(it)[0] for _ in range(2)] == [0, 1]  # batches before the failure arrive intact
    worker = loader._worker
    with pytest.raises(Boom, match="bad step 2"):
        next(it)
    assert not worker.alive and loader._worker is None


def test_val_windows_fixed_and_in_order(ds):
    val = ValLoader(ds, SEQ, batch_size=5)
    assert val.n_windows == 16 and len(val) == 4
    batches = list(val)
    assert [b[0].shape[0] for b in batches] == [5, 5, 5, 1]
    firsts = np.concatenate([x[:, 0].numpy() for x, _ in batches])
    expected = stride_windows([23, 3, 40, 9])
    np.testing.assert_array_equal(firsts, expected)
    for x, y in batches:
        check_windows(x, y, [23, 3, 40, 9])
    again = list(ValLoader(ds, SEQ, batch_size=5))
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again, strict=True)
    )


def test_val_cap_takes_evenly_spaced_windows(ds):
    val = ValLoader(ds, SEQ, batch_size=100, max_windows=4)
    ((x, _),) = list(val)
    all_windows = stride_windows([23, 3, 40, 9])
    assert x[:, 0].tolist() == [all_windows[i] for i in (0, 4, 8, 12)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_val_ranks_cover_every_window_once(ds, world):
    full = torch.cat([x for x, _ in ValLoader(ds, SEQ, batch_size=3, max_windows=10)])
    shares = [
        torch.cat([x for x, _ in ValLoader(ds, SEQ, 3, max_windows=10, rank=r, world_size=world)])
        for r in range(world)
    ]
    assert sum(len(s) for s in shares) == len(full) == 10
    for r, share in enumerate(shares):
        assert torch.equal(share, full[r::world])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pinned_prefetch_matches_plain(ds):
    plain = TrainLoader(ds, SEQ, 4, seed=9, prefetch=False)
    with TrainLoader(ds, SEQ, 4, seed=9, device="cuda") as fast:  # prefetch defaults on for CUDA
        it = fast.iterate(0)
        for want in range(6):
            step, x, y = next(it)
            assert x.is_cuda and y.is_cuda
            px, py = plain.batch(want)
            assert step == want and torch.equal(x.cpu(), px) and torch.equal(y.cpu(), py)


def test_prefetcher_ends_with_its_items_and_stops_when_left():
    from ember.data.prefetch import Prefetcher

    assert list(Prefetcher(range(7), depth=2)) == list(range(7))
    endless = Prefetcher(itertools.count(), depth=2)
    for i in endless:
        if i == 3:
            break
    assert not endless.alive  # leaving the loop stopped the thread, though its queue was full
