"""``edgeps bench restart``: what restarts cost a running job, with real processes over the project's
Mosquitto on loopback.

* **Server**: a bsp job of three ``edgeps client`` processes against ``edgeps ps --checkpoint``;
  the server is stopped (SIGTERM, or SIGKILL) ``trials`` times mid-job and started again with the
  same options. Each time: seconds from the new process's start to the job's next version,
  against the round deadline. bsp makes one commit per device per round, so at the end
  ``applied == versions x 3`` says that no acknowledged commit was lost and none applied twice.
* **Device**: the same job without server restarts; one client is SIGKILLed ``trials`` times
  (its process, and all it held, gone) and started again with the same id. Commits refused as
  ``replayed`` or ``out_of_order`` are the commits its restarts lost (protocol 1.0: 35 in one run).

Every commit the devices published is counted by a subscriber on ``grad/+``: at the end of a job,
published = applied + refused.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeps.bench.common import Say
from edgeps.report import read_report
from edgeps.tables import Table

if TYPE_CHECKING:
    from broker.client import BrokerAddress
    from broker.launcher import BrokerProcess
    from learning.prepare import ShardPaths
    from schemas.messages import Metrics

ROOT = Path(__file__).resolve().parents[2]  # the repository
DEVICES = 3
JOB = "restart"


class _Watcher:
    """The job's metrics and every commit published, seen from a subscriber."""

    def __init__(self, address: BrokerAddress, job: str) -> None:
        from broker.client import MqttTransport
        from schemas.topics import Topics

        self.topics = Topics(job)
        self.transport = MqttTransport(
            address,
            f"edgeps-restart-watch-{os.getpid()}",
            [self.topics.metrics, self.topics.all_grad],
            persistent=False,
        )
        self.transport.wait_connected(10)
        self.version = -1
        self.published = 0
        self.last: Metrics | None = None
        self.started = time.monotonic()
        self.curve: list[tuple[float, int]] = []  # (seconds since the watcher started, version)

    def poll(self, timeout: float) -> bool:
        """Read one message, if one comes within ``timeout`` seconds; whether one came."""
        from schemas.messages import MessageError, Metrics

        message = self.transport.receive(timeout=timeout)
        if message is None:
            return False
        if message.topic != self.topics.metrics:
            self.published += 1
            return True
        try:
            self.last = Metrics.from_bytes(message.payload)
        except MessageError:
            return True
        if self.last.version > self.version:
            self.version = self.last.version
            self.curve.append((round(self.now(), 3), self.version))
        return True

    def now(self) -> float:
        return time.monotonic() - self.started

    def drain(self, quiet: float = 0.3) -> int:
        """Read until nothing came for ``quiet`` seconds; the newest version seen."""
        last = time.monotonic()
        while time.monotonic() - last < quiet:
            if self.poll(0.05):
                last = time.monotonic()
        return self.version

    def until(self, reached: Callable[[], bool], timeout: float, what: str) -> float:
        """Read until ``reached()``; the time it took. TimeoutError naming ``what``."""
        started = time.monotonic()
        while not reached():
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"no {what} within {timeout:.0f} s")
            self.poll(0.05)
        return time.monotonic() - started

    def close(self) -> None:
        self.transport.close()


