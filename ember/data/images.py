"""Image-classification data: fixed train/val/test splits of small image sets, and a batch loader.

    ember data stats embedded:digits        # describe(load_images("embedded:digits", 0.1, 0.1))

Sources: ``embedded:digits`` (scikit-learn's bundled 1797 8×8 digits, no network), ``mnist:DIR``
(the four idx files, plain or .gz, in DIR or DIR/MNIST/raw), ``cifar10:DIR`` (the binary or the
python version) and ``imagefolder:DIR`` (DIR/<class>/*.png, or DIR/{train,val,test}/<class>/...).

Design choices:

- The readers are written by hand: torchvision's wheel here is a CUDA build that does not import
  against the CPU torch, and each format is a few lines. CIFAR's python pickles go through a
  restricted unpickler that only rebuilds numpy arrays: ember never unpickles arbitrary objects.
- Splits are fixed, not drawn from the run's seed, so every seed of a sweep is tested on the same
  images: stratified (each class split in proportion) with ``torch.Generator().manual_seed(0)``.
  An official test set (MNIST, CIFAR-10, imagefolder's test/) is used as is; ``test_fraction`` is
  then unused and val is ``val_fraction`` of the official train set.
- The loader follows DESIGN rule 3, a batch is a pure function of (seed, step, rank): global batch
  ``s`` is positions ``s*G .. s*G+G-1`` of an endless run of epochs, epoch ``e`` a permutation from
  ``np.random.default_rng([seed, 0, e])``; augmentations are drawn for the whole global batch from
  ``np.random.default_rng([seed, 1, s])`` and then sliced, so 2 ranks see what 1 process sees.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import itertools
import pickle
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ember.config import DataConfig, load_config
from ember.data.sources import is_image_source
from ember.errors import DataError

FORMS = ("embedded:digits", "mnist:DIR", "cifar10:DIR", "imagefolder:DIR")
VISION = "pip install 'ember[vision]'"
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

Pair = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class ImageSplits:
    """Images float32 (N, C, H, W) in [0, 1] and labels int64 (N,) per split; mean/std from train."""

    train: Pair
    val: Pair
    test: Pair
    classes: list[str]
    mean: list[float]
    std: list[float]
    source: str
    natural: bool  # natural images: a horizontal flip is a valid augmentation (not for digits)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.train[0].shape[1:])

    @property
    def n_classes(self) -> int:
        return len(self.classes)

    def split(self, name: str) -> Pair:
        if name not in ("train", "val", "test"):
            raise DataError(f"unknown image split {name!r}; choose train, val or test")
        return getattr(self, name)


# ---- splitting -------------------------------------------------------------------------------


def _split(x: Tensor, y: Tensor, fractions: list[float]) -> list[Pair]:
    """Stratified fixed split: each class's images, permuted by a seed-0 generator, give
    round(n_c * f) to each fraction in turn and the rest to the last part (the first part returned)."""
    g = torch.Generator().manual_seed(0)
    parts: list[list[Tensor]] = [[] for _ in range(len(fractions) + 1)]
    for c in torch.unique(y).tolist():
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        start = 0
        for i, f in enumerate(fractions):
            n = round(len(idx) * f)
            parts[i + 1].append(idx[start : start + n])
            start += n
        parts[0].append(idx[start:])
    out = []
    for chosen in parts:
        idx = torch.sort(torch.cat(chosen)).values if chosen else torch.zeros(0, dtype=torch.int64)
        out.append((x[idx], y[idx]))
    return out


def _splits(
    source: str,
    train: Pair,
    test: Pair | None,
    val: Pair | None,
    fractions: tuple[float, float],
    classes: list[str],
    natural: bool,
) -> ImageSplits:
    val_fraction, test_fraction = fractions
    for name, pair in (("train", train), ("test", test), ("val", val)):
        y = pair[1] if pair is not None else torch.zeros(0)
        if len(y) and not 0 <= int(y.min()) <= int(y.max()) < len(classes):
            raise DataError(f"{source}: {name} labels must be 0..{len(classes) - 1}; fetch the data again")
    if test is None:
        train, val, test = _split(*train, [val_fraction, test_fraction])
    elif val is None:
        train, val = _split(*train, [val_fraction])
    if len(train[0]) == 0:
        raise DataError(f"{source}: the train split is empty; lower data.val_fraction/test_fraction")
    dims = (0, 2, 3)
    mean = train[0].double().mean(dim=dims)
    std = train[0].double().std(dim=dims, correction=0)
    return ImageSplits(train, val, test, classes, mean.tolist(), std.tolist(), source, natural)


# ---- readers -----------------------------------------------------------------------------------


def _to_pair(images: np.ndarray, labels: np.ndarray) -> Pair:
    x = torch.from_numpy(np.array(images, dtype=np.float32)) / 255.0  # a copy: buffers are read-only
    return x, torch.from_numpy(np.asarray(labels, dtype=np.int64))


def _digits() -> tuple[Pair, list[str]]:
    """scikit-learn's bundled digits: its ``datasets/data/digits.csv.gz`` (a row per image, 64
    pixels of 0..16 then the label) read directly where it is there, as ``load_digits`` reads it:
    importing scikit-learn costs 1.5 s of every process that trains on digits; else ``load_digits``."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise DataError(f"embedded:digits needs scikit-learn: {VISION}")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        rows = np.loadtxt(path, delimiter=",", dtype=np.float32)  # (1797, 65)
        pixels, target = rows[:, :-1], rows[:, -1]
    else:  # (a scikit-learn that keeps it elsewhere)
        from sklearn.datasets import load_digits

        d = load_digits()
        pixels, target = d.data.astype(np.float32), d.target
    x = torch.from_numpy(pixels / 16.0).view(-1, 1, 8, 8)  # (1797, 1, 8, 8)
    return (x, torch.from_numpy(target.astype(np.int64))), [str(i) for i in range(10)]


