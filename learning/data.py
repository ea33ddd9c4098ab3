"""Datasets, held-out splits and non-IID partitions across devices.

A dataset is a pair of arrays: ``x`` float32 of shape (n, features) and ``y`` of shape (n,):
int64 class labels for classification, float32 targets for a regression.
"""

from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class DataError(ValueError):
    """A file that does not hold the data asked for; the message names the file (and line, column
    or array)."""


@dataclass(frozen=True)
class Dataset:
    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if self.x.ndim != 2 or self.y.ndim != 1 or len(self.x) != len(self.y):
            raise ValueError(f"dataset needs x (n, d) and y (n,), got {self.x.shape} and {self.y.shape}")

    def __len__(self) -> int:
        return len(self.y)

    @property
    def classes(self) -> int:
        return int(self.y.max()) + 1 if len(self.y) else 0

    def subset(self, idx: np.ndarray) -> Dataset:
        return Dataset(self.x[idx], self.y[idx])

    def save(self, path: str | Path) -> None:
        np.savez_compressed(path, x=self.x, y=self.y)

    @staticmethod
    def load(path: str | Path) -> Dataset:
        with np.load(path, allow_pickle=False) as data:
            y = data["y"]
            return Dataset(data["x"].astype(np.float32), y.astype(np.int64 if y.dtype.kind in "iub" else np.float32))


@dataclass(frozen=True)
class TargetScale:
    """A regression's targets as the model learns them: (y - mean) / std, so that one learning rate
    suits targets of any magnitude; ``invert`` takes outputs back to the data's units."""

    mean: float
    std: float

    @staticmethod
    def of(y: np.ndarray) -> TargetScale:
        std = float(np.std(y))
        return TargetScale(float(np.mean(y)), std if std > 0 else 1.0)

    def apply(self, data: Dataset) -> Dataset:
        return Dataset(data.x, ((data.y - self.mean) / self.std).astype(np.float32))

    def invert(self, values: np.ndarray) -> np.ndarray:
        """Outputs (or standardised targets) in the data's units, in their own precision."""
        out: np.ndarray = np.asarray(values) * self.std + self.mean
        return out


