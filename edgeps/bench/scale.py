"""``edgeps bench scale``: how the costs grow with the fleet and with the model, in the simulator.

Two sweeps of short bsp jobs (``--rounds`` versions each) on the virtual-time simulator, with the
real server core, codecs and device cores:

* the fleet: 16, 64, 256, 1,024 devices with the demo's model (64-64-10, 4,810 parameters);
* the model: 16 devices with hidden layers (64), (512) and (512, 512): 4,810, 38,410 and
  301,066 parameters.

For each job: virtual seconds per round, bytes per round (both ways, frame payloads as the
server counts them), server CPU seconds per commit (process time spent in the server core, which
runs in this process between the devices' steps; the devices' statuses, their hellos and speed
reports, apart), and one checkpoint of the server's state at the end (the snapshot and its
metrics history): its bytes and the seconds it took to encode and write. A log-log fit of each against the
fleet size (or the parameter count) gives its exponent: 1 is linear growth, 0 flat.

The digits data is tiled (with a little noise) so that every device holds at least 24 samples.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgeps.bench.common import time_calls
from edgeps.tables import Table

FLEETS = (16, 64, 256, 1024)
MODELS = ((64,), (512,), (512, 512))
METRICS = {  # key: (label, unit)
    "round_s": ("virtual time per round", "s"),
    "bytes_per_round": ("bytes per round", "B"),
    "server_cpu_per_commit_s": ("server CPU per commit", "s"),
    "server_cpu_per_device_status_s": ("server CPU per device's statuses", "s"),
    "checkpoint_bytes": ("checkpoint size", "B"),
    "checkpoint_s": ("checkpoint write", "s"),
}


def _data(devices: int, seed: int) -> Any:
    from learning.data import Dataset, load_digits

    digits = load_digits()
    copies = max(1, math.ceil(30 * devices / len(digits)))
    rng = np.random.default_rng(seed)
    x = np.concatenate([digits.x] + [digits.x + rng.normal(0, 0.05, digits.x.shape) for _ in range(copies - 1)])
    return Dataset(x.astype(np.float32), np.tile(digits.y, copies))


def measure(devices: int, hidden: tuple[int, ...], rounds: int, seed: int = 0) -> dict[str, Any]:
    """One bsp job of ``rounds`` versions in the simulator; its costs."""
    from edgeps.scenario import Scenario
    from edgeps.simulator import Simulation, scenario_data
    from ps_service.io.checkpoint import save

    job = {"rounds": rounds, "duration_s": 1e6}  # ServerConfig's fields, nested by the model
    scenario = Scenario.model_validate({"devices": devices, "hidden": hidden, "alpha": 100.0, "seed": seed, **job})
    sim = Simulation(scenario, "bsp", scenario_data(scenario, _data(devices, seed)))
    server = sim.server
    cpu = {"commits": 0.0, "statuses": 0.0}  # the server core's CPU, by what it handled, and nothing else's

    def spent(args: tuple[Any, ...], seconds: float) -> None:
        cpu["commits" if "/grad/" in args[0] else "statuses"] += seconds

    time_calls(server, "on_message", spent)
    wall = time.perf_counter()
    result = sim.run()
    wall = time.perf_counter() - wall
    versions = max(1, server.store.version)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.ckpt"
        started = time.perf_counter()
        checkpoint_bytes = save(server, path, result.run_s, b"k" * 32)
        checkpoint_s = time.perf_counter() - started
    return {
        "devices": devices,
        "hidden": list(hidden),
        "params": int(sum(v.size for v in server.store.params().values())),
        "versions": server.store.version,
        "commits": result.commits,
        "round_s": result.run_s / versions,
        "bytes_per_round": (result.bytes_up + result.bytes_down) / versions,
        "server_cpu_per_commit_s": cpu["commits"] / max(1, result.commits),
        "server_cpu_per_device_status_s": cpu["statuses"] / devices,
        "checkpoint_bytes": checkpoint_bytes,
        "checkpoint_s": checkpoint_s,
        "wall_s": round(wall, 2),
    }


def exponent(xs: list[float], ys: list[float]) -> float | None:
    """The slope of log y against log x (least squares): y ~ x^slope."""
    if len(xs) < 2 or min(ys) <= 0:
        return None
    return round(float(np.polyfit(np.log(xs), np.log(ys), 1)[0]), 2)


def bench_scale(
    fleets: tuple[int, ...] = FLEETS,
    models: tuple[tuple[int, ...], ...] = MODELS,
    rounds: int = 3,
    out: Path | None = None,
    say: Any = print,
) -> dict[str, Any]:
    """Both sweeps, their exponents, and (with ``out``) the log-log plots scale-fleet.png and scale-model.png."""
    import logging

    logging.getLogger("edgeps").setLevel(logging.ERROR)  # round deadlines of the big model are expected here
    fleet_rows, model_rows = [], []
    for devices in fleets:
        say(f"fleet: {devices} devices, model (64) ...", end=" ", flush=True)
        fleet_rows.append(measure(devices, (64,), rounds))
        say(f"{fleet_rows[-1]['wall_s']} s")
    for hidden in models:
        say(f"model: 16 devices, hidden {hidden} ...", end=" ", flush=True)
        model_rows.append(measure(16, hidden, rounds))
        say(f"{model_rows[-1]['params']:,} parameters, {model_rows[-1]['wall_s']} s")
    report = {
        "rounds": rounds,
        "fleet": fleet_rows,
        "model": model_rows,
        "fleet_exponents": {
            k: exponent([r["devices"] for r in fleet_rows], [r[k] for r in fleet_rows]) for k in METRICS
        },
        "model_exponents": {
            k: exponent([r["params"] for r in model_rows], [r[k] for r in model_rows]) for k in METRICS
        },
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        plot_scale(fleet_rows, "devices", "devices (model 4,810 parameters)", out / "scale-fleet.png")
        plot_scale(model_rows, "params", "model parameters (16 devices)", out / "scale-model.png")
    return report


def plot_scale(rows: list[dict[str, Any]], x_key: str, x_label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = math.ceil(len(METRICS) / 2)
    fig, grid = plt.subplots(2, columns, figsize=(4 * columns, 6.4))
    xs = [r[x_key] for r in rows]
    for ax, (key, (label, unit)) in zip(grid.flat, METRICS.items(), strict=False):
        ys = [r[key] for r in rows]
        slope = exponent(xs, ys)
        ax.loglog(xs, ys, "o-")
        if max(ys) < 1.5 * min(ys):  # about flat: a decade around it, not a zoom into float noise
            ax.set_ylim(min(ys) / 3, max(ys) * 3)
        ax.set_title(f"{label}\n(exponent {slope})", fontsize=9)
        ax.set_xlabel(x_label, fontsize=8)
        ax.set_ylabel(unit, fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_scale(report: dict[str, Any]) -> Table:
    table = Table(
        [
            "devices",
            "params",
            "round s",
            "bytes/round",
            "server CPU/commit",
            "per device's statuses",
            "checkpoint",
            "ckpt s",
        ]
    )
    for row in [*report["fleet"], *report["model"]]:
        table.add(
            row["devices"],
            f"{row['params']:,}",
            f"{row['round_s']:.3f}",
            f"{row['bytes_per_round']:,.0f}",
            f"{1e6 * row['server_cpu_per_commit_s']:.0f} us",
            f"{1e6 * row['server_cpu_per_device_status_s']:.0f} us",
            f"{row['checkpoint_bytes']:,} B",
            f"{row['checkpoint_s']:.3f}",
        )
    for sweep in ("fleet", "model"):
        slopes = ", ".join(f"{METRICS[k][0]} {v}" for k, v in report[f"{sweep}_exponents"].items())
        table.after.append(f"exponents against the {sweep}: {slopes}")
    return table
