"""``edgeps bench pace``: every pace side by side on one scenario, in virtual time or over Mosquitto."""

from __future__ import annotations

import json
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from edgeps.bench.common import Say, fmt_time, indent, replace_scenario
from edgeps.scenario import RunResult, Scenario
from edgeps.simulator import Simulation, scenario_data
from edgeps.tables import Table

DEFAULT_PACES = ("bsp", "acbsp", "asp", "ssp:2")


def format_pace_table(runs: list[dict[str, Any]], unit: str) -> Table:
    """The comparison table, one row per run, each time-to-target as a ratio to the first row's."""
    first = runs[0]["time_to_target"] if runs else None
    equal = next((r["equal_commits"] for r in runs if "equal_commits" in r), None)
    same = [] if equal is None else [f"best @{equal} commits"]
    table = Table(
        [
            "run",
            f"to target, {unit}",
            "vs 1st",
            "best acc",
            *same,
            "final acc",
            "plateau",
            "idle",
            "commits",
            "MB up",
            "MB down",
        ]
    )
    for r in runs:
        ratio = f"{first / r['time_to_target']:.2f}x" if first and r["time_to_target"] else "-"
        at_equal = [] if equal is None else [f"{r['best_at_equal_commits']:.4f}"]
        table.add(
            r.get("run", r["pace"]),
            fmt_time(r["time_to_target"]),
            ratio,
            f"{r['best_accuracy']:.4f}",
            *at_equal,
            f"{r['final_accuracy']:.4f}",
            f"{r.get('plateau_accuracy', r['final_accuracy']):.4f}",
            f"{r['idle_fraction']:.3f}",
            r["commits"],
            f"{r['bytes_up'] / 1e6:.2f}",
            f"{r['bytes_down'] / 1e6:.2f}",
        )
    return table


