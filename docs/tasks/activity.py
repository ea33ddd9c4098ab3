"""6 activities from 3-axis accelerometer windows (25 samples an axis), 8 wearables, each mostly 2
activities (85 % of its rows): non-IID. A user's task, as docs/TASKS.md alone tells how to write it
(kept out of examples/): `edgeps bench tasks --task docs/tasks/activity.py` measures it."""

import os
import tempfile
from pathlib import Path

import numpy as np

from edgeps import ModelSpec, Task, load_csv

CSV = Path(os.environ.get("EDGEPS_EXAMPLE_DIR", tempfile.gettempdir())) / "edgeps-activity-windows.csv"
N, T = 4800, 25


def write(path: Path) -> None:
    """Seeded windows: each activity its own gravity direction, frequency and amplitude, with noise."""
    rng = np.random.default_rng(11)
    device = rng.integers(0, 8, N)
    main = np.stack([device % 6, (device + 1) % 6], 1)[np.arange(N), rng.integers(0, 2, N)]
    y = np.where(rng.random(N) < 0.85, main, rng.integers(0, 6, N))
    t = np.arange(T) / 25.0
    freq = np.array([0.5, 1.0, 1.6, 2.2, 2.8, 1.3])[y][:, None]
    amp = np.array([0.2, 0.6, 1.0, 1.2, 0.9, 0.4])[y][:, None]
    grav = np.array([[0, 0, 1], [0, 0.3, 0.95], [0.2, 0, 0.98], [0, 0, 1], [0.6, 0, 0.8], [0.9, 0.1, 0.4]])[y]
    phase = rng.uniform(0, 2 * np.pi, (N, 1))
    axes = []
    for a in range(3):
        w = amp * (1 - 0.3 * a) * np.sin(2 * np.pi * freq * (1 + 0.15 * rng.normal(size=(N, 1))) * t + phase + a)
        axes.append(grav[:, a : a + 1] + w + rng.normal(0, 0.8, (N, T)) + 0.15 * rng.normal(size=(N, 1)))
    x = np.concatenate(axes, 1)
    names = ["walk", "run", "sit", "stand", "stairs", "cycle"]
    header = ["wearable", *[f"{ax}{i}" for ax in "xyz" for i in range(T)], "activity"]
    lines = [",".join(header)] + [
        ",".join([f"w{d}", *(f"{v:.3f}" for v in row), names[c]]) for d, row, c in zip(device, x, y, strict=True)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.part")
    partial.write_text("\n".join(lines) + "\n")
    partial.replace(path)  # whole or not at all, whoever else reads it


def windows():
    write(CSV)  # seeded: the same file every time
    return load_csv(CSV, label="activity", device_column="wearable")


task = Task(name="activity", model=ModelSpec(hidden="64"), data=windows)
