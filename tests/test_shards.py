import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.data.shards import (
    HEADER_SIZE,
    MAGIC,
    ShardInfo,
    ShardSplitWriter,
    ShardWriter,
    read_shard,
    token_dtype,
)
from ember.errors import DataError


def write_shard(path, tokens, dtype):
    with ShardWriter(path, dtype) as w:
        w.write(tokens)
    return w.close()


def test_token_dtype_boundary():
    assert token_dtype(256) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


@pytest.mark.parametrize(
    "dtype, tokens",
    [
        (np.uint16, [0, 1, 2, 65535, 7, 300]),
        (np.uint32, [0, 65536, 2**32 - 1, 5, 100_000]),
    ],
)
def test_round_trip_and_header(tmp_path, dtype, tokens):
    path = tmp_path / "s.bin"
    info = write_shard(path, tokens, dtype)
    itemsize = np.dtype(dtype).itemsize

    raw = path.read_bytes()
    assert len(raw) == HEADER_SIZE + len(tokens) * itemsize
    magic, version, size, n = struct.unpack_from("<8sIIQ", raw)
    assert (magic, version, size, n) == (MAGIC, 1, itemsize, len(tokens))
    assert raw[24:HEADER_SIZE] == b"\0" * (HEADER_SIZE - 24)

    payload = np.asarray(tokens, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()
    assert raw[HEADER_SIZE:] == payload
    assert info == ShardInfo("s.bin", len(tokens), hashlib.sha256(payload).hexdigest())

    got = read_shard(path, verify_sha256=info.sha256)
    assert isinstance(got, np.memmap)
    assert got.dtype.itemsize == itemsize
    np.testing.assert_array_equal(got, tokens)
    with pytest.raises(ValueError):
        got[0] = 1  # read-only
    assert not (tmp_path / "s.bin.tmp").exists()


def test_streamed_writes_equal_one_write(tmp_path):
    tokens = np.arange(1000, dtype=np.int64) * 37 % 50_000
    one = write_shard(tmp_path / "a.bin", tokens, np.uint16)
    with ShardWriter(tmp_path / "b.bin", np.uint16) as w:
        for chunk in np.array_split(tokens, 7):
            w.write(chunk.tolist())  # python ints take the checked path
        w.write([])
    assert w.close().sha256 == one.sha256
    np.testing.assert_array_equal(read_shard(tmp_path / "b.bin"), tokens)


def test_empty_shard(tmp_path):
    info = write_shard(tmp_path / "e.bin", [], np.uint16)
    assert info.n_tokens == 0 and info.sha256 == hashlib.sha256(b"").hexdigest()
    assert len(read_shard(tmp_path / "e.bin", verify_sha256=info.sha256)) == 0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=200))
def test_round_trip_property(tmp_path_factory, tokens):
    path = tmp_path_factory.mktemp("p") / "s.bin"
    info = write_shard(path, tokens, np.uint32)
    assert info.n_tokens == len(tokens)
    np.testing.assert_array_equal(read_shard(path, verify_sha256=info.sha256), np.array(tokens, np.uint32))


@pytest.mark.parametrize("bad", [[1, 65536], [-1, 3]])
def test_out_of_range_tokens_rejected_and_file_removed(tmp_path, bad):
    path = tmp_path / "s.bin"
    with pytest.raises(DataError, match="does not fit"):
        with ShardWriter(path, np.uint16) as w:
            w.write([1, 2, 3])
            w.write(bad)
    assert list(tmp_path.iterdir()) == []


def test_failed_writer_keeps_good_file(tmp_path):
    path = tmp_path / "s.bin"
    info = write_shard(path, [5, 6, 7], np.uint16)
    with pytest.raises(RuntimeError):
        with ShardWriter(path, np.uint16) as w:
            w.write([9] * 100)
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin"]
    np.testing.assert_array_equal(read_shard(path, verify_sha256=info.sha256), [5, 6, 7])


@pytest.mark.parametrize(
    "n, max_tokens, chunks, sizes",
    [
        (25, 10, 1, [10, 10, 5]),
        (25, 10, 9, [10, 10, 5]),
        (20, 10, 3, [10, 10]),  # an exact multiple opens no empty trailing shard
        (3, 10, 1, [3]),
        (0, 10, 1, []),
    ],
)
def test_split_writer_boundaries(tmp_path, n, max_tokens, chunks, sizes):
    tokens = np.arange(n, dtype=np.uint16) + 100
    with ShardSplitWriter(tmp_path, "train", np.uint16, max_tokens=max_tokens) as w:
        for chunk in np.array_split(tokens, chunks):
            w.write(chunk)
    infos = w.close()
    assert [i.n_tokens for i in infos] == sizes
    assert [i.name for i in infos] == [f"train-{k:06d}.bin" for k in range(len(sizes))]
    assert sorted(p.name for p in tmp_path.iterdir()) == [i.name for i in infos]
    parts = [read_shard(tmp_path / i.name, verify_sha256=i.sha256) for i in infos]
    np.testing.assert_array_equal(np.concatenate(parts) if parts else [], tokens)


def test_split_writer_failure_removes_its_shards(tmp_path):
    with pytest.raises(DataError):
        with ShardSplitWriter(tmp_path, "val", np.uint16, max_tokens=4) as w:
            w.write(range(10))
            w.write([70_000])
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def good_shard(tmp_path):
    path = tmp_path / "train-000000.bin"
    info = write_shard(path, np.arange(10), np.uint16)
    return path, info


def _corrupt_and_check(path, raw, match):
    path.write_bytes(raw)
    with pytest.raises(DataError, match=match) as e:
        read_shard(path)
    assert path.name in str(e.value)
    assert "--force" in str(e.value)


def test_truncated_payload(good_shard):
    path, _ = good_shard
    _corrupt_and_check(path, path.read_bytes()[:-3], "truncated")


def test_shorter_than_header(good_shard):
    path, _ = good_shard
    _corrupt_and_check(path, path.read_bytes()[:40], "shorter than the 64-byte header")


def test_trailing_bytes(good_shard):
    path, _ = good_shard
    _corrupt_and_check(path, path.read_bytes() + b"\0\0", "trailing bytes")


def test_bad_magic(good_shard):
    path, _ = good_shard
    _corrupt_and_check(path, b"NOTEMBER" + path.read_bytes()[8:], "bad magic")


def test_wrong_version(good_shard):
    path, _ = good_shard
    raw = bytearray(path.read_bytes())
    raw[8:12] = struct.pack("<I", 2)
    _corrupt_and_check(path, bytes(raw), "unknown format version 2")


def test_bad_itemsize(good_shard):
    path, _ = good_shard
    raw = bytearray(path.read_bytes())
    raw[12:16] = struct.pack("<I", 1)
    _corrupt_and_check(path, bytes(raw), "itemsize 1")


def test_sha_mismatch(good_shard):
    path, info = good_shard
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # same size, different payload
    path.write_bytes(bytes(raw))
    read_shard(path)  # structurally fine
    with pytest.raises(DataError, match="sha256") as e:
        read_shard(path, verify_sha256=info.sha256)
    assert path.name in str(e.value)


def test_missing_shard(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_shard(tmp_path / "nope.bin")
