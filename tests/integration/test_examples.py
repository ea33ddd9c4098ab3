"""The three task files of examples/ (docs/TASKS.md), each run the way a user runs it: one
``edgeps demo --task`` command, short."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def demo(tmp_path: Path, example: str, *flags: str) -> dict:
    out = tmp_path / Path(example).stem
    command = [sys.executable, "-m", "edgeps.cli", "demo", "--task", str(ROOT / "examples" / example),
               "--out", str(out), "--json", str(out / "r.json"), *flags]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "r.json").read_text())


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
        builtin["bytes_up"], builtin["bytes_down"], builtin["commits"]
    )  # fmt: skip
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


def test_the_sensor_regression_trains_python_and_c_devices_together(tmp_path) -> None:
    report = demo(tmp_path, "sensor_regression.py", "--rounds", "30", "--embedded-devices", "2")
    assert report["metric"] == "mae" and not report["higher_is_better"]
    first = report["history"][0]["value"]
    assert report["best"] < 0.3 < first  # kW of mean absolute error: from about 2.6 at version 0
    assert report["device_backends"] == {"c": 2, "numpy": 4}  # one shard per gateway of the CSV
    assert report["rejected"] == 0
