"""Image data: fixed splits, the hand-written MNIST/CIFAR/imagefolder readers read back exactly, the
restricted unpickler refuses code, and the loader's batches are a pure function of (seed, step, rank)."""

import gzip
import os
import pickle
import struct
from collections import Counter
from itertools import islice

import numpy as np
import pytest
import torch

from ember.data.images import ImageLoader, describe, is_image_source, load_images
from ember.errors import EmberError


@pytest.fixture
def digits():
    pytest.importorskip("sklearn")
    return load_images("embedded:digits", 0.1, 0.2)


def test_sources_are_recognised():
    assert all(map(is_image_source, ["embedded:digits", "mnist:/d", "cifar10:d", "imagefolder:d"]))
    assert not is_image_source("embedded:tiny") and not is_image_source("file.txt")
    with pytest.raises(EmberError, match="imagefolder:DIR"):
        load_images("svhn:/x", 0.1, 0.1)


def test_digits_splits_fixed_disjoint_and_stratified(digits):
    assert digits.shape == (1, 8, 8) and digits.n_classes == 10 and not digits.natural
    sizes = [len(digits.split(s)[0]) for s in ("train", "val", "test")]
    assert sum(sizes) == 1797 and abs(sizes[1] - 180) <= 10 and abs(sizes[2] - 359) <= 10
    splits = (digits.train, digits.val, digits.test)
    for x, y in splits:
        assert x.dtype == torch.float32 and y.dtype == torch.int64 and 0 <= x.min() and x.max() <= 1
    from sklearn.datasets import load_digits

    data, target = load_digits(return_X_y=True)
    per_class = torch.bincount(torch.from_numpy(target))
    assert torch.equal(torch.bincount(digits.test[1]), (per_class * 0.2).round().long())  # stratified
    rows = Counter(
        (*(r * 16).round().tolist(), int(c)) for x, y in splits for r, c in zip(x.flatten(1), y, strict=True)
    )
    assert rows == Counter(
        (*r, c) for r, c in zip(data.tolist(), target.tolist(), strict=True)
    )  # a labelled partition
    load_images.cache_clear()
    torch.manual_seed(123)  # nothing seed-like moves the split
    again = load_images("embedded:digits", 0.1, 0.2)
    assert again is not digits and torch.equal(again.test[0], digits.test[0])
    with pytest.raises(EmberError):
        digits.split("holdout")


def test_mean_std_from_train_only(digits):
    x = digits.train[0].double()
    assert digits.mean == pytest.approx([x.mean().item()])
    assert digits.std == pytest.approx([x.std(correction=0).item()])
    assert digits.mean != pytest.approx([torch.cat([x, digits.test[0].double()]).mean().item()], abs=1e-9)


def test_describe_shows_class_counts(digits):
    text = describe(digits)
    counts = torch.bincount(digits.test[1], minlength=10).tolist()
    assert "embedded:digits" in text and "mean" in text
    test_row = next(line for line in text.splitlines() if line.startswith("test"))
    assert [int(n) for n in test_row.split()[-10:]] == counts


def _idx(path, array, gz):
    data = struct.pack(">BBBB", 0, 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data += array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if gz else data)


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_read_back(tmp_path, gz):
    raw = tmp_path / "MNIST" / "raw" if gz else tmp_path
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (12, 28, 28)), np.arange(12) % 10
    tx, ty = rng.integers(0, 256, (5, 28, 28)), np.arange(5)
    suffix = ".gz" if gz else ""
    for name, arr in [("train-images-idx3-ubyte", x), ("train-labels-idx1-ubyte", y),
                      ("t10k-images-idx3-ubyte", tx), ("t10k-labels-idx1-ubyte", ty)]:  # fmt: skip
        _idx(raw / (name + suffix), arr, gz)
    s = load_images(f"mnist:{tmp_path}", 0.0, 0.5)  # test_fraction unused: the official test set
    assert s.shape == (1, 28, 28) and len(s.train[0]) == 12 and len(s.val[0]) == 0
    assert torch.equal((s.test[0][:, 0] * 255).round().long(), torch.from_numpy(tx))
    assert torch.equal(s.test[1], torch.from_numpy(ty))
    (raw / f"t10k-labels-idx1-ubyte{suffix}").write_bytes(b"\0\0\x08\x03junk")
    load_images.cache_clear()
    with pytest.raises(EmberError, match="t10k-labels"):
        load_images(f"mnist:{tmp_path}", 0.0, 0.1)


def test_missing_files_say_what_to_put_where(tmp_path):
    with pytest.raises(EmberError, match="train-images-idx3-ubyte.*MNIST/raw.*does not exist"):
        load_images(f"mnist:{tmp_path / 'nope'}", 0.1, 0.0)
    with pytest.raises(EmberError, match="data_batch_1..5.bin, test_batch.bin"):
        load_images(f"cifar10:{tmp_path}", 0.1, 0.0)
    with pytest.raises(EmberError, match="DIR/<class>"):
        load_images(f"imagefolder:{tmp_path}", 0.1, 0.0)


def _cifar_batches(rng):
    return [(rng.integers(0, 256, (3, 3072)), rng.integers(0, 10, 3)) for _ in range(6)]


