from __future__ import annotations

import gzip

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from learning.data import Dataset, dirichlet_partition, load_digits, load_idx, read_idx, stratified_split, write_idx
from learning.prepare import prepare_shards


def test_digits_load_offline_scaled() -> None:
    d = load_digits()
    assert d.x.shape == (1797, 64) and d.classes == 10
    assert d.x.dtype == np.float32 and d.x.min() >= 0 and d.x.max() <= 1


def test_stratified_split_keeps_every_class_and_every_sample() -> None:
    d = load_digits()
    train, test = stratified_split(d, 0.2, seed=1)
    assert len(train) + len(test) == len(d)
    for label in range(10):
        share = (test.y == label).sum() / (d.y == label).sum()
        assert 0.15 < share < 0.25


@settings(max_examples=30, deadline=None)
@given(devices=st.integers(1, 12), alpha=st.floats(0.05, 100), seed=st.integers(0, 1000))
def test_dirichlet_partition_is_exact_and_seeded(devices, alpha, seed) -> None:
    y = np.repeat(np.arange(10), 40)
    parts = dirichlet_partition(y, devices, alpha, seed, min_size=5)
    joined = np.sort(np.concatenate(parts))
    np.testing.assert_array_equal(joined, np.arange(len(y)))  # each sample exactly once
    assert min(len(p) for p in parts) >= 5
    again = dirichlet_partition(y, devices, alpha, seed, min_size=5)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_small_alpha_is_more_skewed_than_large_alpha() -> None:
    y = np.repeat(np.arange(10), 100)

    def mean_classes(alpha: float) -> float:
        parts = dirichlet_partition(y, 8, alpha, seed=0)
        return float(np.mean([(np.bincount(y[p], minlength=10) > 5).sum() for p in parts]))

    assert mean_classes(0.1) < mean_classes(100.0)


def test_idx_round_trip_plain_and_gzip(tmp_path) -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(20, 4, 5), dtype=np.uint8)
    labels = rng.integers(0, 10, size=20, dtype=np.uint8)
    write_idx(tmp_path / "img.idx", images)
    write_idx(tmp_path / "lab.idx", labels)
    (tmp_path / "img.idx.gz").write_bytes(gzip.compress((tmp_path / "img.idx").read_bytes()))
    np.testing.assert_array_equal(read_idx(tmp_path / "img.idx.gz"), images)
    data = load_idx(tmp_path / "img.idx", tmp_path / "lab.idx")
    assert data.x.shape == (20, 20)
    np.testing.assert_allclose(data.x, images.reshape(20, -1) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(data.y, labels)


def test_idx_defects_are_reported(tmp_path) -> None:
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an IDX"):
        read_idx(tmp_path / "bad")
    write_idx(tmp_path / "img", np.zeros((3, 2, 2)))
    (tmp_path / "short").write_bytes((tmp_path / "img").read_bytes()[:-1])
    with pytest.raises(ValueError, match="needs"):
        read_idx(tmp_path / "short")
    write_idx(tmp_path / "lab", np.zeros(4))
    with pytest.raises(ValueError, match="pair up"):
        load_idx(tmp_path / "img", tmp_path / "lab")


def test_prepare_shards_writes_loadable_files(tmp_path) -> None:
    paths = prepare_shards(load_digits(), tmp_path, devices=4, alpha=0.5, seed=0)
    shards = [Dataset.load(p) for p in paths.devices]
    holdout = Dataset.load(paths.holdout)
    assert sum(len(s) for s in shards) + len(holdout) == 1797


def test_a_users_npz_is_checked_array_by_array(tmp_path) -> None:
    import pytest

    from learning.data import DataError, load_npz

    good = tmp_path / "good.npz"
    np.savez(good, x=np.arange(12, dtype=np.float64).reshape(6, 2), y=np.array([0, 1, 2, 0, 1, 2]))
    data = load_npz(good)
    assert data.x.dtype == np.float32 and data.y.dtype == np.int64 and data.classes == 3
    cases = {
        "no-y": ({"x": np.zeros((3, 2))}, "no array 'y' (arrays: x)"),
        "shape": ({"x": np.zeros(3), "y": np.zeros(3)}, "x must be (n, features) and y (n,)"),
        "nan": ({"x": np.array([[1.0, 2.0], [np.nan, 0.0]]), "y": np.array([0, 1])}, "x row 1 holds NaN or Inf"),
        "negative": ({"x": np.zeros((2, 2)), "y": np.array([0, -1])}, "y[1] = -1 is not a class number"),
        "fraction": ({"x": np.zeros((2, 2)), "y": np.array([0.0, 1.5])}, "y[1] = 1.5 is not a class number"),
        "text": ({"x": np.array([["a", "b"]]), "y": np.array([0])}, "must hold numbers"),
    }
    for name, (arrays, message) in cases.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        with pytest.raises(DataError) as caught:
            load_npz(path)
        assert message in str(caught.value) and str(path) in str(caught.value), name
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match=r"not a readable \.npz"):
        load_npz(tmp_path / "junk.npz")
