"""Trainer backends: the arithmetic of one local step, behind one small interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from learning import model
from learning.model import Params
from schemas.artifact import ArtifactMeta


class TrainerError(RuntimeError):
    """A trainer cannot run: no runtime, or inputs its model was not built for."""


class Trainer(ABC):
    """Computes loss and gradients for a batch; stateless, parameters passed in.

    Statelessness keeps the device core in charge of its parameters, so any backend
    (numpy, a TFLite interpreter) can be swapped in without changing the training loop.
    """

    name: str

    @abstractmethod
    def loss_and_grads(self, params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
        """Mean loss on (x, y) and its gradient for every parameter."""

    def mismatch(self, params: Params, x: np.ndarray, y: np.ndarray) -> str | None:
        """Why the model ``params`` cannot train on data like (x, y), in one line; None if it can."""
        return None


class NumpyTrainer(Trainer):
    """The numpy reference MLP (learning.model)."""

    name = "numpy"

    def loss_and_grads(self, params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
        return model.loss_and_grads(params, x, y)

    def mismatch(self, params: Params, x: np.ndarray, y: np.ndarray) -> str | None:
        try:
            features, outputs = model.model_features(params), model.classes(params)
        except (KeyError, ValueError, IndexError):
            return "the job's parameters are not a model this trainer knows (an MLP or CNN)"
        top = int(y.max()) if len(y) else -1
        if x.shape[1] != features or top >= outputs:
            return (f"the job's model takes {features} features and {outputs} classes; this device's data has "
                    f"{x.shape[1]} features and labels up to {top}")  # fmt: skip
        return None


#: Builds the trainer of a verified model artifact (its metadata and flatbuffer); TrainerError
#: when this device cannot run it.
ArtifactTrainer = Callable[[ArtifactMeta, bytes], Trainer]


def tflite_trainer(meta: ArtifactMeta, flatbuffer: bytes) -> Trainer:
    """The artifact's trainer in a TFLite interpreter (the runtime is imported only here)."""
    from edge_client.tflite import TFLiteTrainer

    return TFLiteTrainer(meta, flatbuffer)


BACKENDS = ("numpy", "tflite", "auto")


def make_trainer(backend: str) -> tuple[Trainer | None, ArtifactTrainer | None]:
    """(the trainer to start with, how to build one from the server's model artifact, if the
    device takes it) for a backend: ``numpy``: the reference, no artifact; ``tflite``: only the
    artifact's trainer (no training until it arrives); ``auto``: numpy until an artifact arrives
    that this device can run."""
    if backend == "numpy":
        return NumpyTrainer(), None
    if backend == "tflite":
        return None, tflite_trainer
    if backend == "auto":
        return NumpyTrainer(), tflite_trainer
    raise ValueError(f"unknown trainer backend {backend!r}; known: {list(BACKENDS)}")
