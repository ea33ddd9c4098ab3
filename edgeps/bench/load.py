"""``edgeps bench load``: N device clients over one Mosquitto for a bounded time, against a real
``edgeps ps`` process. The devices send valid commits (small random updates, the model's
shapes) at a fixed rate; optionally one of them floods, to show the rate limit at work. It
reports commits sent, applied and rejected by reason, the server's apply rate and its memory
over time (VmRSS sampled twice a second), bounded in count and time, loopback only."""

from __future__ import annotations

import multiprocessing
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from edgeps.bench.common import Say, rss_mib
from edgeps.report import read_report
from edgeps.tables import Table

ROOT = Path(__file__).resolve().parents[2]  # the repository
MAX_DEVICES = 1000
MAX_SECONDS = 600.0


class BenchServer:
    """A real ``edgeps ps`` (asp, endless, metrics every 0.5 s) for a load bench, its log in
    ``workdir/ps.log``, and a client on its metrics topic; ``stop`` ends both."""

    def __init__(self, host: str, port: int, job: str, workdir: Path, *flags: str, python: list[str] | None = None):
        from broker.client import BrokerAddress, MqttTransport
        from schemas.topics import Topics

        self.topics, self.log = Topics(job), workdir / "ps.log"
        self.last: Any = None  # the newest metrics record received
        workdir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            *(python or []),
            "-m",
            "edgeps.cli",
            "ps",
            "--broker",
            f"{host}:{port}",
            "--job",
            job,
            "--pace",
            "asp",
            "--rounds",
            str(10**9),
            "--min-devices",
            "1",
            "--metrics-interval",
            "0.5",
            *flags,
        ]
        with open(self.log, "wb") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT)
        self.watcher = MqttTransport(
            BrokerAddress(host, port), f"{job}-watcher", [self.topics.metrics], persistent=False
        )
        self.watcher.wait_connected(10)

    def records(self, timeout: float) -> list[Any]:
        """The metrics records received (``schemas.messages.Metrics``), waiting up to ``timeout`` for the first."""
        from schemas.messages import Metrics

        out: list[Metrics] = []
        while (message := self.watcher.receive(timeout=0.0 if out else timeout)) is not None:
            out.append(Metrics.from_bytes(message.payload))
        if out:
            self.last = out[-1]
        return out

    def first_records(self, timeout: float = 60.0) -> list[Any]:
        """Its first metrics records: it is connected and subscribed (RuntimeError, naming its log, if not)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            if records := self.records(0.2):
                return records
        raise RuntimeError(f"the server did not start: see {self.log}")

    def stop(self, reason: str) -> None:
        """The stop command, then SIGTERM if it has not ended within 30 s."""
        from schemas.messages import Command
        from schemas.topics import Publish

        try:
            self.watcher.publish(Publish(self.topics.cmd, Command(cmd="stop", reason=reason).to_bytes(), qos=1))
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=10)
        finally:
            self.watcher.close()


def commit_template(device: str) -> bytearray:
    """The load's commit for ``device``: a small random update of the demo's model (MLP 64-64-10,
    fp32, about 19 KB), compact as the devices send it (protocol 1.9), sequence number 1; ``patch``
    sets another."""
    from learning.model import init_mlp
    from schemas.codecs import make_codec
    from schemas.frame import Frame, FrameKind, encode_compact

    rng = np.random.default_rng(0)
    shapes = {n: v.shape for n, v in init_mlp([64, 64, 10], seed=0).items()}
    update = {n: (rng.standard_normal(shape) * 1e-4).astype(np.float32) for n, shape in shapes.items()}
    frame = Frame(kind=FrameKind.COMMIT, base_version=0, tensors=update, device=device, seq=1, samples=10, steps=1)
    values = np.concatenate([v.ravel() for v in update.values()])
    return bytearray(encode_compact(frame, make_codec("fp32").encode_compact(values)))


def patch(body: bytearray, seq: int) -> bytearray:
    """``body`` (a commit frame) with sequence number ``seq`` and its CRC recomputed, in place."""
    struct.pack_into("<Q", body, 20, seq)
    struct.pack_into("<I", body, len(body) - 4, zlib.crc32(memoryview(body)[:-4]))
    return body


def _sender(
    names: list[str],
    host: str,
    port: int,
    job: str,
    rate: float,
    seconds: float,
    flood: bool,
    go: Any,
    results: Any,
) -> None:
    """One load process: a client per device in ``names``, each sending ``rate`` valid commits a
    second for ``seconds`` once ``go`` is set (the first device 250 a second with ``flood``); puts
    the number sent on ``results``. Frames are encoded once: each commit patches its sequence
    number and CRC, so that the load is not bound by this process's encoding."""
    from broker.client import BrokerAddress, MqttTransport
    from schemas.messages import DeviceStatus
    from schemas.topics import Publish, Topics

    topics, address = Topics(job), BrokerAddress(host, port)
    clients, templates = [], []
    for name in names:
        online = DeviceStatus(device=name, state="online", incarnation=1, samples=10).to_bytes()
        offline = DeviceStatus(device=name, state="offline", incarnation=1).to_bytes()
        clients.append(
            MqttTransport(
                address,
                f"edgeps-dev-{job}-{name}",
                [],
                will=Publish(topics.status(name), offline, retain=True),
                hello=Publish(topics.status(name), online, retain=True),
            )
        )
        templates.append(commit_template(name))
    for client in clients:
        client.wait_connected(60)
    go.wait()
    sent, seq = 0, [0] * len(names)
    started = time.monotonic()
    interval = 1.0 / (rate * len(names))
    i = 0
    while time.monotonic() - started < seconds:
        k = i % len(names)
        for _ in range(250 if flood and k == 0 else 1):  # 250/s: over the default limit of 100/s
            seq[k] += 1
            clients[k].publish(Publish(topics.grad(names[k]), bytes(patch(templates[k], seq[k])), qos=1))
            sent += 1
        i += 1
        time.sleep(max(0.0, started + i * interval - time.monotonic()))
    for client in clients:
        client.close(timeout=60)
    results.put(sent)


