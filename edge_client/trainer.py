"""Trainer backends: the arithmetic of one local step, behind one small interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from learning import model
from learning.model import Params


class Trainer(ABC):
    """Computes loss and gradients for a batch; stateless, parameters passed in.

    Statelessness keeps the device core in charge of its parameters, so any backend
    (numpy, a TFLite interpreter) can be swapped in without changing the training loop.
    """

    name: str

    @abstractmethod
    def loss_and_grads(self, params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
        """Mean loss on (x, y) and its gradient for every parameter."""


class NumpyTrainer(Trainer):
    """The numpy reference MLP (learning.model)."""

    name = "numpy"

    def loss_and_grads(self, params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
        return model.loss_and_grads(params, x, y)


BACKENDS = ("numpy", "tflite", "auto")


def make_trainer(backend: str) -> tuple[Trainer | None, bool]:
    """(the trainer to start with, whether to take the server's model artifact) for a backend:
    ``numpy``: the reference, no artifact; ``tflite``: only the artifact's trainer (no training
    until it arrives); ``auto``: numpy until an artifact arrives that this device can run."""
    if backend == "numpy":
        return NumpyTrainer(), False
    if backend == "tflite":
        return None, True
    if backend == "auto":
        return NumpyTrainer(), True
    raise ValueError(f"unknown trainer backend {backend!r}; known: {list(BACKENDS)}")
