from __future__ import annotations

import numpy as np
import pytest

from learning.model import evaluate, init_mlp, loss_and_grads, mlp_sizes
from tests.helpers import blobs


def conv1d(length: int = 6, kernel: int = 3, channels: int = 2, filters: int = 4, seed: int = 1, pool: int = 1) -> dict:
    """A Conv1D model on (length, channels) windows: its kernel, max pooling over ``pool`` positions,
    then a dense head."""
    rng = np.random.default_rng(seed)
    return {
        "tconv0.w": rng.normal(0, 0.5, (kernel, channels, filters)),
        "tconv0.b": rng.normal(0, 0.1, filters),
        **init_mlp([(length - kernel + 1) // pool * filters, 5, 3], seed=seed),
    }


@pytest.mark.parametrize("model", ["mlp", "conv1d", "conv1d pooled"])
def test_gradients_match_finite_differences(model: str) -> None:
    initial = init_mlp([12, 7, 3], seed=1) if model == "mlp" else conv1d(pool=2 if "pooled" in model else 1)
    params = {k: np.asarray(v, np.float64) for k, v in initial.items()}
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 12)), rng.integers(0, 3, size=6)
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


def test_a_conv1d_runs_each_window_of_time_steps_through_its_kernel() -> None:
    """Position p's output is sum over steps t and channels c of x[p + t, c] * w[t, c, f] + b[f]."""
    from learning.model import forward, model_features

    params = {k: np.asarray(v, np.float64) for k, v in conv1d().items()}
    x = np.random.default_rng(2).normal(size=(3, 12))
    window = x.reshape(3, 6, 2)
    w, b = params["tconv0.w"], params["tconv0.b"]
    conv = np.stack([np.einsum("ntc,tcf->nf", window[:, p : p + 3], w) + b for p in range(4)], axis=1)
    h = np.maximum(conv, 0).reshape(3, -1)  # position-major, filters fastest: Keras's Flatten
    h = np.maximum(h @ params["dense0.w"] + params["dense0.b"], 0) @ params["dense1.w"] + params["dense1.b"]
    np.testing.assert_allclose(forward(params, x), h, atol=1e-12)
    assert model_features(params) == 12


def test_a_pooled_conv1d_keeps_the_largest_of_each_run_of_positions() -> None:
    from learning.model import forward, model_features, pool_size

    params = {k: np.asarray(v, np.float64) for k, v in conv1d(pool=2).items()}
    x = np.random.default_rng(3).normal(size=(3, 12))
    window = x.reshape(3, 6, 2)
    w, b = params["tconv0.w"], params["tconv0.b"]
    conv = np.maximum(np.stack([np.einsum("ntc,tcf->nf", window[:, p : p + 3], w) + b for p in range(4)], axis=1), 0)
    pooled = np.maximum(conv[:, 0::2], conv[:, 1::2]).reshape(3, -1)  # positions (0, 1) and (2, 3)
    h = np.maximum(pooled @ params["dense0.w"] + params["dense0.b"], 0) @ params["dense1.w"] + params["dense1.b"]
    np.testing.assert_allclose(forward(params, x), h, atol=1e-12)
    assert pool_size(params, 12) == 2 and model_features(params, 12) == 12
    with pytest.raises(ValueError, match=r"does not match tconv0\.w on windows of 14 values"):
        model_features(params, 14)  # 5 positions: no pool size gives the 2 dense0.w takes