def load_npz(path: str | Path, classification: bool | None = True) -> Dataset:
    """A user's ``.npz`` with ``x`` (n, features) numbers and ``y`` (n,) class numbers from 0 (or, not
    ``classification``, real targets; None: as ``y``'s type says), checked (DataError naming the file
    and the array): the arrays are present, shaped and finite, and class numbers integral."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in ("x", "y") if name in data.files}
            names = data.files
    except (OSError, ValueError, EOFError) as exc:
        raise DataError(f"{path}: not a readable .npz ({exc})") from None
    for name in ("x", "y"):
        if name not in arrays:
            raise DataError(f"{path}: no array {name!r} (arrays: {', '.join(names) or 'none'})")
    return checked(arrays["x"], arrays["y"], str(path), classification)


def checked(x: np.ndarray, y: np.ndarray, where: str, classification: bool | None = True) -> Dataset:
    """``x`` (n, features) and ``y`` (n,) as a Dataset, checked (DataError, one line starting with
    ``where``): shaped, numbers, finite, and for ``classification`` (None: as ``y``'s type says) whole
    class numbers from 0; float32 features, int64 classes or float32 targets."""
    if x.ndim != 2 or y.ndim != 1 or len(x) != len(y) or not len(y):
        raise DataError(f"{where}: x must be (n, features) and y (n,) with n > 0, got {x.shape} and {y.shape}")
    if not (np.issubdtype(x.dtype, np.number) and np.issubdtype(y.dtype, np.number)):
        raise DataError(f"{where}: x and y must hold numbers, got {x.dtype} and {y.dtype}")
    bad = np.flatnonzero(~np.isfinite(x).all(axis=1))
    if len(bad):
        raise DataError(f"{where}: x row {bad[0]} holds NaN or Inf ({len(bad)} rows do)")
    bad = np.flatnonzero(~np.isfinite(y))
    if len(bad):
        raise DataError(f"{where}: y[{bad[0]}] is NaN or Inf ({len(bad)} labels are)")
    if classification is None:
        classification = y.dtype.kind in "iub"
    if not classification:
        return Dataset(x.astype(np.float32), y.astype(np.float32))
    wrong = np.flatnonzero((y < 0) | (y != np.round(y)))
    if len(wrong):
        raise DataError(f"{where}: label y[{wrong[0]}] = {y[wrong[0]].item()!r} is not a class number (0, 1, ...)")
    return Dataset(x.astype(np.float32), y.astype(np.int64))


def load_digits() -> Dataset:
    """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes); works offline."""
    from sklearn.datasets import load_digits as sk_digits  # server-side only

    bunch = sk_digits()
    return Dataset((bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64))


_IDX_TYPES: dict[int, type[np.generic] | str] = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (the MNIST format), plain or gzip-compressed."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic {raw[:4].hex()})")
    dtype, ndim = np.dtype(_IDX_TYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    count = int(np.prod(shape, dtype=np.int64))
    if len(raw) - header != count * dtype.itemsize:
        need, have = count * dtype.itemsize, len(raw) - header
        raise ValueError(f"{path}: IDX shape {shape} needs {need} bytes, the file has {have}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write a uint8 array as an IDX file (for tests and conversions)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    Path(path).write_bytes(header + array.tobytes())


def load_idx(images: str | Path, labels: str | Path) -> Dataset:
    """An MNIST-format pair of IDX files: images (n, rows, cols) 0-255 and labels (n,)."""
    x, y = read_idx(images), read_idx(labels)
    if y.ndim != 1 or len(x) != len(y):
        raise ValueError(f"IDX images {x.shape} and labels {y.shape} do not pair up")
    return Dataset((x.reshape(len(x), -1).astype(np.float32) / 255.0), y.astype(np.int64))


def strata(y: np.ndarray) -> np.ndarray:
    """What splits and partitions balance: each row's class, or for real-valued targets (a regression)
    its quintile of the targets."""
    if y.dtype.kind in "iub":
        return y
    return np.searchsorted(np.quantile(y, [0.2, 0.4, 0.6, 0.8]), y, side="right")


def stratified_indices(y: np.ndarray, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, held-out rows), sorted, with ``holdout`` of every class (or target quintile) held out."""
    if not 0 < holdout < 1:
        raise ValueError("holdout must be in (0, 1)")
    y = strata(y)
    rng = np.random.default_rng(seed)
    train_idx, test_idx = [], []
    for label in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == label))
        cut = max(1, round(holdout * len(idx)))
        test_idx.append(idx[:cut])
        train_idx.append(idx[cut:])
    return np.sort(np.concatenate(train_idx)), np.sort(np.concatenate(test_idx))


def stratified_split(data: Dataset, holdout: float, seed: int) -> tuple[Dataset, Dataset]:
    """(train, held-out) with ``holdout`` of every class in the held-out part."""
    train_idx, test_idx = stratified_indices(data.y, holdout, seed)
    return data.subset(train_idx), data.subset(test_idx)


def dirichlet_partition(y: np.ndarray, devices: int, alpha: float, seed: int, min_size: int = 10) -> list[np.ndarray]:
    """Indices of ``y`` split across ``devices`` with class (or target quintile) shares drawn from
    Dirichlet(alpha).

    Small alpha gives each device few classes (non-IID); large alpha approaches IID.
    Every index goes to exactly one device; draws repeat (seeded) until every device
    holds at least ``min_size`` samples.
    """
    if devices < 1 or alpha <= 0:
        raise ValueError("need devices >= 1 and alpha > 0")
    if devices * min_size > len(y):
        raise ValueError(f"{len(y)} samples cannot give {devices} devices {min_size} each")
    rng, y = np.random.default_rng(seed), strata(y)
    for _ in range(1000):
        shards: list[list[int]] = [[] for _ in range(devices)]
        for label in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == label))
            shares = rng.dirichlet(np.full(devices, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
            for shard, part in zip(shards, np.split(idx, cuts), strict=True):
                shard.extend(part.tolist())
        if min(len(s) for s in shards) >= min_size:
            return [np.sort(np.array(s, dtype=np.int64)) for s in shards]
    raise ValueError(f"no Dirichlet({alpha}) draw gave every device {min_size} samples")
