"""edgeps: MQTT parameter-server training for fleets of edge devices.

The public API of a task file (docs/TASKS.md): ``Task`` says what a job trains; ``ModelSpec`` is the
built-in model every device tier runs; ``Trainer`` is the interface of a model of your own; the
loaders read CSV, ``.npz`` and MNIST-format files, or the bundled digits; ``load_model`` reads a
trained model back to predict (edgeps/deploy.py).
"""

from edge_client.trainer import Trainer, TrainerError
from edgeps.deploy import Model, load_model
from edgeps.task import Task, TaskError, load_task
from learning.csvdata import CsvData, load_csv
from learning.data import DataError, Dataset, load_digits, load_idx, load_npz
from learning.model import Params
from learning.spec import ModelSpec

__version__ = "0.2.0"

__all__ = [
    "CsvData",
    "DataError",
    "Dataset",
    "Model",
    "ModelSpec",
    "Params",
    "Task",
    "TaskError",
    "Trainer",
    "TrainerError",
    "__version__",
    "load_csv",
    "load_digits",
    "load_idx",
    "load_model",
    "load_npz",
    "load_task",
]
