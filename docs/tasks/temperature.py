"""A temperature (about 20, spread 3.9) from 8 sensor columns of very different scales, one model
for 8 gateways: a user's regression (kept out of examples/). `edgeps bench tasks --task
docs/tasks/temperature.py` measures it."""

import numpy as np

from edgeps import ModelSpec, Task


def readings():
    rng = np.random.default_rng(3)
    n = 3000
    x = rng.normal(0, 1, (n, 8)) * [3, 10, 50, 1, 2, 5, 0.5, 20] + [20, 50, 1000, 0, 5, 10, 1, 100]
    z = (x - x.mean(0)) / x.std(0)
    y = 20 + 3 * z[:, 0] + 2 * np.tanh(z[:, 1] * z[:, 2]) + 1.5 * z[:, 3] ** 2 - z[:, 4] + rng.normal(0, 0.5, n)
    x = (x - x.min(0)) / (x.max(0) - x.min(0))
    return x.astype(np.float32), y.astype(np.float32)


task = Task(name="temperature", model=ModelSpec(hidden="32"), loss="mse", metrics=("rmse", "mae"), data=readings)
