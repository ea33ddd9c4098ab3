"""Accuracy and loss of the global model on held-out data."""

from __future__ import annotations

from learning.data import Dataset
from learning.model import Params, evaluate


class Evaluator:
    """Evaluates parameters on a fixed held-out set."""

    def __init__(self, holdout: Dataset) -> None:
        if len(holdout) == 0:
            raise ValueError("the held-out set is empty")
        self.holdout = holdout

    def __call__(self, params: Params) -> tuple[float, float]:
        """(accuracy, loss)."""
        return evaluate(params, self.holdout.x, self.holdout.y)
