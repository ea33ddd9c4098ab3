"""Task files: what every role reads, and the one-line errors a user gets for what does not fit."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edgeps import ModelSpec, Task, TaskError, Trainer, load_task
from learning.model import Params


def write(tmp_path: Path, body: str, name: str = "task.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def edgeps(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "edgeps.cli", *args], capture_output=True, text=True, cwd=cwd)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The error a user sees: exit 2, one line on stderr, no traceback."""
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


CSV = "gateway,temp,hum,label\n" + "".join(f"gw-{i % 3},{i % 7}.5,{i % 5},{i % 2}\n" for i in range(60))


@pytest.mark.parametrize(
    ("csv", "call", "message"),
    [
        (CSV, 'load_csv(CSV, label="klass")', r"data\.csv: no column 'klass' \(columns: gateway, temp, hum, label\)"),
        (
            CSV.replace("3.5,", "warm,", 1),
            'load_csv(CSV, label="label", device_column="gateway")',
            r"data\.csv line \d+, column 'temp': 'warm' is not a number",
        ),
        (
            CSV.replace("3.5,", "nan,", 1),
            'load_csv(CSV, label="label", device_column="gateway")',
            r"data\.csv line \d+, column 'temp': 'nan' is not a finite number",
        ),
        (
            CSV.replace(",1\n", ",7\n", 1),
            'load_csv(CSV, label="label", device_column="gateway", classes=2)',
            r"data\.csv line \d+, column 'label': 7 is outside the 2 classes \(0\.\.1\)",
        ),
        (CSV, 'load_csv(CSV, label="lable")', r"data\.csv: no column 'lable'; did you mean 'label'\?"),
        # a stray label is not silently a class name, nor a regression's target a class
        (
            CSV.replace(",1\n", ",-1\n", 1),
            'load_csv(CSV, label="label", device_column="gateway")',
            r"line \d+, column 'label': label '-1' is not a class number \(0, 1, \.\.\.\); for a real-valued target",
        ),
        (
            CSV.replace(",1\n", ",2.5\n", 1),
            'load_csv(CSV, label="label", device_column="gateway", classes=2)',
            r"line \d+, column 'label': label '2\.5' is not a class number",
        ),
        (
            CSV.replace(",1\n", ",walk\n"),
            'load_csv(CSV, label="label", device_column="gateway")',
            r"line 2, column 'label': label '0' is a number among class names|label 'walk' is a name among",
        ),
        (
            CSV,
            'load_csv(CSV, label="temp", device_column="gateway")',
            r"label '0\.5' is not a class number \(0, 1, \.\.\.\); for a real-valued target pass regression=True",
        ),
        (
            CSV,
            'load_csv(CSV, label="hum", device_column="gateway"), loss="mse"',
            r"data\(\): the loss is a regression's but load_csv read the labels as 5 classes: pass regression=True",
        ),
        (
            CSV,
            'load_csv(CSV, label="hum", device_column="gateway", regression=True)',
            r"data\(\): the loss needs classes but load_csv read real-valued targets",
        ),
    ],
)
def test_bad_data_is_one_line_naming_the_file_line_and_column(tmp_path, csv, call, message) -> None:
    (tmp_path / "data.csv").write_text(csv)
    task = write(
        tmp_path,
        f"""
        from pathlib import Path
        from edgeps import ModelSpec, Task, load_csv
        CSV = Path(__file__).with_name("data.csv")
        task = Task(model=ModelSpec(hidden="8"), data=lambda: {call})
    """,
    )
    line = one_line_error(edgeps("data", "--task", str(task), "--out", str(tmp_path / "shards"), cwd=tmp_path))
    assert line.startswith("20") and " ERROR " in line  # the log's one line
    assert re.search(message, line), line
    assert "task.py: data()" in line


def test_a_model_the_data_does_not_fit_is_refused_before_the_job_naming_both_sizes(tmp_path) -> None:
    task = write(
        tmp_path,
        """
        import numpy as np
        from edgeps import Task, Trainer

        class Linear(Trainer):
            name, loss = "linear", "cross_entropy"
            def init(self, features, outputs, seed):
                return {"dense0.w": np.zeros((5, outputs), np.float32), "dense0.b": np.zeros(outputs, np.float32)}
            def loss_and_grads(self, params, x, y):
                raise NotImplementedError
            def mismatch(self, params, x, y):
                n = params["dense0.w"].shape[0]
                return None if n == x.shape[1] else f"the model takes {n} features, the data has {x.shape[1]}"

        rng = np.random.default_rng(0)
        task = Task(model=Linear(), data=lambda: (rng.random((300, 4)), rng.integers(0, 3, 300)))
    """,
    )
    line = one_line_error(edgeps("demo", "--task", str(task), "--out", str(tmp_path / "out"), cwd=tmp_path))
    assert "task.py: the model takes 5 features, the data has 4 (after" in line


