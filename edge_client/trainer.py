"""Trainer backends: the arithmetic of one local step, behind one small interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from learning import model
from learning.losses import LOSSES, get_loss
from learning.model import Params
from schemas.artifact import ArtifactMeta


class TrainerError(RuntimeError):
    """A trainer cannot run: no runtime, or inputs its model was not built for."""


class Trainer(ABC):
    """Computes loss and gradients for a batch, and the model's outputs; stateless, parameters
    passed in (a flat dict of named float32 arrays, the tensors the job aggregates by name).

    Statelessness keeps the device core in charge of its parameters, so any backend (numpy, a
    TFLite interpreter, a task's own trainer) can be swapped in without changing the training
    loop. A task's own trainer (docs/TASKS.md) subclasses this: ``loss_and_grads`` and ``predict``,
    and ``loss``, the name of the loss it computes (the job's Control names it).
    """

    name: str = "custom"
    loss: str = "cross_entropy"  # the loss ``loss_and_grads`` computes

    @abstractmethod
    def loss_and_grads(self, params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
        """Mean loss on (x, y) and its gradient for every parameter."""

    def predict(self, params: Params, x: np.ndarray) -> np.ndarray:
        """The model's raw outputs (n, outputs) for inputs (n, features): what the task's metrics read."""
        raise TrainerError(f"the {self.name} trainer does not predict")

    def init(self, features: int, outputs: int, seed: int) -> Params:
        """The job's version 0 for ``features`` inputs and ``outputs`` outputs (a task's own trainer
        defines it; the server calls it)."""
        raise TrainerError(f"the {self.name} trainer does not make initial parameters")

    def use_loss(self, loss: str) -> str | None:
        """Train with ``loss`` (the job's, from its Control) from now on; why not, in one line, if it cannot."""
        if loss == self.loss:
            return None
        return f"the job trains with loss {loss!r}; this device's {self.name} trainer computes {self.loss!r}"

    def mismatch(self, params: Params, x: np.ndarray, y: np.ndarray) -> str | None:
        """Why the model ``params`` cannot train on data like (x, y), in one line; None if it can."""
        return None


class NumpyTrainer(Trainer):
    """The numpy reference MLP or CNN (learning.model), with any loss of learning.losses."""

    name = "numpy"

    def __init__(self, loss: str = "cross_entropy") -> None:
        self.loss = get_loss(loss).name

    def loss_and_grads(self, params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
        return model.loss_and_grads(params, x, y, self.loss)

    def predict(self, params: Params, x: np.ndarray) -> np.ndarray:
        return model.forward(params, x)

    def use_loss(self, loss: str) -> str | None:
        if loss not in LOSSES:
            return f"the job trains with loss {loss!r}, which the numpy trainer does not know ({', '.join(LOSSES)})"
        self.loss = loss
        return None

    def mismatch(self, params: Params, x: np.ndarray, y: np.ndarray) -> str | None:
        try:
            features, outputs = model.model_features(params, x.shape[1]), model.classes(params)
        except ValueError as exc:
            return f"the job's model does not take this device's {x.shape[1]} features: {exc}"
        except (KeyError, IndexError):
            return "the job's parameters are not a model this trainer knows (an MLP, a CNN or a Conv1D)"
        if x.shape[1] != features:
            return f"the job's model takes {features} features; this device's data has {x.shape[1]}"
        loss = get_loss(self.loss)
        problem = loss.head_error(outputs) or loss.label_error(y, outputs)
        return None if problem is None else f"the job's model ({outputs} outputs, loss {self.loss}): {problem}"


#: Builds the trainer of a verified model artifact (its metadata and flatbuffer); TrainerError
#: when this device cannot run it.
ArtifactTrainer = Callable[[ArtifactMeta, bytes], Trainer]
