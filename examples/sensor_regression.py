"""A regression on sensor readings: predict a building's power draw (kW) from temperature,
humidity, the hour and the people counted, recorded by 6 gateways. The example writes its own CSV
(seeded, no download) and reads it as a user reads theirs: one row per reading, a header line, a
column naming the gateway, so each gateway trains on its own rows.

    edgeps demo --task examples/sensor_regression.py --embedded-devices 2

trains the built-in MLP with mean squared error on Python and C devices together (the last 2
gateways run edgeps-device, the C SDK's); the report follows mean absolute error, in kW.
"""

import os
import tempfile
from pathlib import Path

import numpy as np

from edgeps import CsvData, ModelSpec, Task, load_csv

GATEWAYS, ROWS = 6, 3000
CSV = Path(os.environ.get("EDGEPS_EXAMPLE_DIR", tempfile.gettempdir())) / "edgeps-sensor-readings.csv"


def write_readings(path: Path, seed: int = 7) -> None:
    """Readings of ``GATEWAYS`` buildings, each with its own base load and climate."""
    rng = np.random.default_rng(seed)
    gateway = rng.integers(0, GATEWAYS, ROWS)
    hour = rng.integers(0, 24, ROWS)
    temperature = 12 + 4 * gateway / GATEWAYS + 8 * np.sin((hour - 9) / 24 * 2 * np.pi) + rng.normal(0, 2, ROWS)
    humidity = np.clip(60 - 1.5 * (temperature - 18) + rng.normal(0, 8, ROWS), 10, 100)
    people = rng.poisson(np.where((hour >= 8) & (hour <= 18), 12, 2))
    power = 0.8 + 0.09 * np.abs(temperature - 20) + 0.004 * humidity + 0.07 * people + rng.normal(0, 0.1, ROWS)
    lines = ["gateway,hour,temperature_c,humidity_pct,people,power_kw"]
    rows = zip(gateway, hour, temperature, humidity, people, power, strict=True)
    lines += [f"gw-{g:02d},{h},{t:.2f},{u:.1f},{p},{w:.3f}" for g, h, t, u, p, w in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.part")
    partial.write_text("\n".join(lines) + "\n")
    partial.replace(path)  # whole or not at all, whoever else reads it


def readings() -> CsvData:
    write_readings(CSV)  # seeded: the same file every time
    return load_csv(CSV, label="power_kw", device_column="gateway", regression=True)


task = Task(
    name="sensor-regression",
    model=ModelSpec(hidden="32"),  # the built-in MLP: the numpy, TFLite and C trainers all run it
    loss="mse",
    metrics=("mae", "rmse"),
    data=readings,
)
