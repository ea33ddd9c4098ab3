"""A trained model, loaded to predict: what ``edgeps ps --save-model`` and the demo write, read back.

``--save-model PATH.npz`` writes the final model's tensors (``PATH.npz``), its card (``PATH.json``:
the loss, the metrics, the version, and for CSV data the label column, the feature columns with
their scaling and the class names), and beside them the best version by the job's metric as
``PATH-best.npz`` / ``PATH-best.json``. A Keras task adds ``.keras`` and ``.tflite`` for each.
``load_model`` reads any of them; ``Model.predict`` scales raw readings as training did and runs
the model: the numpy reference, Keras, or a TFLite interpreter (any batch size).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from learning.csvdata import Scaling, read_number, read_table
from learning.data import DataError, TargetScale
from learning.metrics import get_metrics, predicted_classes
from learning.model import Params, forward

CARD_FORMAT = "edgeps-model/1"
ROUTES = ("numpy", "keras", "tflite")


@dataclass(frozen=True)
class ModelCard:
    """What a saved model needs beside its tensors to predict from raw readings."""

    loss: str
    metrics: list[str]
    version: int
    classification: bool
    label: str | None = None  # CSV data: the label column
    classes: list[str] = field(default_factory=list)  # CSV data: each class index's name
    scaling: Scaling | None = None  # CSV data: the feature columns and their scaling
    target: TargetScale | None = None  # a regression: the model's outputs are (y - mean) / std

    def to_json(self) -> dict[str, Any]:
        columns = {} if self.scaling is None else self.scaling.to_json()
        return {
            "format": CARD_FORMAT,
            "loss": self.loss,
            "metrics": self.metrics,
            "version": self.version,
            "classification": self.classification,
            "label": self.label,
            "classes": self.classes,
            "target": None if self.target is None else {"mean": self.target.mean, "std": self.target.std},
            **columns,
        }

    @staticmethod
    def from_json(data: dict[str, Any], where: str) -> ModelCard:
        if not isinstance(data, dict) or data.get("format") != CARD_FORMAT:
            raise DataError(f"{where}: not an edgeps model card ({CARD_FORMAT})")
        try:
            scaling = None if data.get("features") is None else Scaling.from_json(data)
            target = data.get("target")
            return ModelCard(
                str(data["loss"]),
                [str(m) for m in data["metrics"]],
                int(data["version"]),
                bool(data["classification"]),
                data.get("label"),
                [str(c) for c in data.get("classes") or []],
                scaling,
                None if target is None else TargetScale(float(target["mean"]), float(target["std"])),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{where}: model card unreadable ({exc!r})") from None


def save_card(card: ModelCard, path: Path) -> Path:
    """The card beside the model saved at ``path`` (``path`` with ``.json``)."""
    target = Path(path).with_suffix(".json")
    target.write_text(json.dumps(card.to_json(), indent=2) + "\n")
    return target


def best_path(path: Path) -> Path:
    """Where the best version is saved beside the final one at ``path``: ``model.npz`` -> ``model-best.npz``."""
    path = Path(path)
    return path.with_name(f"{path.stem}-best{path.suffix}")


@dataclass
class Model:
    """A saved model and its card; ``route`` says what runs it."""

    card: ModelCard
    route: str
    params: Params | None = None
    runner: Any = None  # a Keras model or a TFLite interpreter

    def scale(self, x: np.ndarray) -> np.ndarray:
        """Raw readings (n, features) as the model was trained on them (no scaling known: as given)."""
        x = np.asarray(x, np.float64)
        return (self.card.scaling.apply(x) if self.card.scaling is not None else x).astype(np.float32)

    def outputs(self, x: np.ndarray) -> np.ndarray:
        """The model's raw outputs (n, outputs) for raw readings ``x`` (n, features)."""
        z = self._run(self.scale(x))
        return z if self.card.target is None else self.card.target.invert(z)  # a regression: in y's units

    def _run(self, inputs: np.ndarray) -> np.ndarray:
        if self.route == "numpy":
            assert self.params is not None
            return forward(self.params, inputs)
        if self.route == "keras":  # rows as the model's input shape takes them (an image: (n, s, s, 1))
            shaped = inputs.reshape(len(inputs), *self.runner.input_shape[1:])
            return np.asarray(self.runner(shaped, training=False))
        interpreter = self.runner  # TFLite: the batch is the input's first dimension
        entry = interpreter.get_input_details()[0]
        shaped = inputs.reshape(len(inputs), *(int(d) for d in entry["shape_signature"][1:]))
        interpreter.resize_tensor_input(entry["index"], list(shaped.shape))
        interpreter.allocate_tensors()
        interpreter.set_tensor(entry["index"], shaped)
        interpreter.invoke()
        return np.asarray(interpreter.get_tensor(interpreter.get_output_details()[0]["index"]))

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Each row's class index (classification) or value (regression)."""
        z = self.outputs(x)
        return predicted_classes(z) if self.card.classification else z.reshape(len(z), -1)[:, 0]

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """The task's metrics on raw readings ``x`` and labels ``y`` (class indices or values)."""
        z = self.outputs(x)
        return {m.name: float(m.compute(z, y)) for m in get_metrics(self.card.metrics, self.card.classification)}

    def read_csv(self, path: str | Path) -> tuple[np.ndarray, np.ndarray | None]:
        """(raw readings in the model's column order, labels or None) of a CSV with a header: columns
        found by name, in any order; DataError in one line naming the file, line and column."""
        if self.card.scaling is None:
            raise DataError(f"{path}: this model was not trained on CSV columns (its card names none)")
        table = read_table(path, self.card.scaling.features)
        x = table.numbers(self.card.scaling.features)
        label = self.card.label
        if label is None or label not in table.header:
            return x, None
        texts = table.texts(label, "label")
        if not self.card.classification:
            return x, np.array(
                [read_number(text, f"{table.path} line {n}, column {label!r}") for n, text in texts], np.float32
            )
        index = {name: i for i, name in enumerate(self.card.classes)}
        for number, text in texts:
            if text not in index:
                raise DataError(
                    f"{table.path} line {number}, column {label!r}: {text!r} is not one of the model's classes"
                )
        return x, np.array([index[text] for _, text in texts], np.int64)


