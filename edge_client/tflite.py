"""The ``tflite`` trainer backend: the server's exported trainer, run by a TFLite interpreter.

Uses ``ai_edge_litert`` (LiteRT, works with numpy 2) or ``tflite_runtime`` (numpy < 2),
whichever imports; neither needs TensorFlow.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_client.trainer import Trainer, TrainerError
from learning.model import Params
from schemas.artifact import ArtifactMeta

__all__ = ["TFLiteTrainer", "TrainerError", "interpreter_class", "runtime_available"]


def interpreter_class() -> Any:
    """The Interpreter class of the TFLite runtime installed here."""
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        try:
            from tflite_runtime.interpreter import Interpreter
        except ImportError:
            raise TrainerError(
                "the tflite backend needs a TFLite runtime: pip install ai-edge-litert "
                "(or tflite-runtime, which needs numpy < 2)"
            ) from None
    return Interpreter


def runtime_available() -> bool:
    try:
        interpreter_class()
    except TrainerError:
        return False
    return True


class TFLiteTrainer(Trainer):
    """Loss and gradients from the artifact's ``loss_and_grads`` signature."""

    name = "tflite"

    def __init__(self, meta: ArtifactMeta, tflite: bytes, threads: int = 1) -> None:
        self.meta = meta
        self.loss = meta.loss
        interpreter = interpreter_class()(model_content=tflite, num_threads=threads)
        self._train = interpreter.get_signature_runner("loss_and_grads")
        self._predict = interpreter.get_signature_runner("predict")
        self._shapes = {spec.name: spec.shape for spec in meta.params}

    def _inputs(self, params: Params) -> dict[str, np.ndarray]:
        shapes = {name: tuple(value.shape) for name, value in params.items()}
        if shapes != self._shapes:
            raise TrainerError(f"parameters {shapes} differ from the artifact's {self._shapes}")
        return {self.meta.input_name(name): np.asarray(value, np.float32) for name, value in params.items()}

    def loss_and_grads(self, params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
        if len(x) != self.meta.batch_size:
            raise TrainerError(f"the artifact trains batches of {self.meta.batch_size} rows, got {len(x)}")
        labels = np.asarray(y, np.int32 if self.meta.loss == "cross_entropy" else np.float32)
        out = self._train(**self._inputs(params), x=np.asarray(x, np.float32), y=labels)
        grads = {name: np.array(out[self.meta.input_name(name)], np.float32) for name in params}
        return float(out["loss"]), grads

    def predict(self, params: Params, x: np.ndarray) -> np.ndarray:
        """The model's raw outputs (logits, or the predicted value) for any number of rows."""
        return np.array(self._predict(**self._inputs(params), x=np.asarray(x, np.float32))["logits"])