def _missing(form: str, names: str, root: Path, where: str, fetch: str) -> DataError:
    found = "does not exist" if not root.is_dir() else "lacks some of them"
    return DataError(f"{form} reads {names} from {where}; {root} {found}; {fetch} and put them there")


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read {path}: {e}; download it again") from e
    if len(data) < 4 or data[:3] != b"\0\0\x08" or data[3] != ndim:
        raise DataError(
            f"{path} is not an idx file of {ndim}-d unsigned bytes (bad magic); download it again"
        )
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = data[4 + 4 * ndim :]
    if len(body) != int(np.prod(dims)):
        raise DataError(f"{path}: header says {dims} but holds {len(body)} bytes; download it again")
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


def _mnist(root: Path) -> tuple[Pair, Pair]:
    paths = []
    for name in MNIST_FILES:
        candidates = [d / (name + s) for d in (root, root / "MNIST" / "raw") for s in ("", ".gz")]
        found = [p for p in candidates if p.is_file()]
        if not found:
            names = ", ".join(f"{n}[.gz]" for n in MNIST_FILES)
            raise _missing(
                "mnist:DIR", names, root, "DIR or DIR/MNIST/raw", "download them from the MNIST site"
            )
        paths.append(found[0])
    pairs = []
    for images, labels in (paths[:2], paths[2:]):
        x, y = _read_idx(images, 3), _read_idx(labels, 1)
        if len(x) != len(y):
            raise DataError(f"{images} has {len(x)} images but {labels} {len(y)} labels; download them again")
        pairs.append(_to_pair(x[:, None], y))
    return pairs[0], pairs[1]


class _ArraysOnly(pickle.Unpickler):
    """Rebuilds numpy arrays and nothing else (CIFAR's batches are dicts of arrays and lists)."""

    _reconstruct = np.zeros(0).__reduce__()[0]  # numpy 1's core or numpy 2's _core, whichever runs
    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise DataError(f"refusing to unpickle {module}.{name}: CIFAR batches hold only numpy arrays")
        return self.ALLOWED[(module, name)]


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            d = _ArraysOnly(f, encoding="bytes").load()
    except DataError as e:
        raise DataError(f"{path}: {e}; download the CIFAR-10 python version again") from None
    except Exception as e:  # a truncated or foreign pickle
        raise DataError(f"cannot read {path} as a CIFAR-10 batch ({e}); download it again") from e
    if not isinstance(d, dict):
        raise DataError(f"{path} is not a CIFAR-10 batch (no dict); download it again")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in d.items()}


