"""The losses and metrics of a task: gradients against finite differences, values against hand sums."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from learning.losses import LOSSES, LossError, get_loss
from learning.metrics import METRICS, get_metrics
from learning.model import init_mlp, loss_and_grads


def labels(name: str, rng: np.random.Generator, n: int, outputs: int) -> np.ndarray:
    if name == "cross_entropy":
        return rng.integers(0, outputs, n)
    if name == "bce":
        return rng.integers(0, 2, n)
    return rng.normal(0, 3, n)


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_loss_has_the_gradient_of_its_value(name: str) -> None:
    outputs = 4 if name == "cross_entropy" else 1
    params = {k: v.astype(np.float64) for k, v in init_mlp([5, 7, outputs], seed=2).items()}
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(9, 5)), labels(name, rng, 9, outputs)
    _, grads = loss_and_grads(params, x, y, name)
    eps = 1e-6
    for key, values in params.items():
        for index in list(np.ndindex(values.shape))[:5]:
            bumped = {k: v.copy() for k, v in params.items()}
            bumped[key][index] += eps
            up, _ = loss_and_grads(bumped, x, y, name)
            bumped[key][index] -= 2 * eps
            down, _ = loss_and_grads(bumped, x, y, name)
            assert grads[key][index] == pytest.approx((up - down) / (2 * eps), abs=1e-5), (key, index)


def test_values_are_the_textbook_ones() -> None:
    z, y = np.array([[2.0], [-1.0], [0.5]]), np.array([1.0, 0.0, 3.0])
    assert get_loss("mse").value_and_delta(z, y)[0] == pytest.approx((1 + 1 + 6.25) / 3)
    assert get_loss("mae").value_and_delta(z, y)[0] == pytest.approx((1 + 1 + 2.5) / 3)
    bce = -(np.log(1 / (1 + np.exp(-2.0))) + np.log(1 - 1 / (1 + np.exp(1.0)))) / 2
    assert get_loss("bce").value_and_delta(z[:2], np.array([1, 0]))[0] == pytest.approx(bce)


@settings(max_examples=60, deadline=None)
@given(st.floats(-80, 80), st.integers(0, 1))
def test_binary_cross_entropy_stays_finite_on_large_logits(z: float, y: int) -> None:
    value, delta = get_loss("bce").value_and_delta(np.array([[z]], np.float32), np.array([y]))
    assert np.isfinite(value) and value >= 0 and np.isfinite(delta).all() and abs(delta[0, 0]) <= 1


def test_heads_and_labels_a_loss_does_not_take_are_named() -> None:
    ce, mse = get_loss("cross_entropy"), get_loss("mse")
    assert ce.head_error(1) == "cross_entropy needs 2 or more outputs (one per class), not 1"
    assert mse.head_error(3) == "mse needs 1 output, not 3"
    assert ce.label_error(np.array([0, 3]), 3) == "label 3 (row 1) is not a class of 0..2"
    assert get_loss("bce").label_error(np.array([0.5]), 1) == "label 0.5 (row 0) is not a class of 0..1"
    assert mse.label_error(np.array([1.0, np.nan]), 1) == "a label is NaN or Inf"
    with pytest.raises(LossError, match="unknown loss 'huber'; known: cross_entropy, bce, mse, mae"):
        get_loss("huber")


def test_macro_f1_weighs_every_class_alike() -> None:
    y = np.array([0] * 8 + [1, 2])
    z = np.eye(3)[[0] * 10]  # always class 0: accuracy 0.8, but classes 1 and 2 never found
    assert METRICS["accuracy"].compute(z, y) == pytest.approx(0.8)
    assert METRICS["macro_f1"].compute(z, y) == pytest.approx((2 * 8 / (2 * 8 + 2)) / 3)
    assert METRICS["macro_f1"].compute(np.eye(3)[y], y) == 1.0


def test_scores_put_errors_and_accuracies_on_one_scale() -> None:
    assert METRICS["accuracy"].score(0.9) == 0.9 and METRICS["mse"].score(0.25) == 0.75
    assert METRICS["mae"].better(0.1, 0.2) and METRICS["accuracy"].better(0.9, 0.8)
    with pytest.raises(LossError, match="metric 'accuracy' measures a classification"):
        get_metrics(["accuracy"], classification=False)
    with pytest.raises(LossError, match="unknown metric 'auc'"):
        get_metrics(["auc"], classification=True)
