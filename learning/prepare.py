"""Turn a dataset into a held-out file for the server and one shard file per device."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from learning.data import Dataset, dirichlet_partition, stratified_indices, stratified_split


@dataclass(frozen=True)
class ShardPaths:
    holdout: Path
    devices: list[Path]


def prepare_shards(data: Dataset, out: Path, devices: int, alpha: float, seed: int, holdout: float = 0.2) -> ShardPaths:
    """Stratified held-out split, then a Dirichlet(alpha) non-IID partition of the rest."""
    out.mkdir(parents=True, exist_ok=True)
    train, test = stratified_split(data, holdout, seed)
    test.save(out / "holdout.npz")
    paths = []
    for i, idx in enumerate(dirichlet_partition(train.y, devices, alpha, seed)):
        path = out / f"device-{i:02d}.npz"
        train.subset(idx).save(path)
        paths.append(path)
    return ShardPaths(out / "holdout.npz", paths)


_DEVICE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a device id (docs/PROTOCOL.md), safe as a file name


def prepare_device_shards(data: Dataset, devices: list[str], out: Path, seed: int, holdout: float = 0.2) -> ShardPaths:
    """Data already split by device (``devices``: each row's): a stratified held-out split of every
    row, then one shard per device of what remains, ``OUT/{device}.npz``, devices in sorted order."""
    if len(devices) != len(data):
        raise ValueError(f"{len(devices)} device names for {len(data)} rows")
    bad = sorted({d for d in devices if not _DEVICE.match(d)})
    if bad:
        raise ValueError(
            f"device names {bad[:3]} are not device ids (1-64 of A-Z a-z 0-9 _ . -, starting alphanumeric)"
        )
    out.mkdir(parents=True, exist_ok=True)
    train_idx, test_idx = stratified_indices(data.y, holdout, seed)
    data.subset(test_idx).save(out / "holdout.npz")
    names = np.array(devices)
    paths = []
    for device in sorted(set(devices)):
        idx = train_idx[names[train_idx] == device]
        if len(idx) == 0:
            raise ValueError(f"device {device!r} has no rows left after the held-out split")
        path = out / f"{device}.npz"
        data.subset(idx).save(path)
        paths.append(path)
    return ShardPaths(out / "holdout.npz", paths)