def _cifar_py(folder: Path, name: str) -> Pair:
    d = _unpickle(folder / name)
    data, labels = d.get("data"), d.get("labels")
    if not isinstance(data, np.ndarray) or data.ndim != 2 or data.shape[1] != 3072 or labels is None:
        raise DataError(f"{folder / name} lacks 'data' (N, 3072) uint8 and 'labels'; download it again")
    return _to_pair(data.astype(np.uint8).reshape(-1, 3, 32, 32), np.asarray(labels))


def _cifar_bin(path: Path) -> Pair:
    raw = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    if len(raw) == 0 or len(raw) % 3073:
        raise DataError(f"{path} is not a whole number of 3073-byte CIFAR-10 records; download it again")
    records = raw.reshape(-1, 3073)
    return _to_pair(records[:, 1:].reshape(-1, 3, 32, 32), records[:, 0])


def _cifar10(root: Path) -> tuple[Pair, Pair, list[str]]:
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    binary = [
        d for d in (root / "cifar-10-batches-bin", root) if all((d / f"{n}.bin").is_file() for n in names)
    ]
    python = [d for d in (root / "cifar-10-batches-py", root) if all((d / n).is_file() for n in names)]
    if binary:
        pairs = [_cifar_bin(binary[0] / f"{n}.bin") for n in names]
        meta = binary[0] / "batches.meta.txt"
        classes = [s.strip() for s in meta.read_text().splitlines() if s.strip()] if meta.is_file() else []
    elif python:
        pairs = [_cifar_py(python[0], n) for n in names]
        meta = _unpickle(python[0] / "batches.meta") if (python[0] / "batches.meta").is_file() else {}
        classes = [c.decode() if isinstance(c, bytes) else str(c) for c in meta.get("label_names", [])]
    else:
        raise _missing(
            "cifar10:DIR",
            "data_batch_1..5.bin, test_batch.bin (binary) or data_batch_1..5, test_batch (python)",
            root,
            "DIR, DIR/cifar-10-batches-bin or DIR/cifar-10-batches-py",
            "download CIFAR-10 and unpack it",
        )
    classes = classes or CIFAR_CLASSES
    train = torch.cat([p[0] for p in pairs[:5]]), torch.cat([p[1] for p in pairs[:5]])
    return train, pairs[5], classes


def _class_files(folder: Path) -> dict[str, list[Path]]:
    classes = sorted(p for p in folder.iterdir() if p.is_dir())
    files = {c.name: sorted(f for f in c.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES) for c in classes}
    if not any(files.values()):
        raise DataError(f"{folder} has no <class>/*.png|jpg|... images; imagefolder:DIR reads DIR/<class>/")
    return files


