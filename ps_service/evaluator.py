"""Accuracy and loss of the global model on held-out data, and what evaluating costs."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from learning.data import Dataset
from learning.model import Params, evaluate

MAX_LOSS = 1e30  # the loss reported for a model whose loss is not even finite in double precision


class Evaluator:
    """Evaluates parameters on a fixed held-out set, or on a fixed seeded sample of it
    (``sample`` rows) to bound the server's cost. With a ``clock`` (the driver's, e.g.
    ``time.perf_counter``), ``seconds`` adds up the time spent; without one it stays 0."""

    def __init__(
        self, holdout: Dataset, sample: int | None = None, seed: int = 0, clock: Callable[[], float] | None = None
    ) -> None:
        if len(holdout) == 0:
            raise ValueError("the held-out set is empty")
        if sample is not None and sample < len(holdout):
            rows = np.sort(np.random.default_rng(seed).choice(len(holdout), size=sample, replace=False))
            holdout = holdout.subset(rows)
        self.holdout = holdout
        self.clock = clock
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, params: Params) -> tuple[float, float]:
        """(accuracy, loss), both finite: where float32 overflows, the evaluation is made again in
        double precision, and a loss beyond even that is reported as ``MAX_LOSS``."""
        started = self.clock() if self.clock is not None else 0.0
        try:
            with np.errstate(over="ignore", invalid="ignore"):  # a model gone bad is measured below
                accuracy, loss = evaluate(params, self.holdout.x, self.holdout.y)
            if not (math.isfinite(accuracy) and math.isfinite(loss)):
                wide = {name: values.astype(np.float64) for name, values in params.items()}
                with np.errstate(all="ignore"):
                    accuracy, loss = evaluate(wide, self.holdout.x.astype(np.float64), self.holdout.y)
            return (accuracy if math.isfinite(accuracy) else 0.0), (loss if math.isfinite(loss) else MAX_LOSS)
        finally:
            if self.clock is not None:
                self.seconds += self.clock() - started
            self.calls += 1
