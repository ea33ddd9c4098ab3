"""``edgeps bench freq``: push_every policies side by side on the pace scenario (acbsp, simulated)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from edgeps.bench.common import Say, fmt_time, replace_scenario
from edgeps.scenario import Scenario
from edgeps.simulator import Simulation, scenario_data
from edgeps.tables import Table

#: The frequency bench's runs: (label, scenario changes). fixed keeps the scenario's push_every;
#: adacomm and trend move within the scenario's bounds; trend adds the per-device adjustment.
#: The next two rows separate the policy from the adjustment. The policies are compared with the
#: same plain server step: the server extrapolates acbsp's aggregates (FedExP) only under a fixed
#: push_every, so fixed runs without it too; the last row is fixed as acbsp runs it by default.
FREQ_RUNS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("fixed", {"frequency": "fixed", "extrapolation": 1.0}),
    ("adacomm", {"frequency": "adacomm"}),
    ("trend", {"frequency": "trend", "balance": "release"}),
    ("trend/steps", {"frequency": "trend", "balance": "steps"}),
    ("adacomm/release", {"frequency": "adacomm", "balance": "release"}),
    ("fixed+fedexp", {"frequency": "fixed"}),
)


def bench_freq(
    scenario: Scenario, runs: tuple[tuple[str, dict[str, Any]], ...] = FREQ_RUNS, say: Say = print
) -> dict[str, Any]:
    """Each push_every policy on the same scenario (acbsp), simulated; return the report."""
    data = scenario_data(scenario)
    rows, curves, push_every = [], {}, {}
    for n, (label, changes) in enumerate(runs, 1):
        say(f"[{n}/{len(runs)}] {label}: simulating {scenario.duration_s:.0f} virtual seconds ...", end="", flush=True)
        started = time.monotonic()
        simulation = Simulation(replace_scenario(scenario, **changes), "acbsp", data)
        result = simulation.run()
        at_target = result.at_target()
        rows.append(
            {
                "policy": label,
                "commits_to_target": at_target[0] if at_target else None,
                "bytes_to_target": at_target[1] if at_target else None,
                "time_to_target": result.time_to_target,
                "best_accuracy": round(result.best_accuracy, 4),
                "plateau_accuracy": round(result.plateau_accuracy, 4),
                "commits": result.commits,
                "bytes": result.bytes_up + result.bytes_down,
                "eval_s": result.history[-1].eval_s,
                "evaluations": simulation.server.evaluator.calls,
                **changes,
            }
        )
        curves[label] = result.curve
        push_every[label] = [(t, p) for (t, _), (_, _, p) in zip(result.curve, result.traffic, strict=True)]
        say(
            f" {rows[-1]['commits_to_target']} commits to target, best {rows[-1]['best_accuracy']:.4f} "
            f"({time.monotonic() - started:.1f} s)"
        )
    return {"scenario": scenario.model_dump(), "runs": rows, "curves": curves, "push_every": push_every}


def format_freq_table(runs: list[dict[str, Any]]) -> Table:
    first = runs[0]["commits_to_target"] if runs else None
    table = Table(
        [
            "policy",
            "commits to target",
            "vs 1st",
            "MB to target",
            "to target, s",
            "best acc",
            "plateau",
            "commits",
            "eval s",
        ]
    )
    for r in runs:
        commits = r["commits_to_target"]
        saving = f"{commits / first - 1:+.0%}" if first and commits else "-"
        mb = "never" if r["bytes_to_target"] is None else f"{r['bytes_to_target'] / 1e6:.2f}"
        table.add(
            r["policy"],
            "never" if commits is None else commits,
            saving,
            mb,
            fmt_time(r["time_to_target"]),
            f"{r['best_accuracy']:.4f}",
            f"{r['plateau_accuracy']:.4f}",
            r["commits"],
            f"{r['eval_s']:.2f}",
        )
    return table


def plot_freq(report: dict[str, Any], target: float, path: Path) -> None:
    """PNG: accuracy against virtual time (top) and the devices' mean push_every (bottom), per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(3, 2))
    for label, curve in report["curves"].items():
        top.plot([t for t, _ in curve], [a for _, a in curve], label=label, linewidth=1.4)
        steps = report["push_every"][label]
        bottom.step([t for t, _ in steps], [p for _, p in steps], where="post", label=label, linewidth=1.4)
    top.axhline(target, color="grey", linestyle="--", linewidth=0.8, label=f"target {target:.2f}")
    top.set(ylabel="held-out accuracy", ylim=(0.5, 1.0), title="push_every policies, acbsp (simulated)")
    bottom.set(xlabel="virtual seconds", ylabel="push_every (mean over devices)", yscale="log")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right" if ax is top else "upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench_freq(scenario: Scenario, json_path: str | None, plot_path: Path) -> dict[str, Any]:
    """Run, print the table, write the PNG (and JSON); return the report."""
    report = bench_freq(scenario)
    print()
    format_freq_table(report["runs"]).print()
    plot_freq(report, scenario.target, plot_path)
    print(f"\nplot: {plot_path}" + (f"; json: {json_path}" if json_path else ""))
    if json_path:
        keep = ("scenario", "runs")
        Path(json_path).write_text(json.dumps({k: report[k] for k in keep}, indent=2))
    return report