def _imagefolder(root: Path) -> tuple[dict[str, Pair], list[str]]:
    try:
        from PIL import Image
    except ImportError as e:
        raise DataError(f"imagefolder:DIR needs Pillow: {VISION}") from e
    if not root.is_dir():
        raise DataError(f"imagefolder:DIR reads DIR/<class>/*.png|jpg|... ; {root} does not exist")
    split = (root / "train").is_dir() and (root / "test").is_dir()
    parts = [p for p in ("train", "val", "test") if (root / p).is_dir()] if split else ["all"]
    layout = {p: _class_files(root / p if split else root) for p in parts}
    classes = sorted(layout[parts[0]])
    for part, found in layout.items():
        if set(found) - set(classes):
            raise DataError(
                f"{root / part} has classes {sorted(set(found) - set(classes))} that train/ lacks; "
                f"add them to train/ or remove them"
            )
    files = [(f, classes.index(c)) for part in layout.values() for c, fs in part.items() for f in fs]
    heads = []
    for f, _ in files:  # headers only: size and mode, before decoding anything
        try:
            with Image.open(f) as im:
                heads.append((im.size, im.mode))
        except OSError as e:
            raise DataError(f"cannot read image {f}: {e}; remove or replace it") from e
    for (size, _), (f, _) in zip(heads, files, strict=True):
        if size != heads[0][0]:
            raise DataError(
                f"{f} is {size[0]}×{size[1]} but {files[0][0]} is {heads[0][0][0]}×{heads[0][0][1]}; "
                f"imagefolder needs one size: resize the images"
            )
    mode = "L" if all(m in ("1", "L", "LA") for _, m in heads) else "RGB"
    out, start = {}, 0
    for part, found in layout.items():
        n = sum(len(fs) for fs in found.values())
        arrays = []
        for f, _ in files[start : start + n]:
            with Image.open(f) as im:
                arrays.append(np.asarray(im.convert(mode)))
        x = np.stack(arrays)  # (n, H, W) or (n, H, W, 3)
        labels = np.array([label for _, label in files[start : start + n]])
        out[part] = _to_pair(x[:, None] if mode == "L" else x.transpose(0, 3, 1, 2), labels)
        start += n
    return out, classes


@functools.lru_cache(maxsize=4)
def load_images(spec: str, val_fraction: float, test_fraction: float) -> ImageSplits:
    """The fixed splits of an image source (memoised: the trainer asks more than once)."""
    if not (0 <= val_fraction and 0 <= test_fraction and val_fraction + test_fraction < 1):
        raise DataError(
            f"val_fraction {val_fraction} and test_fraction {test_fraction} must be >= 0, sum < 1"
        )
    prefix, _, rest = spec.partition(":")
    fractions = (val_fraction, test_fraction)
    if spec == "embedded:digits":
        train, classes = _digits()
        return _splits(spec, train, None, None, fractions, classes, natural=False)
    if prefix in ("mnist", "cifar10", "imagefolder") and rest:
        root = Path(rest).expanduser()
        if prefix == "mnist":
            train, test = _mnist(root)
            return _splits(spec, train, test, None, fractions, [str(i) for i in range(10)], natural=False)
        if prefix == "cifar10":
            train, test, classes = _cifar10(root)
            return _splits(spec, train, test, None, fractions, classes, natural=True)
        parts, classes = _imagefolder(root)
        train = parts.get("train", parts.get("all"))
        return _splits(spec, train, parts.get("test"), parts.get("val"), fractions, classes, natural=True)
    raise DataError(f"unknown image source {spec!r}; use one of: {', '.join(FORMS)}")


# ---- loader ------------------------------------------------------------------------------------