def bench_load(
    devices: int, seconds: float, rate: float = 1.0, flood: bool = False, say: Say = print, senders: int = 4
) -> dict[str, Any]:
    """Run the load; return the report."""
    from broker.client import BrokerAddress
    from broker.launcher import start_broker

    if not 1 <= devices <= MAX_DEVICES or not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"the load is bounded: 1..{MAX_DEVICES} devices, up to {MAX_SECONDS:.0f} s")
    job = "load"
    senders = max(1, min(senders, devices))
    with tempfile.TemporaryDirectory(prefix="edgeps-load-") as tmp, start_broker(workdir=Path(tmp) / "b") as broker:
        address = BrokerAddress(broker.host, broker.port)
        report_path = Path(tmp) / "metrics.json"
        bench = BenchServer(broker.host, broker.port, job, Path(tmp), "--report", str(report_path))
        server = bench.process
        latest: dict[str, Any] = {}

        def take(records: list[Any]) -> None:
            for metrics in records:
                if metrics.commits >= latest.get("commits", -1):
                    latest.update(metrics.model_dump())

        def read_metrics(timeout: float = 0.05) -> None:
            take(bench.records(timeout))

        take(bench.first_records())
        say(f"server pid {server.pid} is up; connecting {devices} device clients in {senders} processes ...")
        names = [f"load-{i:04d}" for i in range(devices)]
        context = multiprocessing.get_context("spawn")
        go, results = context.Event(), context.Queue()
        workers = [
            context.Process(
                target=_sender,
                args=(names[k::senders], address.host, address.port, job, rate, seconds, flood and k == 0, go, results),
                daemon=True,
            )
            for k in range(senders)
        ]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + 120
        while latest.get("devices_online", 0) < devices and time.monotonic() < deadline:
            read_metrics(0.2)  # every hello registered before the first commit
        if latest.get("devices_online", 0) < devices:
            raise RuntimeError(f"only {latest.get('devices_online', 0)} of {devices} devices came online")
        rss: list[tuple[float, float]] = []
        say(f"sending {rate:g} commit/s per device for {seconds:g} s" + (", one device flooding" if flood else ""))
        started = time.monotonic()
        go.set()
        while time.monotonic() - started < seconds:
            rss.append((round(time.monotonic() - started, 2), rss_mib(server.pid) or 0.0))
            read_metrics(0.5)
        sent = sum(results.get(timeout=60) for _ in workers)
        load_s = time.monotonic() - started
        say(f"sent {sent} commits in {load_s:.1f} s; waiting for the server to take them all ...")
        deadline = time.monotonic() + 60
        while latest.get("commits", 0) < sent and time.monotonic() < deadline:
            read_metrics(0.2)
            rss.append((round(time.monotonic() - started, 2), rss_mib(server.pid) or 0.0))
        drain_s = time.monotonic() - started - load_s
        peak = max(r for _, r in rss)
        bench.stop("load bench done")
        for worker in workers:
            worker.join(timeout=30)
        final = read_report(report_path)["metrics"][-1] if report_path.exists() else latest
    rejected = final.get("rejected", {})
    quarter = [r for t, r in rss if load_s / 4 <= t <= load_s]
    first = [r for t, r in rss if t < load_s / 4]
    return {
        "devices": devices,
        "seconds": seconds,
        "rate_per_device": rate,
        "flood": flood,
        "sent": sent,
        "received": final.get("commits"),
        "applied": final.get("applied"),
        "rejected": rejected,
        "balanced": final.get("applied", 0) + sum(rejected.values()) == sent,
        "apply_rate_per_s": round(final.get("applied", 0) / load_s, 1),
        "drain_s": round(drain_s, 2),
        "server_peak_rss_mib": round(peak, 1),
        "server_rss_first_quarter_mib": round(max(first), 1) if first else None,
        "server_rss_after_warmup_mib": [round(min(quarter), 1), round(max(quarter), 1)] if quarter else None,
        "rss_growth_after_first_quarter": round(max(quarter) / max(first) - 1, 3) if first and quarter else None,
        "rss_series": rss,
    }


def format_load(report: dict[str, Any]) -> Table:
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(report["rejected"].items())) or "none"
    low, high = report["server_rss_after_warmup_mib"] or (0, 0)
    table = Table(["", ""], header=False)
    table.add(
        "devices",
        f"{report['devices']} ({report['rate_per_device']:g} commit/s each"
        + (", one flooding)" if report["flood"] else ")"),
    )
    for name, value in (
        ("commits sent", report["sent"]),
        ("received", report["received"]),
        ("applied", report["applied"]),
        ("rejected", rejected),
    ):
        table.add(name, value)
    table.add("sent = applied + rejected", "yes" if report["balanced"] else "NO")
    table.add("apply rate", f"{report['apply_rate_per_s']} commits/s (all in {report['drain_s']} s after the load)")
    table.add(
        "server RSS",
        f"peak {report['server_peak_rss_mib']} MiB; first quarter of the load up to "
        f"{report['server_rss_first_quarter_mib']} MiB, then {low}..{high} MiB "
        f"({100 * (report['rss_growth_after_first_quarter'] or 0):+.0f}%)",
    )
    return table


def run_bench_load(devices: int, seconds: float, rate: float, flood: bool, json_path: str | None) -> dict[str, Any]:
    report = bench_load(devices, seconds, rate, flood)
    from edgeps.bench.common import show

    return show(report, format_load(report), json_path)
