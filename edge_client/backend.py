"""Which trainer a device trains with: its own, or the one the server's model artifact brings."""

from __future__ import annotations

import numpy as np

from edge_client.trainer import ArtifactTrainer, NumpyTrainer, Trainer, TrainerError
from learning.data import Dataset
from learning.model import Params
from schemas.artifact import ArtifactError, ArtifactMeta, decode_artifact
from schemas.events import Events


class Backend:
    """The device's trainer (None under the tflite backend until an artifact arrives). With
    ``artifact_trainer`` the device takes the server's model artifact: a verified one replaces the
    trainer; one that fails later (inputs it was not built for) falls back to the device's own."""

    def __init__(self, trainer: Trainer | None, artifact_trainer: ArtifactTrainer | None, events: Events) -> None:
        if trainer is None and artifact_trainer is None:
            raise ValueError("a device needs a trainer, or the server's model artifact")
        self.events = events
        self.trainer = trainer
        self.fallback = trainer  # what to train with if the artifact's trainer fails
        self.artifact_trainer = artifact_trainer
        self.artifact: bytes | None = None  # the verified artifact in use
        self.artifact_error: str | None = None  # why the last artifact was refused, or its trainer failed

    @property
    def name(self) -> str:
        return self.trainer.name if self.trainer is not None else "waiting for model"

    def load_artifact(self, payload: bytes, shapes: dict[str, tuple[int, ...]] | None) -> bool:
        """Verify an artifact (against the model's ``shapes`` when known) and train with its trainer
        from the next step. A tampered or unrunnable one is refused with the reason in
        ``artifact_error``; the current trainer stays."""
        if payload == self.artifact:
            return True
        try:
            if self.artifact_trainer is None:
                raise ArtifactError("this device does not take the server's model artifact")
            meta, flatbuffer = decode_artifact(payload)
            if shapes is not None and shapes != {spec.name: spec.shape for spec in meta.params}:
                raise ArtifactError(f"artifact tensors differ from the job's parameters {shapes}")
            trainer = self.artifact_trainer(meta, flatbuffer)
        except (ArtifactError, TrainerError) as exc:
            self.artifact_error = str(exc)
            self.events.error("refused the model artifact: %s", exc)
            return False
        self.trainer, self.artifact, self.artifact_error = trainer, payload, None
        self.events.info(
            "training with the %s artifact v%d (%s, sha256 %s...)",
            meta.arch,
            meta.version,
            meta.built_with,
            meta.sha256[:12],
        )
        return True

    def use_loss(self, loss: str) -> str | None:
        """Train with the job's ``loss``; why not, in one line (the fallback follows, if it can)."""
        if self.fallback is not None and self.fallback is not self.trainer:
            self.fallback.use_loss(loss)
        return None if self.trainer is None else self.trainer.use_loss(loss)

    def mismatch(self, params: Params, data: Dataset) -> str | None:
        """Why the trainer cannot train ``params`` on ``data``, in one line (None: it can, or no trainer yet)."""
        return None if self.trainer is None else self.trainer.mismatch(params, data.x, data.y)

    def loss_and_grads(self, params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
        """The trainer's loss and gradients; if the artifact's trainer fails, the device's own."""
        assert self.trainer is not None
        try:
            return self.trainer.loss_and_grads(params, x, y)
        except TrainerError as exc:  # e.g. the job's batch size or model is not the artifact's
            if self.fallback is None or self.trainer is self.fallback:
                raise
            self.events.error("the artifact's trainer failed (%s): back to %s", exc, self.fallback.name)
            self.trainer, self.artifact_error = self.fallback, str(exc)
            return self.trainer.loss_and_grads(params, x, y)


def tflite_trainer(meta: ArtifactMeta, flatbuffer: bytes) -> Trainer:
    """The artifact's trainer in a TFLite interpreter (the runtime is imported only here)."""
    from edge_client.tflite import TFLiteTrainer

    return TFLiteTrainer(meta, flatbuffer)


BACKENDS = ("numpy", "tflite", "auto")


def make_trainer(backend: str, loss: str = "cross_entropy") -> tuple[Trainer | None, ArtifactTrainer | None]:
    """(the trainer to start with, how to build one from the server's model artifact, if the
    device takes it) for a backend: ``numpy``: the reference, no artifact; ``tflite``: only the
    artifact's trainer (no training until it arrives); ``auto``: numpy until an artifact arrives
    that this device can run."""
    if backend == "numpy":
        return NumpyTrainer(loss), None
    if backend == "tflite":
        return None, tflite_trainer
    if backend == "auto":
        return NumpyTrainer(loss), tflite_trainer
    raise ValueError(f"unknown trainer backend {backend!r}; known: {list(BACKENDS)}")