def _job(
    workdir: Path,
    shards: ShardPaths,
    broker: BrokerProcess,
    trials: int,
    target: str,
    how: str,
    deadline: float,
    rounds: int,
    say: Say,
) -> dict[str, Any]:
    """One job; ``target`` is ``server`` or ``device``: what is restarted ``trials`` times."""
    from broker.client import BrokerAddress
    from edgeps.localjob import spawn as spawn_edgeps

    address = BrokerAddress(broker.host, broker.port)
    report, checkpoint = workdir / "metrics.json", workdir / "ps.ckpt"
    common = ["--broker", f"{broker.host}:{broker.port}", "--job", JOB]
    ps = [
        "ps",
        *common,
        "--rounds",
        str(rounds),
        "--min-devices",
        str(DEVICES),
        "--round-deadline",
        str(deadline),
        "--eval-data",
        str(shards.holdout),
        "--checkpoint",
        str(checkpoint),
        "--report",
        str(report),
        "--metrics-interval",
        "0",
    ]
    started = {"ps": 0, **{f"dev-{i}": 0 for i in range(DEVICES)}}

    def spawn(name: str, args: list[str]) -> subprocess.Popen[bytes]:
        started[name] += 1  # each process its own log
        return spawn_edgeps(args, workdir / f"{name}-{started[name]}.log")

    def client(i: int) -> subprocess.Popen[bytes]:
        return spawn(
            f"dev-{i}",
            [
                "client",
                *common,
                "--device",
                f"dev-{i}",
                "--data",
                str(shards.devices[i]),
                "--seed",
                str(i),
                "--step-time",
                "0.004",
            ],
        )

    def past(version: int) -> Callable[[], bool]:
        return lambda: watcher.version > version

    def server() -> subprocess.Popen[bytes]:
        return spawn("ps", ps)

    watcher = _Watcher(address, JOB)
    ps_process = server()
    clients = {i: client(i) for i in range(DEVICES)}
    restarts: list[dict[str, float]] = []
    step = max(3, rounds // (2 * trials + 2))  # versions between restarts
    try:
        watcher.until(lambda: watcher.version >= step, 120, "first versions")
        for trial in range(trials):
            at, stopped_at = watcher.version, watcher.now()
            if target == "server":
                ps_process.send_signal(getattr(signal, how))
                ps_process.wait(timeout=30)
                at = watcher.drain()  # what the stopped server published last
                ps_process = server()
            else:
                clients[1].kill()
                clients[1].wait(timeout=30)
                clients[1] = client(1)
            resume = watcher.until(past(at), 120, f"version after restart {trial + 1}")
            restarts.append(
                {"trial": trial + 1, "version": at, "stopped_at_s": round(stopped_at, 3), "resume_s": round(resume, 3)}
            )
            say(f"  {target} restart {trial + 1}/{trials} at version {at}: next version after {resume:.2f} s")
            watcher.until(past(at + step - 1), 120, "versions between restarts")
        watcher.until(lambda: ps_process.poll() is not None, 300, "the job's end")  # reading as it goes
        if ps_process.returncode != 0:
            raise RuntimeError(f"the server failed; see {workdir}/ps-*.log")
        watcher.until(lambda: watcher.last is not None and watcher.last.finished, 30, "the final metrics")
        settle = time.monotonic() + 2  # commits still in flight at the end
        while time.monotonic() < settle:
            watcher.poll(0.1)
    finally:
        for process in [ps_process, *clients.values()]:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=10)
        watcher.close()
    final = read_report(report)["metrics"][-1]
    rejected = dict(final["rejected"])
    resumes = [r["resume_s"] for r in restarts]
    return {
        "target": target,
        "signal": how if target == "server" else "SIGKILL",
        "round_deadline_s": deadline,
        "versions": final["version"],
        "applied": final["applied"],
        "commits_received": final["commits"],
        "commits_published": watcher.published,
        "rejected": rejected,
        "lost_to_restarts": rejected.get("replayed", 0) + rejected.get("out_of_order", 0)
        if target == "device"
        else final["version"] * DEVICES - final["applied"],
        "restarts": restarts,
        "resume_median_s": round(statistics.median(resumes), 3) if resumes else None,
        "resume_max_s": max(resumes) if resumes else None,
        "within_deadline": sum(r < deadline for r in resumes),
        "final_accuracy": final["accuracy"],
        "curve": watcher.curve,
    }


def bench_restart(
    trials: int = 10,
    how: str = "SIGTERM",
    deadline: float = 10.0,
    rounds: int = 0,
    targets: tuple[str, ...] = ("server", "device"),
    say: Say = print,
) -> dict[str, Any]:
    """The server job and the device job (see the module's docstring; ``targets`` picks), each on a
    fresh broker; ``rounds`` 0: enough for ``trials`` restarts."""
    from broker.launcher import start_broker
    from learning.data import load_digits
    from learning.prepare import prepare_shards

    rounds = rounds or 8 * (trials + 1)
    runs = []
    with tempfile.TemporaryDirectory(prefix="edgeps-restart-") as tmp:
        root = Path(tmp)
        shards = prepare_shards(load_digits(), root / "data", devices=DEVICES, alpha=0.5, seed=0)
        for target in targets:
            say(f"{target} restarts: {trials} in a {rounds}-round bsp job of {DEVICES} devices ...")
            (root / target).mkdir()
            broker = start_broker(workdir=root / target / "broker")
            try:
                runs.append(_job(root / target, shards, broker, trials, target, how, deadline, rounds, say))
            finally:
                broker.stop()
    return {"trials": trials, "rounds": rounds, "runs": runs}


def format_restart(report: dict[str, Any]) -> Table:
    table = Table(
        [
            "restarted",
            "signal",
            "resume median s",
            "max s",
            "< deadline",
            "versions",
            "applied",
            "published",
            "lost",
            "refused",
        ]
    )
    for r in report["runs"]:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(r["rejected"].items())) or "none"
        table.add(
            r["target"],
            r["signal"],
            f"{r['resume_median_s']:.2f}",
            f"{r['resume_max_s']:.2f}",
            f"{r['within_deadline']}/{len(r['restarts'])}",
            r["versions"],
            r["applied"],
            r["commits_published"],
            r["lost_to_restarts"],
            refused,
        )
    table.after.append(
        "lost: server: versions x devices - applied (bsp: one commit each a round); device: commits "
        "refused as replayed or out_of_order"
    )
    return table


def plot_restart(report: dict[str, Any], path: str | Path) -> None:
    """PNG: the version against time in each job, a line at each restart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.8), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        times, versions = zip(*run["curve"], strict=True) if run["curve"] else ((), ())
        ax.step(times, versions, where="post")
        for i, restart in enumerate(run["restarts"]):
            ax.axvline(
                restart["stopped_at_s"], color="tab:red", alpha=0.4, lw=1, label=f"{run['signal']}" if i == 0 else None
            )
        title = (
            f"{run['target']} restarts ({run['signal']}): median {run['resume_median_s']:.2f} s "
            f"to the next version, {run['lost_to_restarts']} lost"
        )
        ax.set(xlabel="seconds", ylabel="global version", title=title)
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench_restart(trials: int, how: str, deadline: float, json_path: str | None) -> dict[str, Any]:
    report = bench_restart(trials, how, deadline)
    plot_restart(report, "bench-restart.png")
    from edgeps.bench.common import show

    return show(report, format_restart(report), json_path)
