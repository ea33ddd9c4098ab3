"""The three task files of examples/ (docs/TASKS.md), each run the way a user runs it: one
``edgeps demo --task`` command, short."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def demo(tmp_path: Path, example: str, *flags: str) -> dict:
    out = tmp_path / Path(example).stem
    command = [
        sys.executable,
        "-m",
        "edgeps.cli",
        "demo",
        "--task",
        str(ROOT / "examples" / example),
        "--out",
        str(out),
        "--json",
        str(out / "r.json"),
        *flags,
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "r.json").read_text())


def predict(tmp_path: Path, *flags: str) -> dict[str, float]:
    """``edgeps predict``'s metrics, as it prints them: ``N rows of F, model version V (route): m 0.1, ...``."""
    command = [sys.executable, "-m", "edgeps.cli", "predict", *flags, "--out", str(tmp_path / "predicted.csv")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    said = result.stderr.strip().splitlines()[-1].split("): ", 1)[1]
    return {name: float(value) for name, value in (part.split() for part in said.split(", "))}


def test_the_digits_task_is_the_built_in_job(tmp_path) -> None:
    """Same data, model, seeds: the same bytes and (to aggregation order) the same accuracy."""
    flags = ("--rounds", "15", "--devices", "4")
    task = demo(tmp_path, "digits.py", *flags)
    out = tmp_path / "builtin"
    command = [sys.executable, "-m", "edgeps.cli", "demo", "--out", str(out), "--json", str(out / "r.json"), *flags]
    subprocess.run(command, capture_output=True, check=True, cwd=tmp_path, timeout=300)
    builtin = json.loads((out / "r.json").read_text())
    assert task["metric"] == "accuracy" and task["metrics"][-1]["values"].keys() == {"accuracy", "macro_f1"}
    assert (task["bytes_up"], task["bytes_down"], task["commits"]) == (
        builtin["bytes_up"],
        builtin["bytes_down"],
        builtin["commits"],
    )
    assert abs(task["best"] - builtin["best"]) < 0.02 and task["best"] > 0.8


def test_the_keras_cnn_trains_and_is_saved_as_keras_and_tflite(tmp_path) -> None:
    pytest.importorskip("tensorflow")
    import keras

    report = demo(tmp_path, "keras_cnn.py", "--rounds", "20", "--devices", "4")
    assert report["metric"] == "accuracy" and report["best"] > 0.8
    out = tmp_path / "keras_cnn"
    model = keras.models.load_model(out / "model.keras")
    with np.load(out / "data" / "holdout.npz") as holdout:
        x, y = holdout["x"], holdout["y"]
    predicted = model.predict(x.reshape(-1, 8, 8, 1), verbose=0).argmax(axis=1)
    assert abs(float((predicted == y).mean()) - report["final"]) < 1e-6  # the model the server measured
    assert (out / "model.tflite").read_bytes()[4:8] == b"TFL3"
    for route in ("numpy", "keras", "tflite"):  # edgeps predict: the whole held-out set as one batch
        for saved, measured in (("model.npz", report["final"]), ("model-best.npz", report["best"])):
            said = predict(
                tmp_path, "--model", str(out / saved), "--data", str(out / "data" / "holdout.npz"), "--route", route
            )
            assert abs(said["accuracy"] - measured) < 0.001, (route, saved, said, measured)


def test_the_sensor_regression_trains_python_and_c_devices_together(tmp_path) -> None:
    report = demo(tmp_path, "sensor_regression.py", "--rounds", "30", "--embedded-devices", "2")
    assert report["metric"] == "mae" and not report["higher_is_better"]
    first = report["history"][0]["value"]
    assert report["best"] < 0.3 < first  # kW of mean absolute error: from about 2.6 at version 0
    assert report["device_backends"] == {"c": 2, "numpy": 4}  # one shard per gateway of the CSV
    assert report["rejected"] == 0
    # the held-out rows as a user's own CSV, its columns in another order: the model scales them itself
    sys.path.insert(0, str(ROOT / "examples"))
    from sensor_regression import CSV

    from learning.csvdata import load_csv
    from learning.data import stratified_indices

    table = load_csv(CSV, label="power_kw", device_column="gateway", regression=True)
    held = stratified_indices(table.data.y, 0.2, 0)[1]
    header, *rows = [line.split(",") for line in CSV.read_text().splitlines()]
    readings = tmp_path / "held-out.csv"
    readings.write_text("\n".join(",".join(reversed(row)) for row in [header, *(rows[i] for i in held)]) + "\n")
    out = tmp_path / "sensor_regression"
    said = predict(tmp_path, "--model", str(out), "--csv", str(readings))
    assert abs(said["mae"] - report["final"]) < 0.001, (said, report["final"])
    assert (
        abs(predict(tmp_path, "--model", str(out / "model-best.npz"), "--csv", str(readings))["mae"] - report["best"])
        < 0.001
    )
    predictions = (tmp_path / "predicted.csv").read_text().splitlines()
    assert predictions[0] == "prediction" and len(predictions) == len(held) + 1


def test_a_trainer_of_ones_own_runs_as_separate_roles_from_the_task_alone(tmp_path, mosquitto) -> None:
    """edgeps ps --task (held-out from the task, its own loss measured by its trainer) and two
    edgeps client --task (each gateway's data from device_data): a softmax regression of the
    user's, in numpy, under a loss name edgeps does not know."""
    task = tmp_path / "own.py"
    task.write_text(
        textwrap.dedent("""
        import numpy as np
        from edgeps import Task, Trainer

        class Softmax(Trainer):
            name, loss = "softmax", "smoothed_ce"

            def init(self, features, outputs, seed):
                return {"w": np.zeros((features, outputs), np.float32), "b": np.zeros(outputs, np.float32)}

            def predict(self, params, x):
                return x @ params["w"] + params["b"]

            def loss_and_grads(self, params, x, y):
                z = self.predict(params, x)
                p = np.exp(z - z.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                target = np.full_like(p, 0.05 / p.shape[1])
                target[np.arange(len(y)), y] += 0.95
                loss = float(-(target * np.log(p + 1e-12)).sum(axis=1).mean())
                g = (p - target) / len(y)
                return loss, {"w": (x.T @ g).astype(np.float32), "b": g.sum(axis=0).astype(np.float32)}

        def blobs(seed):
            rng = np.random.default_rng(seed)
            y = rng.integers(0, 3, 400)
            centers = np.random.default_rng(99).normal(0, 2, (3, 5))
            return (centers[y] + rng.normal(0, 1, (400, 5))).astype(np.float32), y

        task = Task(model=Softmax(), metrics=("accuracy", "macro_f1"), data=lambda: blobs(0),
                    device_data=lambda device: blobs(int(device[-1]) + 1))
        """)
    )
    broker = ["--broker", f"{mosquitto.host}:{mosquitto.port}", "--job", "own"]
    cli = [sys.executable, "-m", "edgeps.cli"]
    report = tmp_path / "report.json"
    server = subprocess.Popen(
        [
            *cli,
            "ps",
            *broker,
            "--task",
            str(task),
            "--rounds",
            "20",
            "--min-devices",
            "2",
            "--report",
            str(report),
            "--save-model",
            str(tmp_path / "own.npz"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    clients = [
        subprocess.Popen(
            [*cli, "client", *broker, "--task", str(task), "--device", f"gw-{i}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        output, _ = server.communicate(timeout=120)
        assert server.returncode == 0, output
        for client in clients:
            assert client.wait(timeout=30) == 0, client.communicate()[0]
    finally:
        for proc in [server, *clients]:
            if proc.poll() is None:
                proc.kill()
    saved = json.loads(report.read_text())
    assert saved["metric"] == "accuracy" and saved["best"] > 0.9 and saved["rounds"] == 20
    assert saved["metrics"][-1]["values"].keys() == {"accuracy", "macro_f1"}
    assert saved["settings"]["server"]["loss"] == "smoothed_ce"
    losses = [m["loss"] for m in saved["metrics"]]
    assert losses[-1] < losses[0]  # the server measured the trainer's own loss, and it fell
    with np.load(tmp_path / "own.npz") as model:
        assert sorted(model.files) == ["b", "w"]


def test_a_device_whose_training_diverges_ends_the_demo_with_its_reason(tmp_path) -> None:
    task = tmp_path / "steep.py"
    task.write_text(
        "import numpy as np\nfrom edgeps import ModelSpec, Task\n"
        "rng = np.random.default_rng(0)\nx = rng.normal(0, 30, (400, 6))\n"
        "task = Task(model=ModelSpec(hidden='16'), loss='mse', lr=5.0, data=lambda: (x, 50 * x.sum(axis=1)))\n"
    )
    command = [
        sys.executable,
        "-m",
        "edgeps.cli",
        "demo",
        "--task",
        str(task),
        "--out",
        str(tmp_path / "out"),
        "--devices",
        "3",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 2
    error = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(error) == 1 and "device dev-0" in error[0] and "local training diverged (loss " in error[0], error
    assert "the job's learning rate 5.0 is too high" in error[0]


def test_a_keras_mlp_runs_on_c_devices_beside_python_ones(tmp_path) -> None:
    """A Keras model of Dense layers converts to the built-in MLP, which the C trainer runs."""
    pytest.importorskip("tensorflow")
    task = tmp_path / "keras_mlp.py"
    task.write_text(
        textwrap.dedent("""
        from edgeps import Task, load_digits

        def model():
            import keras
            return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                     keras.layers.Dense(10, activation="softmax")])

        task = Task(name="keras-mlp", model=model, data=load_digits)
        """)
    )
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "edgeps.cli",
        "demo",
        "--task",
        str(task),
        "--out",
        str(out),
        "--json",
        str(out / "r.json"),
        "--rounds",
        "10",
        "--devices",
        "4",
        "--embedded-devices",
        "2",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "r.json").read_text())
    assert report["device_backends"] == {"c": 2, "numpy": 2} and report["rejected"] == 0 and report["best"] > 0.7


def test_the_sensor_windows_conv1d_trains_and_predicts_on_every_route(tmp_path) -> None:
    """A Keras Conv1D on accelerometer windows: numpy devices train it, and the saved model gives the
    report's accuracy through numpy, Keras and TFLite."""
    pytest.importorskip("tensorflow")
    report = demo(tmp_path, "sensor_windows.py", "--rounds", "40")
    assert report["metric"] == "accuracy" and report["best"] > report["baseline"] + 0.25 and report["rejected"] == 0
    out = tmp_path / "sensor_windows"
    sys.path.insert(0, str(ROOT / "examples"))
    from sensor_windows import CSV, windows

    from learning.data import stratified_indices

    held = stratified_indices(windows().data.y, 0.2, 0)[1]  # the demo's held-out rows, as the user's own CSV
    header, *rows = CSV.read_text().splitlines()
    readings = tmp_path / "held-out-windows.csv"
    readings.write_text("\n".join([header, *(rows[i] for i in held)]) + "\n")
    for route in ("numpy", "keras", "tflite"):
        said = predict(tmp_path, "--model", str(out), "--csv", str(readings), "--route", route)
        assert abs(said["accuracy"] - report["final"]) < 0.001, (route, said, report["final"])


def test_a_gateway_whose_own_csv_means_other_things_says_so_and_does_not_train(tmp_path, mosquitto) -> None:
    """device_data reading a gateway's own file with its own scaling (or columns in another order read
    as they come) would train on rows that mean other things: the device says so in one line."""
    rows = "gateway,temp,hum,label\n" + "".join(
        f"gw-{i % 2},{20 + i % 7},{40 + i % 5},{'ab'[i % 2]}\n" for i in range(60)
    )
    (tmp_path / "fleet.csv").write_text(rows)
    (tmp_path / "gw-1.csv").write_text(
        "hum,temp,label\n" + "".join(f"{41 + i % 3},{21 + i % 4},b\n" for i in range(20))
    )
    task = tmp_path / "own.py"
    task.write_text(
        textwrap.dedent("""
        from pathlib import Path
        from edgeps import ModelSpec, Task, load_csv

        HERE = Path(__file__).parent
        task = Task(model=ModelSpec(hidden="8"),
                    data=lambda: load_csv(HERE / "fleet.csv", "label", device_column="gateway"),
                    device_data=lambda device: load_csv(HERE / f"{device}.csv", "label"))  # its own min and max
        """)
    )
    broker = ["--broker", f"{mosquitto.host}:{mosquitto.port}", "--job", "cols"]
    cli = [sys.executable, "-m", "edgeps.cli"]
    server = subprocess.Popen(
        [*cli, "ps", *broker, "--task", str(task), "--rounds", "1000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = subprocess.run(
            [*cli, "client", *broker, "--task", str(task), "--device", "gw-1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.kill()
    errors = [line for line in client.stderr.splitlines() if " ERROR " in line]
    assert len(errors) >= 1 and "CSV columns, scaling or class names (fingerprint " in errors[0], client.stderr[-2000:]
    assert "load_csv(..., scaling=the job's columns.json)" in errors[0] and "Traceback" not in client.stderr