class ImageLoader:
    """``iterate(start_step)`` yields ``(step, x, y)`` for step = start_step, start_step + 1, ...
    (as ``TrainLoader``: the batch of step s is the one the trainer uses after s finished steps);
    x (G/world, C, H, W) float32 and y (G/world,) int64 on ``device``."""

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        global_rows: int,
        seed: int,
        rank: int,
        world: int,
        augment: bool,
        flip: bool,
        device: str | torch.device = "cpu",
    ):
        if global_rows < 1 or global_rows % world or not 0 <= rank < world:
            raise DataError(
                f"the image batch of {global_rows} rows must be >= 1 and divisible by "
                f"world size {world} (rank {rank}); set the batch to a multiple of {world}"
            )
        if len(images) == 0 or len(images) != len(labels):
            raise DataError(
                f"ImageLoader needs as many labels as images (>= 1), got {len(images)}, {len(labels)}"
            )
        self.images, self.labels, self.global_rows, self.seed = images, labels, global_rows, seed
        local = global_rows // world
        self.rows = slice(rank * local, (rank + 1) * local)
        self.augment, self.flip, self.device = augment, flip, torch.device(device)
        self.pad = max(1, images.shape[2] // 8)
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch spans at most two epochs
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, 0, epoch]).permutation(len(self.images))
        return self._perms[epoch]

    def indices(self, step: int) -> np.ndarray:
        """This rank's image indices at ``step``."""
        epochs, pos = np.divmod(
            step * self.global_rows + np.arange(self.global_rows)[self.rows], len(self.images)
        )
        return np.concatenate([self._perm(e)[pos[epochs == e]] for e in np.unique(epochs).tolist()])

    def _augment(self, x: Tensor, step: int) -> Tensor:
        """Random shift by up to ``pad`` pixels (zero fill), then maybe a horizontal flip, in one gather."""
        rng = np.random.default_rng([self.seed, 1, step])
        shift = torch.from_numpy(rng.integers(-self.pad, self.pad + 1, size=(self.global_rows, 2))[self.rows])
        flip = torch.from_numpy(rng.random(self.global_rows)[self.rows] < 0.5) & self.flip
        B, C, H, W = x.shape
        p = self.pad
        padded = torch.nn.functional.pad(x, (p, p, p, p))  # (B, C, H+2p, W+2p)
        cols = torch.arange(W).expand(B, W)
        cols = torch.where(flip[:, None], W - 1 - cols, cols)
        ys = p + shift[:, :1] + torch.arange(H)  # (B, H)
        xs = p + shift[:, 1:] + cols  # (B, W)
        out = padded[torch.arange(B)[:, None, None], :, ys[:, :, None], xs[:, None, :]]  # (B, H, W, C)
        return out.permute(0, 3, 1, 2).contiguous()

    def batch(self, step: int) -> Pair:
        idx = torch.from_numpy(self.indices(step))
        x, y = self.images[idx], self.labels[idx]
        if self.augment:
            x = self._augment(x, step)
        return x.to(self.device), y.to(self.device)

    def iterate(self, start_step: int = 0) -> Iterator[tuple[int, Tensor, Tensor]]:
        for step in itertools.count(start_step):
            yield (step, *self.batch(step))

    def close(self) -> None:
        """Nothing to stop: batches are gathered in the calling thread."""


# ---- the Day-2 check ---------------------------------------------------------------------------


def describe_target(target: str) -> str | None:
    """What ``ember data stats TARGET`` prints of images: ``describe`` of TARGET, an image source,
    or of the one a config (a preset's name, a .yaml) reads; None for anything else (a data dir)."""
    data = DataConfig(sources=[target])
    if not is_image_source(target):
        if Path(target).is_dir() or not (target.endswith((".yaml", ".yml")) or "/" not in target):
            return None
        data = load_config(target, []).data
    if not is_image_source(data.sources[0]):
        return None
    return describe(load_images(data.sources[0], data.val_fraction, data.test_fraction))


def describe(splits: ImageSplits) -> str:
    """Per split: count, shape, dtype, value range and count per class; then train's mean/std."""
    C, H, W = splits.shape
    widths = [max(len(c), 6) for c in splits.classes]
    head = f"{'split':<6} {'count':>7} {'shape':<18} {'dtype':<8} {'min':>6} {'max':>6}  "
    lines = [
        f"{splits.source}: {splits.n_classes} classes, images {C}×{H}×{W}",
        head + " ".join(f"{c:>{w}}" for c, w in zip(splits.classes, widths, strict=True)),
    ]
    for name in ("train", "val", "test"):
        x, y = splits.split(name)
        counts = torch.bincount(y, minlength=splits.n_classes).tolist()
        lo, hi = (f"{x.min():.3f}", f"{x.max():.3f}") if len(x) else ("-", "-")
        dtype = str(x.dtype).removeprefix("torch.")
        row = f"{name:<6} {len(x):>7} {str(tuple(x.shape)):<18} {dtype:<8} {lo:>6} {hi:>6}  "
        lines.append(row + " ".join(f"{n:>{w}}" for n, w in zip(counts, widths, strict=True)))
    mean = ", ".join(f"{m:.4f}" for m in splits.mean)
    std = ", ".join(f"{s:.4f}" for s in splits.std)
    lines.append(f"train per-channel mean [{mean}]  std [{std}]")
    return "\n".join(lines)
