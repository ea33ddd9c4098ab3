"""A task: what a job trains, in one Python file that every role reads (docs/TASKS.md).

A task file is a Python file that defines ``task = Task(...)``: the model, the loss, the metrics,
and where the data comes from. ``edgeps demo|ps|client|data --task FILE`` load it with
``load_task``; nothing else of edgeps needs to change for a new model or dataset.

The model is one of:

* a ``ModelSpec`` (the built-in MLP, or a convolution before it): the numpy trainer, the TFLite
  exporter and the C SDK all run it, so every device tier can join;
* a function returning a ``tf.keras`` model (called only where it is needed: the server); its layers
  are converted to the built-in model (learning/keras.py says which convert) and its initial
  weights are the job's version 0; the final model is saved as ``.keras`` and ``.tflite``;
* a ``Trainer`` (edge_client/trainer.py) of your own: ``loss_and_grads``, ``predict`` and ``init``,
  run by the Python devices and by the server's evaluation.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.trainer import NumpyTrainer, Trainer
from edgeps.deploy import ModelCard, save_card
from learning.csvdata import CsvData
from learning.data import DataError, Dataset, TargetScale, checked, stratified_split
from learning.keras import quiet_tensorflow
from learning.losses import LOSSES, Loss, LossError, get_loss
from learning.metrics import job_metrics
from learning.model import Params, forward
from learning.spec import ModelSpec


class TaskError(ValueError):
    """A task file that cannot be used; the one-line message names the file (and the layer, column
    or function at fault)."""


#: What a task's data functions return: a Dataset, a CsvData (learning.csvdata.load_csv), or (x, y).
DataLike = Dataset | CsvData | tuple[Any, Any]


def as_dataset(value: DataLike, classification: bool | None, where: str) -> tuple[Dataset, list[str] | None]:
    """(the rows as a checked Dataset, each row's device or None) from what a data function gave;
    ``classification`` as the loss says (None: a trainer's own loss, labels checked as classes)."""
    devices = None
    if isinstance(value, CsvData):
        if classification is True and not value.classes:
            wrong = "the loss needs classes but load_csv read real-valued targets (regression=True)"
            raise TaskError(f"{where}: {wrong}: drop regression=True, or use a regression loss (mse, mae)")
        if classification is False and value.classes:
            wrong = f"the loss is a regression's but load_csv read the labels as {len(value.classes)} classes"
            raise TaskError(f"{where}: {wrong}: pass regression=True to load_csv")
        devices = value.devices
        value = value.data
    if isinstance(value, tuple) and len(value) == 2:
        x, y = np.asarray(value[0]), np.asarray(value[1])
    elif isinstance(value, Dataset):
        x, y = value.x, value.y
    else:
        raise TaskError(f"{where}: returned {type(value).__name__}, not a Dataset, a CsvData or (x, y)")
    if x.ndim > 2:  # images (n, h, w[, c]) are flattened row-major, as a Keras Flatten does
        x = x.reshape(len(x), -1)
    try:
        return checked(x, y, where, classification is not False), devices
    except DataError as exc:
        raise TaskError(str(exc)) from None


@dataclass(frozen=True)
class Task:
    """What a job trains. Every field is described in docs/TASKS.md.

    ``data()`` gives the whole labelled dataset that ``edgeps data`` and ``edgeps demo`` split into a
    held-out set and device shards (by its device column, for a ``load_csv(..., device_column=)``,
    else Dirichlet-non-IID). ``server_data()`` and ``device_data(device_id)``, when given, are what
    ``edgeps ps`` and ``edgeps client`` read without ``--eval-data``/``--data``.
    """

    model: ModelSpec | Trainer | Callable[[], Any] = field(default_factory=ModelSpec)
    loss: str = "cross_entropy"
    metrics: Sequence[str] = ()
    data: Callable[[], DataLike] | None = None
    server_data: Callable[[], DataLike] | None = None
    device_data: Callable[[str], DataLike] | None = None
    classes: int | None = None  # classification: the number of classes (default: the largest label + 1)
    lr: float | None = None  # the devices' learning rate (default: the job's, --lr)
    batch_size: int | None = None  # the devices' batch size (default: the job's, --batch-size)
    name: str = "task"
    standardize: bool = True  # a regression learns (y - mean) / std of data()'s targets; reports are in y's units
    source: Path | None = None  # the task file (set by load_task)

    def __post_init__(self) -> None:  # load_task puts the file's name before these messages
        if isinstance(self.model, Trainer):
            if self.loss != self.model.loss and self.loss != "cross_entropy":
                raise TaskError(f"loss {self.loss!r} differs from the trainer's own {self.model.loss!r}")
            object.__setattr__(self, "loss", self.model.loss)
        elif not isinstance(self.model, ModelSpec) and not callable(self.model):
            raise TaskError("model must be a ModelSpec, a Trainer or a function returning a Keras model")
        try:
            if not isinstance(self.model, Trainer):
                get_loss(self.loss)
            self.metric_names  # noqa: B018  (checked against the loss)
        except LossError as exc:
            raise TaskError(str(exc)) from None
        if self.data is None and self.server_data is None:
            raise TaskError("a task needs data() (or server_data() for the server)")

    def _where(self, what: str) -> str:
        name = str(self.source) if self.source is not None else f"task {self.name!r}"
        return f"{name}: {what}" if what else name

    @property
    def loss_spec(self) -> Loss | None:
        """The built-in loss, or None for a trainer's own."""
        return LOSSES.get(self.loss)

    @property
    def classification(self) -> bool | None:
        """Whether labels are classes (None: a trainer's own loss, either)."""
        spec = self.loss_spec
        return None if spec is None else spec.classification

    @property
    def metric_names(self) -> tuple[str, ...]:
        return job_metrics(self.loss, self.metrics)

    def server_options(self) -> dict[str, Any]:
        """The job options the task fixes (ServerConfig fields)."""
        training = {"lr": self.lr, "batch_size": self.batch_size}
        return {"loss": self.loss, "metrics": ",".join(self.metric_names)} | {
            k: v for k, v in training.items() if v is not None
        }

    # -- data -----------------------------------------------------------------------------------

    def _run(self, function: Callable[..., Any], name: str, *args: Any) -> Any:
        """Call the user's ``function``: its fault, in one line naming the task file and where it failed."""
        try:
            return function(*args)
        except (DataError, TaskError) as exc:
            raise TaskError(f"{self._where(name + '()')}: {exc}") from None
        except Exception as exc:  # the user's code: say where it failed, in one line
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            raise TaskError(
                f"{self._where(name + '()')} failed at {Path(frame.filename).name} line {frame.lineno}: "
                f"{type(exc).__name__}: {exc}"
            ) from None

    def _checked(self, value: DataLike, name: str) -> tuple[Dataset, list[str] | None]:
        """What one of the task's data functions gave, checked."""
        return as_dataset(value, self.classification, self._where(name + "()"))

    @functools.cached_property
    def _data_value(self) -> DataLike:
        """What ``data()`` gives, read once per process (the roles ask for it several times)."""
        assert self.data is not None
        value: DataLike = self._run(self.data, "data")
        return value

    @functools.cached_property
    def _server_value(self) -> DataLike:
        """What ``server_data()`` gives, read once per process."""
        assert self.server_data is not None
        value: DataLike = self._run(self.server_data, "server_data")
        return value

    def _table(self) -> CsvData | None:
        """The job's CSV data (``data()``'s, else ``server_data()``'s), or None where it is no CsvData."""
        value = (
            self._data_value if self.data is not None else self._server_value if self.server_data is not None else None
        )
        return value if isinstance(value, CsvData) else None

    @functools.cached_property
    def target(self) -> TargetScale | None:
        """How a regression's targets are standardised for training (the mean and spread of
        ``data()``'s), or None: a classification, a trainer's own loss, ``standardize=False``, or
        no ``data()`` (every role reads the same task file, so every role finds the same scale)."""
        if not self.standardize or self.classification is not False or self.data is None:
            return None
        return TargetScale.of(self._checked(self._data_value, "data")[0].y)

    def _scaled(self, data: Dataset) -> Dataset:
        return data if self.target is None else self.target.apply(data)

    def dataset(self) -> tuple[Dataset, list[str] | None]:
        """The whole dataset ``data()`` gives (a regression's targets standardised: ``target``), and
        each row's device if it names them."""
        if self.data is None:
            raise TaskError(self._where("no data() to split into device shards"))
        data, devices = self._checked(self._data_value, "data")
        return self._scaled(data), devices

    def holdout(self, seed: int, fraction: float = 0.2) -> Dataset:
        """The server's held-out set: ``server_data()``, else ``fraction`` of ``data()`` (stratified by
        class, or target quintile; the rows ``edgeps data`` holds out with the same seed)."""
        if self.server_data is not None:
            return self._scaled(self._checked(self._server_value, "server_data")[0])
        return stratified_split(self.dataset()[0], fraction, seed)[1]

    def device_dataset(self, device: str) -> Dataset:
        """One gateway's own data, from ``device_data(device)``."""
        return self.device_rows(device)[0]

    def device_rows(self, device: str) -> tuple[Dataset, str | None]:
        """One gateway's own data, from ``device_data(device)``, and for CSV rows the fingerprint of
        their columns, scaling and class names (``CsvData.fingerprint``), which must be the job's ``columns()``."""
        if self.device_data is None:
            raise TaskError(self._where("no device_data(device) to read this device's data from: give --data"))
        value = self._run(self.device_data, "device_data", device)
        data, _ = self._checked(value, "device_data")
        return self._scaled(data), value.fingerprint if isinstance(value, CsvData) else None

    def columns(self) -> str | None:
        """The fingerprint of the job's CSV columns and scaling (``data()``'s, else ``server_data()``'s),
        or None where the data is no CsvData: what a device's own rows are checked against."""
        table = self._table()
        return None if table is None else table.fingerprint

    def outputs(self, data: Dataset) -> int:
        """The model's output width for the task's loss and this data."""
        spec = self.loss_spec
        classes = self.classes if self.classes is not None else int(data.y.max()) + 1
        if spec is None:  # a trainer's own loss: one output per class for class labels, else one
            return classes if data.y.dtype.kind in "iu" else 1
        return spec.outputs(classes) if spec.classification else 1

    # -- model ----------------------------------------------------------------------------------

    @functools.cached_property
    def keras_model(self) -> Any | None:
        """The task's Keras model (built once, when first asked), or None for a ModelSpec or Trainer task."""
        if isinstance(self.model, ModelSpec | Trainer):
            return None
        if hasattr(self.model, "get_weights") and hasattr(self.model, "layers"):
            return self.model  # a Keras model built when the task file was read (TensorFlow in every role)
        try:
            return self.model()
        except Exception as exc:
            raise TaskError(f"{self._where('model()')}: {type(exc).__name__}: {exc}") from None

    def init(self, data: Dataset, seed: int) -> Params:
        """The job's version 0 for data like ``data`` (features, labels); TaskError if the model does
        not fit the data, naming both sizes."""
        features, outputs = data.x.shape[1], self.outputs(data)
        if isinstance(self.model, ModelSpec):
            return self.model.init(features, outputs, seed)
        if isinstance(self.model, Trainer):
            params: Params = self._run(self.model.init, "init", features, outputs, seed)
        else:
            from learning.keras import KerasError, from_keras

            try:
                params = from_keras(self.keras_model, self.loss)
            except KerasError as exc:
                raise TaskError(self._where(str(exc))) from None
        problem = self.trainer().mismatch(params, data.x, data.y)
        if problem is not None:
            raise TaskError(self._where(problem))
        return params

    def trainer(self) -> Trainer:
        """What a device trains with: the task's own trainer, or the numpy reference with its loss."""
        return self.model if isinstance(self.model, Trainer) else NumpyTrainer(self.loss)

    def predict(self, params: Params, x: np.ndarray) -> np.ndarray:
        """The model's raw outputs, for the server's evaluation (a fault of one's own trainer: TaskError)."""
        if isinstance(self.model, Trainer):
            return np.asarray(self._run(self.model.predict, "predict", params, x))
        return forward(params, x)

    def loss_value(self) -> Callable[[Params, np.ndarray, np.ndarray], float] | None:
        """For a trainer's own loss, how the server measures it (its loss_and_grads); else None."""
        if self.loss_spec is not None:
            return None
        trainer = self.trainer()
        return lambda params, x, y: float(self._run(trainer.loss_and_grads, "loss_and_grads", params, x, y)[0])

    def card(self, version: int) -> ModelCard:
        """What a saved model of this task needs beside its tensors to predict from raw readings: the
        loss and metrics, and for CSV data (``data()`` or ``server_data()`` gave a ``CsvData``) the
        label, the feature columns with their scaling and the class names."""
        table = self._table()
        card = ModelCard(
            self.loss, list(self.metric_names), version, self.classification is not False, target=self.target
        )
        if table is not None:
            card = dataclasses.replace(card, label=table.label or None, classes=table.classes, scaling=table.scaling)
        return card

    def save_model(self, params: Params, path: Path, card: ModelCard) -> list[Path]:
        """Save a model in the task's format: ``.npz`` by tensor name and its card (``.json``,
        edgeps/deploy.py), and for a Keras task also the Keras model (``.keras``) and a TFLite
        inference model (``.tflite``) beside it."""
        path = Path(path)
        np.savez(path, **params)  # type: ignore[arg-type]  # numpy's stub types **kwds as bool
        written = [path, save_card(card, path)]
        model = self.keras_model
        if model is not None:
            from learning.keras import save_keras

            written += save_keras(model, params, path.with_suffix(""), self.loss)
        return written


def builtin_task(model: ModelSpec, loss: str = "cross_entropy", metrics: Sequence[str] = ()) -> Task:
    """The built-in job (examples/digits.py) with the flags' model and job options: what ``edgeps ps``
    and ``edgeps demo`` run without ``--task``."""
    from learning.data import load_digits

    return Task(model=model, loss=loss, metrics=tuple(metrics), data=load_digits, name="digits")


def load_task(path: str | Path) -> Task:
    """The ``task`` a task file defines; TaskError in one line naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"{path}: no such task file")
    quiet_tensorflow()  # a Keras task imports TensorFlow
    name = f"edgeps_task_{abs(hash(path.resolve()))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TaskError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except TaskError as exc:
        raise TaskError(f"{path}: {exc}") from None
    except SyntaxError as exc:
        raise TaskError(f"{path} line {exc.lineno}: SyntaxError: {exc.msg}") from None
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path.resolve()]
        line = f" line {frames[-1].lineno}" if frames else ""
        raise TaskError(f"{path}{line}: {type(exc).__name__}: {exc}") from None
    task = getattr(module, "task", None)
    if not isinstance(task, Task):
        raise TaskError(f"{path}: defines no `task = Task(...)` (docs/TASKS.md)")
    object.__setattr__(task, "source", path)
    return task