def test_cifar_binary_and_python_read_back(tmp_path):
    rng = np.random.default_rng(0)
    batches = _cifar_batches(rng)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    binary, python = tmp_path / "b" / "cifar-10-batches-bin", tmp_path / "p" / "cifar-10-batches-py"
    binary.mkdir(parents=True), python.mkdir(parents=True)
    for name, (x, y) in zip(names, batches, strict=True):
        (binary / f"{name}.bin").write_bytes(np.concatenate([y[:, None], x], 1).astype(np.uint8).tobytes())
        with open(python / name, "wb") as f:
            pickle.dump({b"data": x.astype(np.uint8), b"labels": y.tolist()}, f)
    with open(python / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, f)
    want = torch.from_numpy(batches[5][0].reshape(3, 3, 32, 32))
    for root, first in ((tmp_path / "b", "airplane"), (tmp_path / "p", "c0")):
        s = load_images(f"cifar10:{root}", 0.0, 0.0)
        assert s.shape == (3, 32, 32) and s.natural and s.classes[0] == first and len(s.train[0]) == 15
        assert torch.equal((s.test[0] * 255).round().long(), want)
        assert torch.equal(s.test[1], torch.from_numpy(batches[5][1]))
    (binary / "test_batch.bin").write_bytes(bytes([10]) + bytes(3072))  # label 10 of 10 classes
    with pytest.raises(EmberError, match="labels must be 0..9"):
        load_images(f"cifar10:{tmp_path / 'b'}", 0.1, 0.0)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_pickle_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (tmp_path / name).write_bytes(pickle.dumps({b"data": _Evil(marker), b"labels": [0]}))
    with pytest.raises(EmberError, match="refusing to unpickle"):
        load_images(f"cifar10:{tmp_path}", 0.1, 0.0)
    assert not marker.exists()


def test_imagefolder(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    pixels = {}
    for c in ("cat", "dog"):
        (tmp_path / c).mkdir()
        for i in range(5):
            pixels[c, i] = rng.integers(0, 256, (6, 4, 3), dtype=np.uint8)
            Image.fromarray(pixels[c, i]).save(tmp_path / c / f"{i}.png")
    s = load_images(f"imagefolder:{tmp_path}", 0.2, 0.2)
    assert s.classes == ["cat", "dog"] and s.shape == (3, 6, 4) and s.natural
    assert [len(s.split(n)[1]) for n in ("train", "val", "test")] == [6, 2, 2]
    got = {tuple(x.flatten().tolist()) for x in (torch.cat([s.train[0], s.val[0], s.test[0]]) * 255).round()}
    assert got == {tuple(p.transpose(2, 0, 1).flatten().tolist()) for p in pixels.values()}
    Image.fromarray(np.zeros((5, 4, 3), np.uint8)).save(tmp_path / "dog" / "odd.png")
    load_images.cache_clear()  # memoised by spec: the folder changed under it
    with pytest.raises(EmberError, match="odd.png"):
        load_images(f"imagefolder:{tmp_path}", 0.2, 0.2)


def _loader(n=10, rows=4, **kw):
    x = torch.arange(n * 64, dtype=torch.float32).reshape(n, 1, 8, 8) / (n * 64)
    args = dict(global_rows=rows, seed=3, rank=0, world=1, augment=False, flip=False, device="cpu") | kw
    return ImageLoader(x, torch.arange(n), **args)


@pytest.mark.parametrize("augment", [False, True])
def test_loader_resume_and_ranks_match_one_process(augment):
    one = _loader(augment=augment, flip=augment)
    first = next(one.iterate())
    assert first[0] == 0 and first[1].shape == (4, 1, 8, 8) and first[2].dtype == torch.int64
    batches = dict((s, (x, y)) for s, x, y in islice(one.iterate(), 7))
    step, x, y = next(_loader(augment=augment, flip=augment).iterate(5))  # resumed after 5 steps
    assert step == 5 and torch.equal(x, batches[5][0]) and torch.equal(y, batches[5][1])
    ranks = [_loader(augment=augment, flip=augment, rank=r, world=2).batch(6) for r in (0, 1)]
    assert torch.equal(torch.cat([r[0] for r in ranks]), batches[6][0])
    assert torch.equal(torch.cat([r[1] for r in ranks]), batches[6][1])
    with pytest.raises(EmberError, match="divisible"):
        _loader(rows=5, world=2)


def test_epochs_cover_every_image_once():
    loader = _loader(n=10, rows=5)
    labels = torch.cat([y for _, _, y in islice(loader.iterate(), 6)])  # 3 epochs of 10
    for epoch in labels.split(10):
        assert sorted(epoch.tolist()) == list(range(10))
    assert not torch.equal(labels[:10], labels[10:20])  # reshuffled each epoch


def test_augmentation_shifts_and_flips_only_when_asked():
    plain, shifted, flipped = (_loader(n=64, rows=64, augment=a, flip=f).batch(0) for a, f in
                               [(False, False), (True, False), (True, True)])  # fmt: skip
    assert torch.equal(plain[1], shifted[1]) and torch.equal(plain[1], flipped[1])
    assert shifted[0].shape == plain[0].shape and not torch.equal(shifted[0], plain[0])

    # the row-major ramp increases along each row; flipped rows decrease, shifted-only rows never do
    def decreasing(x):
        d = x[:, 0, 3, 2:6].diff(dim=-1)
        return ((d < 0) & (x[:, 0, 3, 2:6] > 0).all(-1, keepdim=True)).all(-1)

    assert not decreasing(shifted[0]).any() and decreasing(flipped[0]).any()
