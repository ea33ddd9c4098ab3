from __future__ import annotations

import numpy as np
import pytest

from learning.model import evaluate, init_mlp, loss_and_grads, mlp_sizes
from tests.helpers import blobs


def test_gradients_match_finite_differences() -> None:
    params = {k: v.astype(np.float64) for k, v in init_mlp([5, 7, 3], seed=1).items()}
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 5)), rng.integers(0, 3, size=6)
    _, grads = loss_and_grads(params, x, y)
    eps = 1e-6
    for name, values in params.items():
        for index in list(np.ndindex(values.shape))[:6]:
            bumped = {k: v.copy() for k, v in params.items()}
            bumped[name][index] += eps
            up, _ = loss_and_grads(bumped, x, y)
            bumped[name][index] -= 2 * eps
            down, _ = loss_and_grads(bumped, x, y)
            assert grads[name][index] == pytest.approx((up - down) / (2 * eps), abs=1e-5)


def test_sgd_learns_blobs() -> None:
    data = blobs()
    params = init_mlp([8, 16, 3], seed=0)
    before = evaluate(params, data.x, data.y)[0]["accuracy"]
    for _ in range(200):
        _, grads = loss_and_grads(params, data.x, data.y)
        for k in params:
            params[k] -= 0.1 * grads[k]
    after = evaluate(params, data.x, data.y)[0]["accuracy"]
    assert after > 0.95 > before


def test_sizes_are_inferred_and_checked() -> None:
    params = init_mlp([64, 32, 10], seed=0)
    assert mlp_sizes(params) == [64, 32, 10]
    params["dense1.w"] = np.zeros((31, 10), np.float32)
    with pytest.raises(ValueError, match="does not match"):
        mlp_sizes(params)
