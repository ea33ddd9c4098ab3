"""What a job measures on held-out data: a metric of the model's raw outputs and the labels.

A metric knows whether higher is better and its ideal value. ``score`` puts any metric on one
scale for the frequency policies: accuracy-like metrics are their own score (ideal 1); an error
(ideal 0) scores ``1 - error``, so that ``1 - score`` is always the distance left to the ideal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from learning.losses import LOSSES, LossError


def predicted_classes(z: np.ndarray) -> np.ndarray:
    """Class numbers from raw outputs: the largest output, or for one logit, whether it is > 0."""
    return (z[:, 0] > 0).astype(np.int64) if z.shape[1] == 1 else z.argmax(axis=1)


def _accuracy(z: np.ndarray, y: np.ndarray) -> float:
    return float((predicted_classes(z) == y).mean())


def _macro_f1(z: np.ndarray, y: np.ndarray) -> float:
    """The mean over the classes present in labels or predictions of each class's F1."""
    predicted, labels = predicted_classes(z), y.astype(np.int64)
    scores = []
    for c in np.union1d(predicted, labels):
        tp = float(np.sum((predicted == c) & (labels == c)))
        fp, fn = float(np.sum((predicted == c) & (labels != c))), float(np.sum((predicted != c) & (labels == c)))
        scores.append(2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores))


def _mse(z: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((z[:, 0] - y) ** 2))


def _mae(z: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(z[:, 0] - y)))


def _rmse(z: np.ndarray, y: np.ndarray) -> float:
    return float(np.sqrt(_mse(z, y)))


@dataclass(frozen=True)
class Metric:
    name: str
    higher_is_better: bool
    classification: bool  # measures class predictions (else a regression's values)
    describe: str
    compute: Callable[[np.ndarray, np.ndarray], float]

    def score(self, value: float) -> float:
        """The value on the policies' scale: higher is better, 1 is ideal."""
        return value if self.higher_is_better else 1.0 - value

    def better(self, a: float, b: float) -> bool:
        """Whether ``a`` is a better value than ``b``."""
        return a > b if self.higher_is_better else a < b


METRICS: dict[str, Metric] = {
    metric.name: metric
    for metric in (
        Metric("accuracy", True, True, "share of rows whose predicted class is the label", _accuracy),
        Metric("macro_f1", True, True, "mean over classes of F1 (imbalanced classes count equally)", _macro_f1),
        Metric("mse", False, False, "mean squared error of the predicted value", _mse),
        Metric("mae", False, False, "mean absolute error of the predicted value", _mae),
        Metric("rmse", False, False, "root mean squared error of the predicted value", _rmse),
    )
}


def get_metrics(names: list[str] | tuple[str, ...], classification: bool | None) -> list[Metric]:
    """The metrics called ``names``, checked against the loss's kind of labels (None: a task trainer's
    own loss, either kind); LossError otherwise."""
    if not names:
        raise LossError("a task measures at least one metric")
    metrics = []
    for name in names:
        if name not in METRICS:
            raise LossError(f"unknown metric {name!r}; known: {', '.join(METRICS)}")
        metric = METRICS[name]
        if classification is not None and metric.classification != classification:
            kind = "classification" if metric.classification else "regression"
            raise LossError(f"metric {name!r} measures a {kind}, which this task's loss is not")
        metrics.append(metric)
    return metrics


def default_metrics(classification: bool) -> list[str]:
    """The metrics a task measures when it names none."""
    return ["accuracy"] if classification else ["mse", "mae"]


def job_metrics(loss: str, named: Iterable[str] = ()) -> tuple[str, ...]:
    """The metrics a job trained with ``loss`` measures: those ``named``, checked against the loss's kind
    of labels (either kind for a task trainer's own loss), or the loss's default; LossError otherwise."""
    spec = LOSSES.get(loss)
    classification = None if spec is None else spec.classification
    names = tuple(named) or tuple(default_metrics(classification is not False))
    get_metrics(names, classification)
    return names
