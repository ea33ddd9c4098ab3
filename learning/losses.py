"""The losses a job trains with, each on the model's raw outputs ``z`` (n, outputs).

The loss decides the model's head and what its labels are:

* ``cross_entropy``: softmax over ``outputs`` >= 2 classes; labels are class numbers 0..outputs-1;
* ``bce`` (binary cross-entropy): one output, a logit (sigmoid applied by the loss); labels 0 or 1;
* ``mse``, ``mae`` (mean squared / absolute error): one output, the predicted value; targets are
  real numbers.

Every function is pure numpy; the gradient is of the batch's mean loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


class LossError(ValueError):
    """A loss that is not known, or a model head or label that does not fit it."""


@dataclass(frozen=True)
class Loss:
    """A loss: its mean value and gradient on the outputs, and what it asks of model and labels."""

    name: str
    classification: bool  # labels are class numbers (else real-valued targets)
    describe: str
    value_and_delta: Callable[[np.ndarray, np.ndarray], tuple[float, np.ndarray]]

    def outputs(self, classes: int) -> int:
        """The model's output width for labels with ``classes`` classes (classification), or 1."""
        return max(classes, 2) if self.name == "cross_entropy" else 1

    def head_error(self, outputs: int) -> str | None:
        """Why a model with ``outputs`` outputs cannot train with this loss (None: it can)."""
        if self.name == "cross_entropy":
            return None if outputs >= 2 else f"cross_entropy needs 2 or more outputs (one per class), not {outputs}"
        return None if outputs == 1 else f"{self.name} needs 1 output, not {outputs}"

    def label_error(self, y: np.ndarray, outputs: int) -> str | None:
        """Why labels ``y`` do not fit this loss on a model of ``outputs`` outputs (None: they do)."""
        if not len(y):
            return None
        if not np.isfinite(y).all():
            return "a label is NaN or Inf"
        if not self.classification:
            return None
        top = 1 if self.name == "bce" else outputs - 1
        bad = np.flatnonzero((y < 0) | (y > top) | (y != np.round(y)))
        if len(bad):
            return f"label {y[bad[0]].item()!r} (row {bad[0]}) is not a class of 0..{top}"
        return None


# The ufuncs' own reductions (np.maximum.reduce for .max, np.add.reduce for .sum and .mean): the
# same arithmetic without numpy's Python wrappers, which cost a device a third of its step.
def _log_softmax(z: np.ndarray) -> np.ndarray:
    shifted = z - np.maximum.reduce(z, axis=1, keepdims=True)
    out: np.ndarray = shifted - np.log(np.add.reduce(np.exp(shifted), axis=1, keepdims=True))
    return out


def _cross_entropy(z: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    n, rows, labels = len(y), np.arange(len(y)), y.astype(np.int64, copy=False)
    logp = _log_softmax(z)
    delta = np.exp(logp)
    delta[rows, labels] -= 1.0
    return float(-(np.add.reduce(logp[rows, labels]) / n)), delta / n


def _bce(z: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    logit, target = z[:, 0], y.astype(z.dtype)
    # log(1 + e^-|z|) + max(z, 0) - z y: the stable form of -[y log s(z) + (1-y) log(1-s(z))]
    loss = np.logaddexp(0.0, -np.abs(logit)) + np.maximum(logit, 0.0) - logit * target
    prob = 0.5 * (1.0 + np.tanh(0.5 * logit))  # the sigmoid, without overflow
    return float(loss.mean()), ((prob - target) / len(y))[:, None].astype(z.dtype)


def _mse(z: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    error = z[:, 0] - y.astype(z.dtype)
    return float((error * error).mean()), (2.0 * error / len(y))[:, None].astype(z.dtype)


def _mae(z: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    error = z[:, 0] - y.astype(z.dtype)
    return float(np.abs(error).mean()), (np.sign(error) / len(y))[:, None].astype(z.dtype)


LOSSES: dict[str, Loss] = {
    loss.name: loss
    for loss in (
        Loss("cross_entropy", True, "softmax cross-entropy over the classes (classification)", _cross_entropy),
        Loss("bce", True, "binary cross-entropy on one logit (two classes, labels 0 and 1)", _bce),
        Loss("mse", False, "mean squared error of one predicted value (regression)", _mse),
        Loss("mae", False, "mean absolute error of one predicted value (regression)", _mae),
    )
}


def get_loss(name: str) -> Loss:
    """The loss called ``name``; LossError naming the known ones otherwise."""
    try:
        return LOSSES[name]
    except KeyError:
        raise LossError(f"unknown loss {name!r}; known: {', '.join(LOSSES)}") from None
