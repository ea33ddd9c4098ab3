"""Turn a dataset into a held-out file for the server and one shard file per device."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from learning.data import Dataset, dirichlet_partition, stratified_split


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
