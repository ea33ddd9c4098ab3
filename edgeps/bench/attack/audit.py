"""The audit: a clean job and one job per attack on each path, the report, its table and plot."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgeps.bench.attack.deployments import (
    DEVICES,
    HOSTILE,
    JOB,
    ROOT,
    Deployment,
    Supervised,
    _client,
    _forget_sessions,
    _memory,
    deploy,
)
from edgeps.bench.attack.hostile import Hostile
from edgeps.tables import Table

PATHS = ("flat", "sites", "workers")


#: What the hostile device (or account) does, by name: the audit's attacks.
ATTACKS = {
    "huge_seq": "commits whose sequence number is 2^53 and above (a site commit cannot carry it)",
    "bomb": "a commit of 1e30 every version",
    "future_base": "a retained commit, then live ones, based on version 2^53 - 1",
    "samples_flip": "claims 2^32 - 1 samples and commits the reverse of each version, just under the old 8x bound",
    "inbound": "commits the reverse of each version at 7.9x the fleet's median norm (just under the old bound)",
    "flood": "junk commits of 100 KB as fast as the broker takes them",
    "flap": "its status offline and online again every 0.3 s, never a commit",
    "site_flood": "site s2's aggregator account floods junk site commits (sites only)",
}


# ----------------------------------------------------------------------------- one job
def run_job(
    deployment: Deployment, attack: str | None, rounds: int, deadline: float, shards: Any, workdir: Path
) -> dict[str, Any]:
    """One job of ``rounds`` bsp versions on ``deployment``: three honest devices, or two and the
    hostile one (``attack``; for ``site_flood``, three and the hostile account). It starts once
    the three devices said hello. What it reached, and what its processes did."""
    from broker.client import MqttTransport
    from learning.model import init_mlp
    from schemas.messages import MessageError, Metrics
    from schemas.topics import Topics

    workdir.mkdir(parents=True)
    edgeps = [sys.executable, "-m", "edgeps.cli"]
    watcher = MqttTransport(deployment.address(deployment.core, "op"), "op", [Topics(JOB).metrics], persistent=False)
    watcher.wait_connected(10)
    server = subprocess.Popen(
        [
            *edgeps,
            "ps",
            *deployment.login(deployment.core, "ps"),
            "--devices",
            ",".join(DEVICES),
            *deployment.server_flags(),
            "--rounds",
            str(rounds),
            "--min-devices",
            str(len(DEVICES)),
            "--round-deadline",
            str(deadline),
            "--eval-data",
            str(shards.holdout),
        ],
        stdout=subprocess.DEVNULL,
        stderr=(workdir / "ps.log").open("wb"),
        cwd=ROOT,
    )
    helpers = [
        Supervised(command, workdir / f"{name.replace(' ', '-')}.log") for name, command in deployment.helpers().items()
    ]
    honest = [d for d in DEVICES if not (attack and attack != "site_flood" and d == HOSTILE)]
    clients = [_client(deployment, d, shards, workdir) for d in honest]
    hostile = runner = None
    history: list[Metrics] = []
    before = after = 0.0
    try:
        if attack is not None:
            shapes = {name: values.shape for name, values in init_mlp([64, 64, 10], seed=0).items()}
            hostile = Hostile(deployment, attack, shapes)
            runner = threading.Thread(target=hostile.run, daemon=True)
            runner.start()
        give_up = time.monotonic() + 600
        while server.poll() is None and time.monotonic() < give_up and not (history and history[-1].finished):
            for helper in helpers:
                helper.poll()
            message = watcher.receive(timeout=0.2)
            if message is None:
                continue
            try:
                metrics = Metrics.from_bytes(message.payload)
            except MessageError:
                continue
            if not before and metrics.version >= 1:  # the job is under way: everything started
                before = _memory(server, helpers)
            after = _memory(server, helpers) or after
            history.append(metrics)
    finally:
        if hostile is not None and runner is not None:
            hostile.done.set()
            runner.join(timeout=30)
        watcher.close()
        stopped = [helper.stop() for helper in helpers]
        if server.poll() is None and not (history and history[-1].finished):
            server.terminate()
        for process in [server, *clients]:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
    _forget_sessions(deployment)
    accuracies = [m.accuracy for m in history if m.accuracy is not None]
    final = history[-1] if history else None
    return {
        "final_accuracy": final.accuracy or 0.0 if final else 0.0,
        "mean_accuracy": float(np.mean(accuracies[len(accuracies) // 2 :])) if accuracies else 0.0,
        "versions": final.version if final else 0,
        "versions_per_s": round(final.version / final.elapsed_s, 3) if final and final.elapsed_s else 0.0,
        "rejected": dict(final.rejected) if final else {},
        "crashes": sum(h.crashes for h in helpers) + (0 if server.returncode == 0 else 1),
        "rss_mib_before": round(before, 1),
        "rss_mib_after": round(after, 1),
        "sigterm_s": round(max(stopped, default=0.0), 2),
        "hostile_sent": hostile.sent if hostile is not None else 0,
    }


# ----------------------------------------------------------------------------- the bench
def bench_attack(
    paths: tuple[str, ...] = PATHS,
    attacks: tuple[str, ...] = tuple(ATTACKS),
    rounds: int = 150,
    deadline: float = 1.0,
    say: Any = print,
) -> dict[str, Any]:
    """On each of ``paths``, the clean job and one job per attack of ``attacks``."""
    from learning.data import load_digits
    from learning.prepare import prepare_shards

    unknown = [p for p in paths if p not in PATHS] + [a for a in attacks if a not in ATTACKS]
    if unknown:
        raise ValueError(
            f"unknown paths or attacks: {', '.join(unknown)}; paths: {', '.join(PATHS)}; attacks: {', '.join(ATTACKS)}"
        )
    entries = []
    with tempfile.TemporaryDirectory(prefix="edgeps-attack-") as tmp:
        root = Path(tmp)
        shards = prepare_shards(load_digits(), root / "data", devices=len(DEVICES), alpha=0.5, seed=0)
        for path in paths:
            with deploy(path, root / path) as deployment:
                say(f"{path}: clean job ({rounds} bsp rounds) ...", end=" ", flush=True)
                clean = run_job(deployment, None, rounds, deadline, shards, root / path / "clean")
                say(f"accuracy {clean['final_accuracy']:.4f}")
                for attack in attacks:
                    if attack == "site_flood" and path != "sites":
                        continue
                    say(f"{path}: {attack} ...", end=" ", flush=True)
                    run = run_job(deployment, attack, rounds, deadline, shards, root / path / attack)
                    say(f"accuracy {run['final_accuracy']:.4f}, {run['crashes']} crashes")
                    entries.append(
                        {
                            "name": attack,
                            "path": path,
                            "clean_metric": clean["final_accuracy"],
                            "attacked_metric": run["final_accuracy"],
                            "attacked_mean": run["mean_accuracy"],
                            "crashes": run["crashes"],
                            "rss_mib_before": run["rss_mib_before"],
                            "rss_mib_after": run["rss_mib_after"],
                            "versions_per_s": run["versions_per_s"],
                            "clean_versions_per_s": clean["versions_per_s"],
                            "versions": run["versions"],
                            "rejected": run["rejected"],
                            "hostile_sent": run["hostile_sent"],
                            "sigterm_s": run["sigterm_s"],
                        }
                    )
    held = [
        e
        for e in entries
        if e["crashes"] == 0 and min(e["attacked_metric"], e["attacked_mean"]) >= 0.9 * e["clean_metric"]
    ]
    return {"rounds": rounds, "round_deadline_s": deadline, "attacks": entries, "held": len(held), "of": len(entries)}


def format_attack(report: dict[str, Any]) -> Table:
    title = (
        f"each path's clean job, and one per attack ({report['rounds']} bsp rounds, deadline "
        f"{report['round_deadline_s']:g} s): held-out accuracy at the end and over its second half"
    )
    table = Table(
        ["path", "attack", "clean", "final", "mean", "v/s ratio", "crashes", "RSS MiB", "refused"], before=[title]
    )
    for e in report["attacks"]:
        ratio = e["versions_per_s"] / e["clean_versions_per_s"] if e["clean_versions_per_s"] else 0.0
        refused = ", ".join(f"{k} {v}" for k, v in sorted(e["rejected"].items())) or "none"
        table.add(
            e["path"],
            e["name"],
            f"{e['clean_metric']:.4f}",
            f"{e['attacked_metric']:.4f}",
            f"{e['attacked_mean']:.4f}",
            f"{ratio:.2f}",
            e["crashes"],
            f"{e['rss_mib_before']:.0f} -> {e['rss_mib_after']:.0f}",
            refused[:60],
        )
    table.after.append(
        f"{report['held']} of {report['of']} attacks held: no crash, accuracy at the end and during "
        "the attack at least 0.9 of the clean job's"
    )
    return table


def plot_attack(report: dict[str, Any], path: str | Path) -> None:
    """PNG: for each path, each attack's accuracy at the end and during it, against the clean job's
    (the line) and 0.9 of it (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    deployments = list(dict.fromkeys(e["path"] for e in report["attacks"]))
    fig, axes = plt.subplots(1, len(deployments), figsize=(4.8 * len(deployments), 3.6), squeeze=False, sharey=True)
    for ax, deployment in zip(axes[0], deployments, strict=True):
        entries = [e for e in report["attacks"] if e["path"] == deployment]
        x = np.arange(len(entries))
        ax.bar(x - 0.2, [e["attacked_metric"] for e in entries], 0.4, label="at the end")
        ax.bar(x + 0.2, [e["attacked_mean"] for e in entries], 0.4, label="during (second half)")
        clean = entries[0]["clean_metric"]
        ax.axhline(clean, color="black", lw=1, label=f"clean {clean:.3f}")
        ax.axhline(0.9 * clean, color="black", lw=1, ls="--", label="0.9 of clean")
        crashes = sum(e["crashes"] for e in entries)
        ax.set(title=f"{deployment}: {crashes} crashes", xticks=x, ylim=(0.5, 1.0), ylabel="held-out accuracy")
        ax.set_xticklabels([e["name"] for e in entries], rotation=40, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(loc="lower left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench_attack(
    paths: tuple[str, ...],
    attacks: tuple[str, ...],
    rounds: int,
    deadline: float,
    json_path: str | None,
    plot: str | None = "bench-attack.png",
) -> dict[str, Any]:
    report = bench_attack(paths, attacks, rounds, deadline)
    if plot:
        plot_attack(report, plot)
    from edgeps.bench.common import show

    return show(report, format_attack(report), json_path)