def plot_pace(curves: dict[str, list[tuple[float, float]]], target: float, path: Path, xlabel: str, title: str) -> None:
    """PNG of accuracy against time, one line per pace, with the target marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for pace, curve in curves.items():
        ax.plot([t for t, _ in curve], [a for _, a in curve], label=pace, linewidth=1.4)
    ax.axhline(target, color="grey", linestyle="--", linewidth=0.8, label=f"target {target:.2f}")
    ax.set(xlabel=xlabel, ylabel="held-out accuracy", ylim=(0.5, 1.0), title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_pace_sim(
    scenario: Scenario, paces: list[str], codecs: list[str] | None = None, say: Say = print
) -> dict[str, Any]:
    """Simulate each pace (for each commit codec) on the same data, seed and fleet; return the report."""
    data = scenario_data(scenario)
    runs, curves, results = [], {}, []
    plan = [(pace, codec) for codec in (codecs or [scenario.server.codec]) for pace in paces]
    for n, (pace, codec) in enumerate(plan, 1):
        label = f"{pace} {codec}" if codecs else pace
        push, _, pull = codec.partition("/")  # PUSH or PUSH/PULL
        say(f"[{n}/{len(plan)}] {label}: simulating {scenario.duration_s:.0f} virtual seconds ...", end="", flush=True)
        started = time.monotonic()
        run_scenario = replace_scenario(scenario, codec=push, pull_codec=pull or scenario.server.pull_codec)
        result = Simulation(run_scenario, pace, data).run()
        summary = {"run": label, **result.summary(), "codec": push, "pull_codec": run_scenario.server.pull_codec}
        runs.append(summary)
        results.append(result)
        curves[label] = result.curve
        say(
            f" target {fmt_time(summary['time_to_target'])} s, best {summary['best_accuracy']:.4f} "
            f"({time.monotonic() - started:.1f} s)"
        )
    fewest = min(result.commits for result in results)  # every run compared at the commits all of them made
    for summary, result in zip(runs, results, strict=True):
        summary |= {"equal_commits": fewest, "best_at_equal_commits": round(result.best_within(fewest), 4)}
    return {"mode": "simulated", "scenario": scenario.model_dump(), "runs": runs, "curves": curves}


def bench_pace_seeds(
    scenario: Scenario, paces: list[str], seeds: int, say: Say = print, codecs: list[str] | None = None
) -> dict[str, Any]:
    """Each pace (for each commit codec) on ``seeds`` consecutive seeds from the scenario's
    (simulated). One seed's best accuracy differs between runs by a few held-out images; means
    over seeds show which differences hold. Returns every run and, per run, the means and the
    mean curve."""
    runs: list[dict[str, Any]] = []
    curves: dict[str, Any] = {}  # per run: its seeds' curves, then their mean
    for k in range(seeds):
        seeded = replace_scenario(scenario, seed=scenario.seed + k)
        say(f"seed {seeded.seed} ({k + 1}/{seeds}):")
        indented = partial(indent, say)
        report = bench_pace_sim(seeded, paces, codecs, say=indented)
        runs += [{**run, "seed": seeded.seed} for run in report["runs"]]
        for label, curve in report["curves"].items():
            curves.setdefault(label, []).append(curve)
    means = []
    for pace in list(curves):
        mine = [r for r in runs if r["run"] == pace]
        reached = [r["time_to_target"] for r in mine if r["time_to_target"] is not None]
        lows = [r["lowest_after_target"] for r in mine if r["lowest_after_target"] is not None]
        mean = {
            "pace": pace,
            "seeds": len(mine),
            "reached": len(reached),
            "time_to_target": float(np.mean(reached)) if reached else None,
            "best_accuracy": float(np.mean([r["best_accuracy"] for r in mine])),
            "best_per_seed": [r["best_accuracy"] for r in mine],
            "final_accuracy": float(np.mean([r["final_accuracy"] for r in mine])),
            "plateau_accuracy": float(np.mean([r["plateau_accuracy"] for r in mine])),
            "lowest_after_target": float(np.mean(lows)) if lows else None,
            "idle_fraction": float(np.mean([r["idle_fraction"] for r in mine])),
            "bytes_up": float(np.mean([r["bytes_up"] for r in mine])),
        }
        means.append(mean)
        grid = curves[pace]
        curves[pace] = [(t, float(np.mean([c[i][1] for c in grid]))) for i, (t, _) in enumerate(grid[0])]
    return {
        "mode": "simulated",
        "scenario": scenario.model_dump(),
        "seeds": seeds,
        "means": means,
        "runs": runs,
        "curves": curves,
    }


def format_seeds_table(means: list[dict[str, Any]]) -> Table:
    """Means over seeds, one row per run; time to target over the seeds that reached it; best
    accuracy and bytes up also against the first row's."""
    table = Table(
        [
            "run",
            "reached",
            "to target, s",
            "best acc",
            "vs 1st",
            "final acc",
            "plateau",
            "low after",
            "idle",
            "MB up",
            "x fewer up",
            "best per seed",
        ]
    )
    first = means[0] if means else None
    for m in means:
        low = "-" if m["lowest_after_target"] is None else f"{m['lowest_after_target']:.4f}"
        assert first is not None
        table.add(
            m["pace"],
            f"{m['reached']}/{m['seeds']}",
            fmt_time(m["time_to_target"]),
            f"{m['best_accuracy']:.4f}",
            f"{m['best_accuracy'] - first['best_accuracy']:+.4f}",
            f"{m['final_accuracy']:.4f}",
            f"{m['plateau_accuracy']:.4f}",
            low,
            f"{m['idle_fraction']:.3f}",
            f"{m['bytes_up'] / 1e6:.2f}",
            f"{first['bytes_up'] / m['bytes_up']:.1f}",
            " ".join(f"{b:.4f}" for b in m["best_per_seed"]),
        )
    return table


