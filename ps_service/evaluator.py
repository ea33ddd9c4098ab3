"""The task's metrics and loss of the global model on held-out data, and what evaluating costs."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from learning.data import Dataset, TargetScale
from learning.losses import get_loss
from learning.metrics import Metric, get_metrics
from learning.model import Params, forward

MAX_LOSS = 1e30  # the loss (or error) reported for a model whose value is not even finite in double precision

#: The model's raw outputs (n, outputs) for inputs (n, features).
Predict = Callable[[Params, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Evaluation:
    values: dict[str, float]  # metric name -> value, in the task's order (the first is its metric)
    loss: float


class Evaluator:
    """Evaluates parameters on a fixed held-out set, or on a fixed seeded sample of it
    (``sample`` rows) to bound the server's cost: the task's ``metrics`` (the first is the one
    reports and the frequency policies follow) and its ``loss``, on the outputs of ``predict``
    (the numpy reference by default); for a task trainer's own loss, ``loss_value`` measures it.
    With a ``clock`` (the driver's, e.g. ``time.perf_counter``),
    ``seconds`` adds up the time spent; without one it stays 0."""

    def __init__(
        self,
        holdout: Dataset,
        sample: int | None = None,
        seed: int = 0,
        clock: Callable[[], float] | None = None,
        loss: str = "cross_entropy",
        metrics: tuple[str, ...] = ("accuracy",),
        predict: Predict = forward,
        loss_value: Callable[[Params, np.ndarray, np.ndarray], float] | None = None,
        target: TargetScale | None = None,
    ) -> None:
        if len(holdout) == 0:
            raise ValueError("the held-out set is empty")
        if sample is not None and sample < len(holdout):
            rows = np.sort(np.random.default_rng(seed).choice(len(holdout), size=sample, replace=False))
            holdout = holdout.subset(rows)
        self.holdout, self.target = holdout, target
        self.labels = holdout.y if target is None else target.invert(holdout.y)  # in the data's units
        self.loss = None if loss_value is not None else get_loss(loss)
        self.metrics: list[Metric] = get_metrics(metrics, None if self.loss is None else self.loss.classification)
        self.predict, self.loss_value = predict, loss_value
        self.clock = clock
        self.seconds = 0.0
        self.calls = 0
        self.baseline = self._baseline()

    def _baseline(self) -> dict[str, float]:
        """Every metric of a constant predictor on the held-out set: its most common class, or for a
        regression (or a trainer's own loss on real values) its mean: what a model that learned
        nothing scores."""
        y, n = self.labels, len(self.holdout)
        if y.dtype.kind in "iu":
            common = int(np.bincount(y).argmax())
            z = np.zeros((n, max(2, common + 1)), np.float32)
            z[:, common] = 1.0
        else:
            z = np.full((n, 1), float(np.mean(y)), np.float32)
        values = {metric.name: metric.compute(z, y) for metric in self.metrics}
        return {name: v for name, v in values.items() if math.isfinite(v)}

    @property
    def metric(self) -> Metric:
        """The task's metric: the one reports and the frequency policies follow."""
        return self.metrics[0]

    def _measure(self, params: Params, x: np.ndarray) -> tuple[list[float], float]:
        z = self.predict(params, x)
        if self.target is not None:  # a regression trained on standardised targets: judged in the data's units
            z = self.target.invert(z)
        if self.loss_value is not None:
            loss = self.loss_value(params, x, self.labels)
        else:
            assert self.loss is not None
            loss, _ = self.loss.value_and_delta(z, self.labels)
        return [metric.compute(z, self.labels) for metric in self.metrics], loss

    def __call__(self, params: Params) -> Evaluation:
        """The metrics and loss, all finite: where float32 overflows, the evaluation is made again in
        double precision; a value beyond even that is reported as its worst (0 for a metric where
        higher is better, ``MAX_LOSS`` for a loss or an error)."""
        started = self.clock() if self.clock is not None else 0.0
        try:
            with np.errstate(over="ignore", invalid="ignore"):  # a model gone bad is measured below
                values, loss = self._measure(params, self.holdout.x)
            if not all(math.isfinite(v) for v in [*values, loss]):
                wide = {name: v.astype(np.float64) for name, v in params.items()}
                with np.errstate(all="ignore"):
                    values, loss = self._measure(wide, self.holdout.x.astype(np.float64))
            finite = {
                metric.name: v if math.isfinite(v) else (0.0 if metric.higher_is_better else MAX_LOSS)
                for metric, v in zip(self.metrics, values, strict=True)
            }
            return Evaluation(finite, loss if math.isfinite(loss) else MAX_LOSS)
        finally:
            if self.clock is not None:
                self.seconds += self.clock() - started
            self.calls += 1