def load_model(path: str | Path, route: str = "numpy") -> Model:
    """The model saved at ``path`` (``model.npz``, or its folder holding ``model.npz``), run by
    ``route``: ``numpy`` (the tensors), ``keras`` (``.keras``) or ``tflite`` (``.tflite``)."""
    if route not in ROUTES:
        raise ValueError(f"route {route!r}: one of {', '.join(ROUTES)}")
    path = Path(path)
    if path.is_dir():
        path = path / "model.npz"
    card_path = path.with_suffix(".json")
    if not card_path.is_file():
        raise DataError(f"{card_path}: no model card (edgeps ps --save-model writes one beside the model)")
    try:
        card = ModelCard.from_json(json.loads(card_path.read_text()), str(card_path))
    except ValueError as exc:
        raise DataError(f"{card_path}: {exc}") from None
    if route == "numpy":
        try:
            with np.load(path.with_suffix(".npz"), allow_pickle=False) as tensors:
                params = {name: tensors[name].astype(np.float32) for name in tensors.files}
        except (OSError, ValueError) as exc:
            raise DataError(f"{path.with_suffix('.npz')}: not a readable model ({exc})") from None
        return Model(card, route, params=params)
    target = path.with_suffix(f".{route}")
    if not target.is_file():
        raise DataError(f"{target}: no such file (a Keras task's --save-model writes .keras and .tflite)")
    if route == "keras":
        from learning.keras import quiet_tensorflow

        quiet_tensorflow()
        import tensorflow as tf

        return Model(card, route, runner=tf.keras.models.load_model(target))
    from edge_client.tflite import interpreter_class

    interpreter = interpreter_class()(model_content=target.read_bytes())
    return Model(card, route, runner=interpreter)
