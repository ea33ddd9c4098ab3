"""``edgeps bench tasks``: each task trained by ``edgeps demo`` with its default options, against a
centralised model of the same architecture trained on the union of the devices' data.

The centralised reference: the task's model and loss (the numpy reference trainer, which the
devices run too) trained by minibatch SGD (the job's batch size) on every training row of the demo's
split, at the job's learning rate and at a quarter of it, evaluated on the same held-out rows after
every epoch until 40 epochs bring nothing better (400 at most); its best value is the reference.
The federated runs are ``edgeps demo --task FILE`` with nothing else but the commit codec.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from edgeps.bench.common import Say
from edgeps.demo import run_demo
from edgeps.localjob import DemoSettings
from edgeps.tables import Table
from edgeps.task import Task, builtin_task, load_task
from learning.data import stratified_split
from learning.spec import ModelSpec
from ps_service.config import ServerConfig
from ps_service.evaluator import Evaluator

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEFAULT_TASKS = ("digits.py", "sensor_regression.py", "keras_cnn.py")
HOLDOUT = 0.2  # the demo's held-out share (learning.prepare)


def centralised(task: Task, seed: int = 0, max_epochs: int = 400, patience: int = 40) -> dict[str, Any]:
    """The best held-out value of the task's model trained centrally on the demo's training rows."""
    config = ServerConfig(**task.server_options())
    data, _ = task.dataset()
    train, holdout = stratified_split(data, HOLDOUT, seed)
    evaluator = Evaluator(
        holdout,
        loss=config.loss,
        metrics=config.metric_names,
        predict=task.predict,
        loss_value=task.loss_value(),
        target=task.target,
    )
    metric, trainer, batch = evaluator.metric, task.trainer(), config.batch_size
    best: dict[str, Any] | None = None
    for lr in (config.lr, config.lr / 4):
        params, rng = task.init(holdout, seed), np.random.default_rng(seed)
        top, since, epochs = None, 0, 0
        while epochs < max_epochs and since < patience:
            epochs += 1
            order = rng.permutation(len(train))
            for start in range(0, len(order), batch):
                rows = order[start : start + batch]
                _, grads = trainer.loss_and_grads(params, train.x[rows], train.y[rows])
                params = {name: values - np.float32(lr) * grads[name] for name, values in params.items()}
            value = evaluator(params).values[metric.name]
            top, since = (value, 0) if top is None or metric.better(value, top) else (top, since + 1)
        assert top is not None
        if best is None or metric.better(top, best["best"]):
            best = {"best": top, "lr": lr, "epochs": epochs}
    assert best is not None
    return best


def bench_tasks(tasks: list[Path | None], codecs: list[str], out: Path, say: Say = print) -> dict[str, Any]:
    """For each task (None: the built-in digits job), the centralised reference and one demo per codec."""
    entries = []
    for path in tasks:
        task = load_task(path) if path is not None else builtin_task(ModelSpec())
        name = path.stem if path is not None else "digits (built-in)"
        say(f"{name}: centralised ...", end=" ", flush=True)
        started = time.monotonic()
        reference = centralised(task)
        metric = task.metric_names[0]
        say(
            f"best {metric} {reference['best']:.4f} (lr {reference['lr']:g}, {reference['epochs']} epochs, "
            f"{time.monotonic() - started:.0f} s)"
        )
        runs = {}
        for codec in codecs:
            say(f"{name}: edgeps demo --codec {codec} ...", end=" ", flush=True)
            settings = DemoSettings(server=ServerConfig(codec=codec), task=path, out=out / name.split()[0] / codec)
            report = run_demo(settings, quiet=True)
            runs[codec] = {key: report[key] for key in ("best", "best_version", "final", "rounds", "wall_s")}
            say(
                f"best {report['best']:.4f}, final {report['final']:.4f}, {report['rounds']} versions, "
                f"{report['wall_s']:.0f} s"
            )
        higher = report["higher_is_better"]
        entries.append(
            {"task": name, "metric": metric, "higher_is_better": higher, "centralised": reference, "runs": runs}
        )
    return {"codecs": codecs, "tasks": entries}


def gap(entry: dict[str, Any], value: float) -> str:
    """How far ``value`` is from the centralised reference: points for a score, a ratio for an error."""
    reference = entry["centralised"]["best"]
    if entry["higher_is_better"]:
        return f"{100 * (value - reference):+.1f} pt"
    return f"{value / reference:.2f}x"


def format_tasks(report: dict[str, Any]) -> Table:
    codecs = report["codecs"]
    columns = ["task", "metric", "centralised"]
    for codec in codecs:
        columns += [f"{codec} best", f"{codec} final", "vs centralised", "versions"]
    table = Table(columns)
    for entry in report["tasks"]:
        row = [entry["task"], entry["metric"], f"{entry['centralised']['best']:.4f}"]
        for codec in codecs:
            run = entry["runs"][codec]
            row += [f"{run['best']:.4f}", f"{run['final']:.4f}", gap(entry, run["best"]), run["rounds"]]
        table.add(*row)
    table.after.append("vs centralised: best minus the centralised best in points (a score), or their ratio (an error)")
    return table
