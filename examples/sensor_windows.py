"""Activities from accelerometer windows: a Keras Conv1D, the usual model for sensor time series.
Each row of the CSV the example writes is one window of 25 readings of 3 axes (x0..x24, y0..y24,
z0..z24 in the file; the model sees them time-major as a (25, 3) window), recorded on one of 8
wearables, each mostly worn for 2 of the 6 activities (non-IID).

    edgeps demo --task examples/sensor_windows.py

trains the Conv1D (8 filters of 5 steps, max pooling by 3, then a Dense head) on numpy devices (`--backend tflite`:
TFLite ones); C devices refuse it with their reason (they run MLPs). The final and best models are
saved as .npz, .keras and .tflite, and `edgeps predict --model edgeps-demo --csv FILE` reads new
windows by column name.
"""

import os
import tempfile
from pathlib import Path

import numpy as np

from edgeps import CsvData, Task, load_csv

STEPS, AXES, ROWS = 25, "xyz", 3000
CSV = Path(os.environ.get("EDGEPS_EXAMPLE_DIR", tempfile.gettempdir())) / "edgeps-sensor-windows.csv"
ACTIVITIES = ["walk", "run", "sit", "stand", "stairs", "cycle"]


def write_windows(path: Path, seed: int = 5) -> None:
    """Seeded windows: each activity its own gravity direction, rhythm and strength, plus noise."""
    rng = np.random.default_rng(seed)
    wearable = rng.integers(0, 8, ROWS)
    usual = np.stack([wearable % 6, (wearable + 1) % 6], 1)[np.arange(ROWS), rng.integers(0, 2, ROWS)]
    activity = np.where(rng.random(ROWS) < 0.85, usual, rng.integers(0, 6, ROWS))
    t = np.arange(STEPS) / 25.0
    rhythm = np.array([0.5, 1.0, 1.6, 2.2, 2.8, 1.3])[activity][:, None]
    strength = np.array([0.2, 0.6, 1.0, 1.2, 0.9, 0.4])[activity][:, None]
    gravity = np.array([[0, 0, 1], [0, 0.3, 0.95], [0.2, 0, 0.98], [0, 0, 1], [0.6, 0, 0.8], [0.9, 0.1, 0.4]])
    phase = rng.uniform(0, 2 * np.pi, (ROWS, 1))
    axes = []
    for a in range(3):
        wave = strength * (1 - 0.3 * a) * np.sin(2 * np.pi * rhythm * t + phase + a)
        axes.append(gravity[activity, a : a + 1] + wave + rng.normal(0, 0.5, (ROWS, STEPS)))
    header = ["wearable", *(f"{axis}{i}" for axis in AXES for i in range(STEPS)), "activity"]
    lines = [",".join(header)]
    for row in range(ROWS):
        readings = (f"{v:.3f}" for axis in axes for v in axis[row])
        lines.append(",".join([f"w{wearable[row]}", *readings, ACTIVITIES[activity[row]]]))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.part")
    partial.write_text("\n".join(lines) + "\n")
    partial.replace(path)  # whole or not at all, whoever else reads it


def windows() -> CsvData:
    write_windows(CSV)  # seeded: the same file every time
    time_major = [f"{axis}{i}" for i in range(STEPS) for axis in AXES]  # x0,y0,z0,x1,...: (25, 3) row-major
    return load_csv(CSV, label="activity", features=time_major, device_column="wearable")


def model():
    import keras

    return keras.Sequential(
        [
            keras.Input((STEPS, len(AXES))),
            keras.layers.Conv1D(8, 5, activation="relu"),
            keras.layers.MaxPooling1D(3),  # 21 positions to 7
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(len(ACTIVITIES), activation="softmax"),
        ]
    )


task = Task(name="sensor-windows", model=model, data=windows)