def bench_pace_real(
    scenario: Scenario, paces: list[str], out: Path, say: Say = print, links: bool = False
) -> dict[str, Any]:
    """Run each pace as a real job (server + device processes) over a Mosquitto it starts. With
    ``links``, the devices connect through a relay that gives each of them the scenario's link (its
    bandwidth each way and latency, as the simulator models it) instead of loopback's."""
    from broker.client import BrokerAddress
    from broker.launcher import start_broker
    from edgeps.localjob import DemoSettings, run_local_job
    from learning.data import load_digits
    from learning.prepare import prepare_shards
    from learning.spec import ModelSpec
    from ps_service.config import ServerConfig

    shards = prepare_shards(load_digits(), out / "data", scenario.devices, scenario.alpha, scenario.seed)
    slow = scenario.slow_devices()
    slowdowns = tuple(scenario.slowdown if i in slow else 1.0 for i in range(scenario.devices))
    runs: list[dict[str, Any]] = []
    curves: dict[str, Any] = {}  # per pace: its seeds' curves, then their mean
    with start_broker(workdir=out / "broker") as broker:
        address = BrokerAddress(broker.host, broker.port)
        say(f"broker: {broker.kind} on {broker.host}:{broker.port}; slow devices: {sorted(slow)}")
        devices_at = None
        if links:
            from edgeps.bench.wire import CountingRelay

            relay = CountingRelay((broker.host, broker.port), (scenario.up_bps, scenario.down_bps, scenario.latency_s))
            devices_at = BrokerAddress("127.0.0.1", relay.port)
            say(
                f"devices' links: {scenario.up_bps / 1e6:g} Mbit/s up, {scenario.down_bps / 1e6:g} down, "
                f"{1e3 * scenario.latency_s:g} ms (a shaping relay)"
            )
        for n, pace in enumerate(paces, 1):
            say(f"[{n}/{len(paces)}] {pace}: {scenario.duration_s:.0f} s over MQTT ...", end="", flush=True)
            job_name = f"bench-{pace.replace(':', '-')}"
            server = {"job": job_name, "pace": pace, "rounds": 10**9, "duration_s": scenario.duration_s}
            settings = DemoSettings(
                server=ServerConfig.model_validate({**scenario.server.model_dump(), **server}),
                model=ModelSpec(hidden=",".join(str(h) for h in scenario.hidden)),
                devices=scenario.devices,
                alpha=scenario.alpha,
                seed=scenario.seed,
                slowdowns=slowdowns,
                step_time=scenario.step_s,
                out=out,
            )
            job = run_local_job(settings, address, shards, out / "logs", device_address=devices_at)
            last = job.history[-1]
            result = RunResult(
                pace=pace,
                history=job.history,
                idle_fraction=job.idle_fraction,
                commits=last.commits,
                bytes_up=last.bytes_up,
                bytes_down=last.bytes_down,
                run_s=last.elapsed_s,
                target=scenario.target,
                curve=[(m.elapsed_s, m.accuracy) for m in job.history if m.accuracy is not None],
            )
            summary = result.summary()
            runs.append(summary)
            curves[pace] = result.curve
            say(f" target {fmt_time(summary['time_to_target'])} s, best {summary['best_accuracy']:.4f}")
        if links:
            relay.close()
    return {"mode": "mosquitto", "scenario": scenario.model_dump(), "runs": runs, "curves": curves}


def run_bench_pace(
    scenario: Scenario,
    paces: list[str],
    real: bool,
    json_path: str | None,
    plot_path: Path,
    out: Path | None = None,
    codecs: list[str] | None = None,
    seeds: int = 1,
    links: bool = False,
) -> dict[str, Any]:
    """Run, print the table, write the PNG (and JSON); return the report. ``seeds`` > 1 (simulator
    only): every pace on that many seeds, the table of means and the mean curves."""
    if real:
        with tempfile.TemporaryDirectory(prefix="edgeps-bench-") as tmp:
            report = bench_pace_real(scenario, paces, out or Path(tmp), links=links)
    elif seeds > 1:
        report = bench_pace_seeds(scenario, paces, seeds, codecs=codecs)
    else:
        report = bench_pace_sim(scenario, paces, codecs)
    unit = "wall s" if real else "virtual s"
    print()
    if seeds > 1:
        print(
            f"means over seeds {scenario.seed}..{scenario.seed + seeds - 1} (low after: the lowest sample after "
            "the first at the target):"
        )
        format_seeds_table(report["means"]).print()
    else:
        format_pace_table(report["runs"], unit).print()
    what = "wall seconds over Mosquitto" if real else "virtual seconds (simulated)"
    title = f"{scenario.devices} devices, {round(scenario.slow_fraction * scenario.devices)} of them "
    title += f"{scenario.slowdown:g}x slower, Dirichlet {scenario.alpha}"
    if seeds > 1:
        title += f", mean of {seeds} seeds"
    plot_pace(report["curves"], scenario.target, plot_path, what, title)
    print(f"\nplot: {plot_path}" + (f"; json: {json_path}" if json_path else ""))
    if json_path:
        Path(json_path).write_text(json.dumps({k: v for k, v in report.items() if k != "curves"}, indent=2))
    return report
