"""Accuracy and loss of the global model on held-out data, and what evaluating costs."""

from __future__ import annotations

import time

import numpy as np

from learning.data import Dataset
from learning.model import Params, evaluate


class Evaluator:
    """Evaluates parameters on a fixed held-out set, or on a fixed seeded sample of it
    (``sample`` rows) to bound the server's cost; ``seconds`` adds up the time spent."""

    def __init__(self, holdout: Dataset, sample: int | None = None, seed: int = 0) -> None:
        if len(holdout) == 0:
            raise ValueError("the held-out set is empty")
        if sample is not None and sample < len(holdout):
            rows = np.sort(np.random.default_rng(seed).choice(len(holdout), size=sample, replace=False))
            holdout = holdout.subset(rows)
        self.holdout = holdout
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, params: Params) -> tuple[float, float]:
        """(accuracy, loss)."""
        started = time.perf_counter()
        try:
            return evaluate(params, self.holdout.x, self.holdout.y)
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1