def test_a_keras_layer_that_does_not_convert_is_named_before_anything_starts(tmp_path) -> None:
    pytest.importorskip("tensorflow")
    task = write(
        tmp_path,
        """
        import numpy as np
        from edgeps import Task

        def model():
            import keras
            return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                                     keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(3)])

        rng = np.random.default_rng(0)
        task = Task(model=model, data=lambda: (rng.random((300, 8, 8, 1)), rng.integers(0, 3, 300)))
    """,
    )
    line = one_line_error(edgeps("demo", "--task", str(task), "--out", str(tmp_path / "out"), cwd=tmp_path))
    assert "task.py: layer 'max_pooling2d' (MaxPooling2D) does not convert" in line
    assert not (tmp_path / "out" / "broker").exists()  # refused before a broker started


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("x = (", r"task\.py line 1: SyntaxError"),
        ("import no_such_module_here", r"task\.py line 1: ModuleNotFoundError: No module named 'no_such_module_here'"),
        ("task = 3", r"task\.py: defines no `task = Task\(...\)`"),
        ("from edgeps import Task\ntask = Task(loss='huber', data=list)", r"task\.py: unknown loss 'huber'"),
        (
            "from edgeps import Task\ntask = Task(loss='mse', metrics=('accuracy',), data=list)",
            r"task\.py: metric 'accuracy' measures a classification",
        ),
        ("from edgeps import Task\ntask = Task()", r"task\.py: a task needs data\(\)"),
    ],
)
def test_a_broken_task_file_is_one_line_naming_it(tmp_path, body, message) -> None:
    with pytest.raises(TaskError, match=message):
        load_task(write(tmp_path, body))
    with pytest.raises(TaskError, match=r"missing\.py: no such task file"):
        load_task(tmp_path / "missing.py")


def test_data_functions_are_checked_and_their_faults_named(tmp_path) -> None:
    def broken() -> tuple[np.ndarray, np.ndarray]:
        return np.ones((3, 2)), np.array([0, 1, np.nan])

    task = Task(data=broken, name="t")
    with pytest.raises(TaskError, match=r"task 't': data\(\): y\[2\] is NaN or Inf"):
        task.dataset()
    crashing = Task(data=lambda: 1 / 0, name="t")
    with pytest.raises(TaskError, match=r"data\(\) failed at test_task\.py line \d+: ZeroDivisionError"):
        crashing.dataset()
    labels = Task(data=lambda: (np.ones((3, 2)), np.array([0, 1.5, 1])), name="t")
    with pytest.raises(TaskError, match=r"label y\[1\] = 1\.5 is not a class number"):
        labels.dataset()
    images = Task(data=lambda: (np.ones((4, 3, 3, 1)), np.array([0, 1, 0, 1])))
    assert images.dataset()[0].x.shape == (4, 9)  # images are flattened row by row
    regression = Task(loss="mse", data=lambda: (np.ones((4, 2)), np.array([0.5, 1.5, 2, 3])))
    data, _ = regression.dataset()
    assert data.y.dtype == np.float32 and regression.metric_names == ("mse", "mae")
    assert regression.init(data, 0)["dense1.w"].shape == (64, 1)  # one output for a regression


class Softmax(Trainer):
    """A softmax regression of one's own, as docs/TASKS.md shows it."""

    name, loss = "softmax", "cross_entropy"

    def init(self, features: int, outputs: int, seed: int) -> Params:
        return {"w": np.zeros((features, outputs), np.float32), "b": np.zeros(outputs, np.float32)}

    def predict(self, params: Params, x: np.ndarray) -> np.ndarray:
        return x @ params["w"] + params["b"]

    def loss_and_grads(self, params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
        z = self.predict(params, x)
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
        p[np.arange(len(y)), y] -= 1
        return loss, {"w": (x.T @ p / len(y)).astype(np.float32), "b": (p.mean(axis=0)).astype(np.float32)}


def test_a_trainer_of_ones_own_trains_and_is_what_the_server_measures() -> None:
    rng = np.random.default_rng(0)
    centers = rng.normal(0, 3, (3, 4))
    y = rng.integers(0, 3, 300)
    x = centers[y] + rng.normal(0, 1, (300, 4))
    task = Task(model=Softmax(), data=lambda: (x, y), name="own")
    data, _ = task.dataset()
    params = task.init(data, 0)
    trainer = task.trainer()
    assert trainer is task.model and task.loss == "cross_entropy" and task.predict(params, data.x).shape == (300, 3)
    for _ in range(100):
        _, grads = trainer.loss_and_grads(params, data.x, data.y)
        params = {k: v - 0.5 * grads[k] for k, v in params.items()}
    assert (task.predict(params, data.x).argmax(axis=1) == data.y).mean() > 0.9
    assert ModelSpec().arch == "mlp"


def test_a_trainer_of_ones_own_has_no_tflite_export_and_says_so(tmp_path) -> None:
    task = write(
        tmp_path,
        """
        import numpy as np
        from edgeps import Task, Trainer

        class Own(Trainer):
            name, loss = "own", "cross_entropy"
            def init(self, features, outputs, seed):
                return {"w": np.zeros((features, outputs), np.float32)}
            def predict(self, params, x):
                return x @ params["w"]
            def loss_and_grads(self, params, x, y):
                return 0.0, {"w": np.zeros_like(params["w"])}

        rng = np.random.default_rng(0)
        task = Task(model=Own(), data=lambda: (rng.random((100, 4)), rng.integers(0, 2, 100)))
    """,
    )
    line = one_line_error(edgeps("ps", "--task", str(task), "--export-tflite", "--broker", "127.0.0.1:1", cwd=tmp_path))
    assert "--export-tflite: a task's own trainer has no TFLite export" in line
