"""The report of a training run: JSON, a text table, and a PNG of the task's metric and loss.

``edgeps ps --report FILE`` and ``edgeps demo`` write the same report (the demo adds what it
saw of its devices); ``edgeps report FILE`` prints its table and draws its plot later. The
report keeps every metrics record (``metrics``), so nothing the server measured is lost."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgeps.tables import Table
from learning.metrics import METRICS
from schemas.messages import Metrics


def _value(m: Metrics) -> float:
    """The task's metric in a record (records before protocol 1.2 hold only the accuracy)."""
    value = m.value if m.value is not None else m.accuracy
    return float("nan") if value is None else value


def build_report(history: list[Metrics], wall_s: float, settings: dict[str, Any]) -> dict[str, Any]:
    """Summarise the server's per-version metrics; ``history`` must hold at least version 0."""
    if not history:
        raise ValueError("no metrics were recorded")
    last, metric = history[-1], history[-1].metric
    higher = METRICS[metric].higher_is_better if metric in METRICS else True
    values = [_value(m) for m in history]
    best = max(range(len(values)), key=lambda i: values[i] if higher else -values[i])  # the first of the best
    baseline = last.baseline.get(metric)
    accuracy = {}
    if all(m.accuracy is not None for m in history):
        accuracy = {"best_accuracy": max(m.accuracy or 0.0 for m in history), "final_accuracy": last.accuracy}
    return {
        "settings": settings,
        "metric": metric,
        "higher_is_better": higher,
        "best": values[best],
        "best_version": history[best].evaluated_version,
        "final": values[-1],
        "final_version": last.evaluated_version,
        "baseline": baseline,
        **accuracy,
        "rounds": last.version,
        "wall_s": round(wall_s, 3),
        "train_s": round(last.elapsed_s, 3),
        "commits": last.commits,
        "applied": last.applied,
        "bytes_up": last.bytes_up,
        "bytes_down": last.bytes_down,
        "rejected": sum(last.rejected.values()),
        "rejected_by_reason": dict(last.rejected),
        "unable": dict(last.unable),
        "history": [
            {**m.model_dump(include={"version", "accuracy", "loss", "commits", "elapsed_s"}), "value": v}
            for m, v in zip(history, values, strict=True)
        ],
        "metrics": [m.model_dump() for m in history],
    }


def read_report(path: str | Path) -> dict[str, Any]:
    """A report written by ``build_report`` (or, from an earlier version of ``edgeps ps --report``,
    a bare list of metrics records); ValueError naming the file if it is neither."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        if isinstance(data, list):
            history = [Metrics.model_validate(m) for m in data]
            return build_report(history, history[-1].elapsed_s if history else 0.0, {})
        if isinstance(data, dict) and "metrics" in data and "history" in data:
            if "metric" not in data:  # written before protocol 1.2: the records say the rest
                history = [Metrics.model_validate(m) for m in data["metrics"]]
                return {**data, **build_report(history, data.get("wall_s", 0.0), data.get("settings", {}))}
            return data
    except (OSError, ValueError) as exc:  # pydantic's ValidationError and JSON errors are ValueErrors
        raise ValueError(f"{path}: not an edgeps report ({str(exc).splitlines()[0]})") from None
    raise ValueError(f"{path}: not an edgeps report (no metrics)")


def read_metrics(path: str | Path) -> list[Metrics]:
    """Every metrics record of the report at ``path``."""
    return [Metrics.model_validate(m) for m in read_report(path)["metrics"]]


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def format_report(report: dict[str, Any], max_rows: int = 25) -> Table:
    """A readable table: per round the task's metric and the loss, then the totals."""
    rows, metric = report["history"], report["metric"]
    if len(rows) > max_rows:  # keep the first, the last and evenly spaced rounds between
        step = (len(rows) - 1) / (max_rows - 1)
        rows = [rows[round(i * step)] for i in range(max_rows)]
    table = Table(["round", metric, "loss", "commits", "time s"])
    for r in rows:
        table.add(r["version"], f"{r['value']:.4f}", f"{r['loss']:.4f}", r["commits"], f"{r['elapsed_s']:.2f}")
    lower = [] if report["higher_is_better"] else ["lower is better"]
    best, final = report.get("best_version"), report.get("final_version")
    best_notes = ([] if best is None else [f"version {best}"]) + lower
    table.after += [
        "",
        f"best {metric:<10} {report['best']:.4f}" + (f" ({'; '.join(best_notes)})" if best_notes else ""),
        f"final {metric:<9} {report['final']:.4f}" + ("" if final is None else f" (version {final})"),
        *_baseline_line(report),
        f"rounds          {report['rounds']}",
        f"wall time       {report['wall_s']:.1f} s (training {report['train_s']:.1f} s)",
        f"commits         {report['commits']} ({report['applied']} applied, {report['rejected']} rejected)",
        f"bytes up        {_mb(report['bytes_up'])}",
        f"bytes down      {_mb(report['bytes_down'])}",
    ]
    for device, reason in sorted(report.get("unable", {}).items()):
        table.after.append(f"device {device} could not take part: {reason}")
    if report.get("device_backends"):
        backends = ", ".join(f"{n} {name}" for name, n in sorted(report["device_backends"].items()))
        table.after.append(f"device trainers {backends}")
    return table


def _baseline_line(report: dict[str, Any]) -> list[str]:
    """How the final model compares with a constant predictor (a job that learned nothing says so)."""
    baseline, metric = report.get("baseline"), report["metric"]
    if baseline is None:
        return []
    kind = "its most common class" if metric in ("accuracy", "macro_f1") else "the mean"
    line = f"{'trivial ' + metric:<15} {baseline:.4f} (predicting {kind})"
    learned = report["final"] > baseline if report["higher_is_better"] else report["final"] < baseline
    return [line if learned else f"{line}: the final model is no better; it learned nothing"]


def write_json(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2))


def plot_curves(report: dict[str, Any], path: str | Path, title: str = "edgeps: held-out metric and loss") -> None:
    """PNG of the task's metric and the loss on the held-out set against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, metric = report["history"], report["metric"]
    seconds = [r["elapsed_s"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(seconds, [r["value"] for r in rows], marker=".")
    left.set(xlabel="seconds since the job started", ylabel=f"held-out {metric}")
    if metric in ("accuracy", "macro_f1"):
        left.set_ylim(0, 1)
    right.plot(seconds, [r["loss"] for r in rows], marker=".", color="tab:red")
    right.set(xlabel="seconds since the job started", ylabel="held-out loss")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
