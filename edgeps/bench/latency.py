"""``edgeps bench latency``: where a version's wall time goes in a real job over Mosquitto.

The demo's job (bsp by default, its devices as processes, loopback) runs while an observer
subscribes to the job's commits (``grad/+``) and parameters (``delta`` and ``params``) and notes
when each arrives. For each version v with its parameters seen at P(v):

* round: P(v+1) - P(v);
* device share: the last commit on v (base_version v) seen minus P(v): the devices' work,
  from the parameters leaving the broker to the round's last commit reaching it, both hops
  included;
* server share: P(v+1) minus that last commit: the server's, from the commit reaching the
  broker to the new parameters leaving it.

The observer's clock stands for the broker's (loopback; one subscriber client for both).
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from edgeps.tables import Table


class Observer(threading.Thread):
    """Arrival times of a job's parameters (by version) and commits (by base version and device)."""

    def __init__(self, host: str, port: int, job: str) -> None:
        super().__init__(daemon=True)
        from broker.client import BrokerAddress, MqttTransport
        from schemas.topics import Topics

        self.topics = Topics(job)
        subscriptions = [self.topics.all_grad, self.topics.delta, self.topics.params]
        self.transport = MqttTransport(BrokerAddress(host, port), f"latency-{job}", subscriptions, persistent=False)
        self.transport.wait_connected(10)
        self.params: dict[int, float] = {}  # version -> first arrival (delta or snapshot)
        self.commits: dict[int, dict[str, float]] = {}  # base version -> device -> arrival
        self.done = threading.Event()

    def run(self) -> None:
        from schemas.frame import FrameError, parse_frame

        while not self.done.is_set():
            message = self.transport.receive(timeout=0.1)
            if message is None:
                continue
            now = time.perf_counter()
            try:
                frame = parse_frame(message.payload)
            except FrameError:
                continue
            if message.topic in (self.topics.delta, self.topics.params):
                self.params.setdefault(frame.base_version, now)
            else:
                self.commits.setdefault(frame.base_version, {}).setdefault(frame.device, now)

    def shares(self) -> list[dict[str, float]]:
        """Per version with both ends seen: round, device and server seconds."""
        rows = []
        for v in sorted(self.params):
            if v + 1 not in self.params or not self.commits.get(v):
                continue
            last = max(self.commits[v].values())
            rows.append(
                {
                    "version": v,
                    "round_s": self.params[v + 1] - self.params[v],
                    "device_s": last - self.params[v],
                    "server_s": self.params[v + 1] - last,
                }
            )
        return rows

    def close(self) -> None:
        self.done.set()
        self.join(timeout=5)
        self.transport.close()


def bench_latency(rounds: int = 100, devices: int = 8, pace: str = "bsp", say: Any = print) -> dict[str, Any]:
    """Run the demo's job with an observer; return the medians and the demo's own timing."""
    from broker.launcher import start_broker
    from edgeps.demo import run_demo
    from edgeps.localjob import DemoSettings

    with tempfile.TemporaryDirectory(prefix="edgeps-latency-") as tmp, start_broker(workdir=Path(tmp) / "b") as broker:
        job = "latency"
        observer = Observer(broker.host, broker.port, job)
        observer.start()
        fields = {"rounds": rounds, "pace": pace, "job": job}  # the job's, nested by the model
        address = f"{broker.host}:{broker.port}"
        settings = DemoSettings.model_validate(
            {"out": Path(tmp) / "demo", "broker": address, "devices": devices, **fields}
        )
        say(f"{pace}, {devices} devices, {rounds} rounds of the demo's job, with an observer on grad/+ and params ...")
        try:
            report = run_demo(settings, quiet=True)
        finally:
            observer.close()
        rows = observer.shares()
    if not rows:
        raise RuntimeError("the observer saw no complete version")

    def median_ms(key: str) -> float:
        return round(1e3 * statistics.median(r[key] for r in rows), 2)

    def p90_ms(key: str) -> float:
        return round(1e3 * statistics.quantiles([r[key] for r in rows], n=10)[-1], 2) if len(rows) > 1 else 0.0

    return {
        "pace": pace,
        "devices": devices,
        "rounds": rounds,
        "versions_measured": len(rows),
        "round_ms": median_ms("round_s"),
        "round_p90_ms": p90_ms("round_s"),
        "device_ms": median_ms("device_s"),
        "device_p90_ms": p90_ms("device_s"),
        "server_ms": median_ms("server_s"),
        "server_p90_ms": p90_ms("server_s"),
        "train_s": report["train_s"],
        "wall_s": report["wall_s"],
        "best": report["best"],
        "versions": rows,
    }


def format_latency(report: dict[str, Any]) -> Table:
    heading = f"{report['pace']}, {report['devices']} devices, {report['versions_measured']} versions"
    table = Table(["per version", "median ms", "p90 ms"], before=[heading])
    table.add("round (parameters to parameters)", f"{report['round_ms']:.1f}", f"{report['round_p90_ms']:.1f}")
    table.add("devices (parameters to the last commit)", f"{report['device_ms']:.1f}", f"{report['device_p90_ms']:.1f}")
    table.add("server (last commit to parameters)", f"{report['server_ms']:.1f}", f"{report['server_p90_ms']:.1f}")
    table.after.append(
        f"the job's {report['rounds']} rounds: {report['train_s']:.2f} s of training "
        f"({report['wall_s']:.1f} s wall with start-up), best {report['best']:.4f}"
    )
    return table
