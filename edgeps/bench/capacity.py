"""``edgeps bench load --capacity``: in one run, the broker's own rate for the job's commit payload
and the server's sustained apply rate for the same payload, and their ratio.

Both are driven by the same load generator, ``RawPublisher``: MQTT 3.1.1 QoS 1 publishes written
straight to a socket, a window of them in flight, so that the generator costs little CPU next to
what it measures (the machine's cores are shared by the broker, the generator and the consumer):

* broker rate: the generator publishes N copies of the payload to a topic that one
  ``mosquitto_sub`` (QoS 1) reads; the rate is N over the time from the first to the last
  delivered message. Beside it, the same with ``mosquitto_pub --repeat`` as the publisher;
* apply rate: the generator sends valid commits (each device's sequence numbers in order, CRCs
  patched) to a real ``edgeps ps --pace asp`` process as fast as the broker takes them, yet at most
  ``BACKLOG`` (or a second of its receive rate, if more) ahead of what the server has received,
  for S seconds (its per-device rate limit lifted: the measure is its ingest, not the limit); the
  rate is the growth of the server's ``applied`` count over the last three quarters of those
  seconds by the server's own clock (its metrics records, every 0.5 s, carry ``elapsed_s``).

A load sent flat out instead swamps the broker, whose CPU is the server's too here: the server
then applied 880 commits/s where it applies 2,150 with the backlog bounded.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from edgeps.bench.common import rss_mib
from edgeps.bench.load import ROOT, BenchServer, commit_template
from edgeps.bench.rawload import AHEAD_S, BACKLOG, broker_rate, generate, mosquitto_pub_rate
from edgeps.tables import Table


def cpu_s(pid: int) -> float:
    """CPU seconds (user and system) process ``pid`` has used so far; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_workers(
    host: str, port: int, job: str, workdir: Path, count: int, devices: list[str]
) -> list[subprocess.Popen[bytes]]:
    """``count`` ingest workers (``edgeps aggregator --shared``) of ``job``, each connected and subscribed.
    Each reads its own share of the devices (``devices[k::count]``): the load offers each device's
    commits far faster than a device would, and two workers reading the same device can fall more
    than the leader's anti-replay window (256 numbers, docs/SCALING.md) apart, which is not what
    this bench measures."""
    workers, logs = [], []
    for k in range(count):
        logs.append(workdir / f"ingest-{k}.log")
        command = [
            sys.executable,
            "-m",
            "edgeps.cli",
            "aggregator",
            "--job",
            job,
            "--site",
            f"ingest-{k}",
            "--shared",
            "--devices",
            ",".join(devices[k::count]),
            "--broker",
            f"{host}:{port}",
            "--max-commit-rate",
            "1e6",  # as the server's: its ingest is measured, not the per-device rate limit
        ]
        with open(logs[-1], "wb") as log:  # the child keeps its own descriptor
            workers.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    deadline = time.monotonic() + 60
    while not all("aggregating" in log.read_text() for log in logs):
        if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
            raise RuntimeError(f"an ingest worker did not start: see {workdir}/ingest-*.log")
        time.sleep(0.1)
    return workers


def ahead(samples: list[tuple[float, int, int, int]]) -> int:
    """How many commits the load keeps ahead of what the server received: ``BACKLOG``, or ``AHEAD_S``
    of its receive rate over its last second of metrics records (elapsed_s, applied, commits, version)."""
    last = samples[-1]
    before = next((s for s in reversed(samples) if last[0] - s[0] >= 1.0), None)
    if before is None:
        return BACKLOG
    return max(BACKLOG, round(AHEAD_S * (last[2] - before[2]) / (last[0] - before[0])))


def apply_rate(
    host: str,
    port: int,
    workdir: Path,
    devices: int,
    seconds: float,
    generators: int,
    checkpoint: bool,
    say: Any,
    profile: Path | None = None,
    workers: int = 0,
    broker_pid: int | None = None,
) -> dict[str, Any]:
    """A real ``edgeps ps`` (asp) under valid commits for ``seconds``, kept ``ahead`` of it: its
    sustained apply rate. ``profile``: run the server under cProfile, writing its statistics there.
    ``workers``: that many ingest workers take the commits (a shared subscription) and the server only
    their site commits (``--sites-only``). The CPU seconds each process used over the measured window
    come with it (the broker's with ``broker_pid``)."""
    from schemas.messages import DeviceStatus, Metrics
    from schemas.topics import Publish

    job = "capacity-ckpt" if checkpoint else f"capacity-{workers}w" if workers else "capacity"
    flags = ["--max-commit-rate", "1e6"]  # its ingest is measured, not its per-device rate limit
    if checkpoint:
        flags += ["--checkpoint", str(workdir / "state.ckpt")]
    if workers:
        flags += ["--sites", ",".join(f"ingest-{k}" for k in range(workers)), "--sites-only"]
    profiler = ["-m", "cProfile", "-o", str(profile)] if profile else []
    server = BenchServer(host, port, job, workdir, *flags, python=profiler)
    topics, watcher = server.topics, server.watcher
    names = [f"cap-{i:04d}" for i in range(devices)]
    ingest: list[subprocess.Popen[bytes]] = []
    try:
        ingest = start_workers(host, port, job, workdir, workers, names)
        samples: list[tuple[float, int, int, int]] = []  # (server's elapsed_s, applied, commits, version): its metrics

        def take(records: list[Metrics]) -> Metrics | None:
            samples.extend((m.elapsed_s, m.applied, m.commits, m.version) for m in records)
            return records[-1] if records else None

        def read_metrics(timeout: float) -> Metrics | None:
            return take(server.records(timeout))

        take(server.first_records())
        for name in names:  # each device online (its retained status), as a real one says on connecting
            online = DeviceStatus(device=name, state="online", incarnation=1, samples=10).to_bytes()
            watcher.publish(Publish(topics.status(name), online, qos=1, retain=True))
        online_by = time.monotonic() + 60
        while (m := read_metrics(0.2)) is None or m.devices_online < devices:
            if time.monotonic() > online_by:
                raise RuntimeError(f"only {m.devices_online if m else 0} of {devices} devices came online")
        context = multiprocessing.get_context("spawn")
        go, results = context.Event(), context.Queue()
        allowed = context.Value("q", BACKLOG // generators, lock=False)  # per generator
        loaders = [
            context.Process(
                target=generate,
                args=(names[k::generators], host, port, job, seconds, go, allowed, results),
                daemon=True,
            )
            for k in range(generators)
        ]
        for loader in loaders:
            loader.start()
        say(
            f"  {devices} devices' commits for {seconds:g} s, {BACKLOG} (or {AHEAD_S:g} s of them) ahead of the server"
            + (", with --checkpoint" if checkpoint else "")
        )
        time.sleep(1.0)  # the generators connected and built their frames
        read_metrics(0.0)
        start_commits = samples[-1][2]
        begun = samples[-1][0] + 0.5  # the server's clock (its elapsed_s) when the load starts, within a record
        started = time.monotonic()
        go.set()
        rss = []
        pids = {"server": server.process.pid, **{f"ingest-{k}": w.pid for k, w in enumerate(ingest)}}
        if broker_pid is not None:
            pids["broker"] = broker_pid
        pids |= {f"load-{k}": loader.pid for k, loader in enumerate(loaders) if loader.pid is not None}
        cpu_from: dict[str, float] | None = None
        while time.monotonic() - started < seconds:
            read_metrics(0.2)
            allowed.value = (samples[-1][2] - start_commits + ahead(samples)) // generators
            rss.append(rss_mib(server.process.pid) or 0.0)
            if cpu_from is None and time.monotonic() - started >= seconds / 4:  # the window the rate is taken on
                cpu_from, cpu_at = {name: cpu_s(pid) for name, pid in pids.items()}, time.monotonic()
        assert cpu_from is not None
        cpu = {
            name: round((cpu_s(pid) - cpu_from[name]) / (time.monotonic() - cpu_at), 2) for name, pid in pids.items()
        }
        sent = sum(results.get(timeout=60) for _ in loaders)
        late = time.monotonic() + 30  # the server's records of the load's seconds, delayed behind the backlog
        while samples[-1][0] < begun + seconds and time.monotonic() < late:
            read_metrics(0.5)
        window = [s for s in samples if begun + seconds / 4 <= s[0] <= begun + seconds]
        if len(window) < 2:
            raise RuntimeError("too few metrics records from the server during the load")
        (t0, a0, c0, v0), (t1, a1, c1, v1) = window[0], window[-1]
        for loader in loaders:
            loader.join(timeout=30)
        return {
            "sent": sent,
            "offered_rate": round(sent / seconds, 1),
            "apply_rate": round((a1 - a0) / (t1 - t0), 1),
            "receive_rate": round((c1 - c0) / (t1 - t0), 1),
            "version_rate": round((v1 - v0) / (t1 - t0), 1),  # the server's batches (asp: a version each)
            "server_rss_mib": [round(min(rss[len(rss) // 4 :]), 1), round(max(rss[len(rss) // 4 :]), 1)],
            "cores": cpu,  # CPU seconds a second of each process over the last three quarters of the load
            "rejected": dict(server.last.rejected) if server.last is not None else {},
        }
    finally:
        server.stop("capacity bench done")
        for worker in ingest:
            worker.terminate()
            worker.wait(timeout=30)


def bench_capacity(
    devices: int = 100,
    seconds: float = 8.0,
    count: int = 20000,
    generators: int = 2,
    checkpoint: bool = False,
    say: Any = print,
    profile: Path | None = None,
    workers: tuple[int, ...] = (),
    repeats: int = 2,
) -> dict[str, Any]:
    """The broker's raw rate and the server's apply rate for the same payload, in one run; with ``profile``,
    the server's cProfile statistics (of the run without a checkpoint) there; with ``workers``, the apply
    rate of a server behind that many ingest workers, for each count, in the same run. With ``checkpoint``,
    ``repeats`` phases with it and as many without, in the order ABBA (plain, checkpoint, checkpoint,
    plain, ...: a drift of the machine's speed over the run weighs on both alike); the rate ratio is
    that of their sums."""
    from broker.launcher import start_broker

    if repeats < 1:
        raise ValueError(f"--repeats takes 1 or more phases, not {repeats}")
    with tempfile.TemporaryDirectory(prefix="edgeps-capacity-") as tmp, start_broker(workdir=Path(tmp) / "b") as broker:
        payload = bytes(commit_template("cap-0000"))
        say(f"broker: {count} QoS 1 publishes of the {len(payload):,}-byte commit payload to one mosquitto_sub ...")
        pid = broker.process.pid
        before = cpu_s(pid)
        raw = broker_rate(broker.host, broker.port, payload, count)
        broker_us = (cpu_s(pid) - before) / count * 1e6  # its CPU a message taken in and delivered
        say(f"  {raw:,.0f} messages/s, {broker_us:.1f} µs of the broker's CPU each; from mosquitto_pub --repeat ...")
        pub = mosquitto_pub_rate(broker.host, broker.port, payload, count // 4, Path(tmp))
        say(f"  {pub:,.0f} messages/s")
        say("server: edgeps ps --pace asp under the same payloads as commits ...")
        plain = apply_rate(
            broker.host,
            broker.port,
            Path(tmp) / "ps",
            devices,
            seconds,
            generators,
            False,
            say,
            profile,
            broker_pid=pid,
        )
        server_us = plain["cores"]["server"] / plain["apply_rate"] * 1e6
        say(
            f"  {plain['apply_rate']:,.0f} commits applied/s (offered {plain['offered_rate']:,.0f}/s),"
            f" {server_us:.0f} µs of the server's CPU each: {server_us / broker_us:.1f}x the broker's a message"
        )
        report: dict[str, Any] = {
            "payload_bytes": len(payload),
            "broker_rate": round(raw, 1),
            "cpu_per_commit_us": round(server_us, 1),
            "broker_cpu_per_message_us": round(broker_us, 1),
            "cpu_ratio": round(server_us / broker_us, 2),
            "broker_rate_mosquitto_pub": round(pub, 1),
            "apply_rate": plain["apply_rate"],
            "ratio": round(plain["apply_rate"] / raw, 3),
            "ratio_mosquitto_pub": round(plain["apply_rate"] / pub, 3),
            "server": plain,
        }
        if checkpoint:
            phases = [(False, plain)]
            order = [saving for k in range(repeats) for saving in ((False, True) if k % 2 == 0 else (True, False))]
            for k, saving in enumerate(order[1:]):
                phase = Path(tmp) / f"ps-{k}{'-ckpt' if saving else ''}"
                run = apply_rate(
                    broker.host, broker.port, phase, devices, seconds, generators, saving, say, broker_pid=pid
                )
                phases.append((saving, run))
                say(f"  {run['apply_rate']:,.0f} commits applied/s" + (" with --checkpoint" if saving else ""))
            saves, plains = ([run for saving, run in phases if saving is kind] for kind in (True, False))
            rate, saved_rate = (sum(run["apply_rate"] for run in runs) for runs in (plains, saves))
            plain_us, saved_us = (
                sum(run["cores"]["server"] for run in runs) / total * 1e6
                for runs, total in ((plains, rate), (saves, saved_rate))
            )
            say(
                f"  --checkpoint: {saved_rate / rate:.2f}x the apply rate without it ({repeats} phases of each),"
                f" {saved_us:.0f} µs of the server's CPU a commit ({saved_us / plain_us:.2f}x without)"
            )
            report.update(
                apply_rate_checkpoint=round(saved_rate / len(saves), 1),
                ratio_checkpoint=round(saved_rate / len(saves) / raw, 3),
                checkpoint_rate_ratio=round(saved_rate / rate, 3),
                checkpoint_phases=[
                    {"checkpoint": saving, "apply_rate": run["apply_rate"], "server_cores": run["cores"]["server"]}
                    for saving, run in phases
                ],
                cpu_per_commit_us_checkpoint=round(saved_us, 1),
                checkpoint_cpu_ratio=round(saved_us / plain_us, 3),
                server_checkpoint=saves[0],
            )
        for count in workers:
            say(f"server behind {count} ingest workers (edgeps aggregator --shared) under the same load ...")
            shared = apply_rate(
                broker.host,
                broker.port,
                Path(tmp) / f"ps-{count}w",
                devices,
                seconds,
                generators,
                False,
                say,
                workers=count,
                broker_pid=pid,
            )
            say(f"  {shared['apply_rate']:,.0f} commits applied/s: {shared['apply_rate'] / plain['apply_rate']:.2f}x")
            report.setdefault("workers", {})[count] = shared
    return report


def format_capacity(report: dict[str, Any]) -> Table:
    raw, pub = report["broker_rate"], report["broker_rate_mosquitto_pub"]
    table = Table(
        ["", "messages/s", "/ broker", "/ mosquitto_pub"],
        before=[f"{report['payload_bytes']:,}-byte commit payloads, QoS 1"],
    )
    table.add("broker: load generator -> mosquitto_sub", f"{raw:,.0f}", "1.00", f"{raw / pub:.2f}")
    table.add("broker: mosquitto_pub --repeat -> mosquitto_sub", f"{pub:,.0f}", f"{pub / raw:.2f}", "1.00")
    rows = [("server applies", report["server"], report["apply_rate"])]
    if "apply_rate_checkpoint" in report:
        rows.append(("server applies, --checkpoint", report["server_checkpoint"], report["apply_rate_checkpoint"]))
    for name, server, rate in rows:
        table.add(
            f"{name} (offered {server['offered_rate']:,.0f}/s)",
            f"{rate:,.0f}",
            f"{rate / raw:.3f}",
            f"{rate / pub:.2f}",
        )
    for count, shared in report.get("workers", {}).items():
        rate = shared["apply_rate"]
        table.add(
            f"server behind {count} ingest workers (offered {shared['offered_rate']:,.0f}/s)",
            f"{rate:,.0f}",
            f"{rate / raw:.3f}",
            f"{rate / pub:.2f}",
        )
    table.after.append(
        f"CPU: the server {report['cpu_per_commit_us']:.0f} µs a commit applied, the broker"
        f" {report['broker_cpu_per_message_us']:.1f} µs a message delivered: {report['cpu_ratio']:.1f}x"
    )
    if "cpu_per_commit_us_checkpoint" in report:
        table.after.append(
            f"--checkpoint: {report['checkpoint_rate_ratio']:.2f}x the apply rate without it,"
            f" {report['cpu_per_commit_us_checkpoint']:.0f} µs of CPU a commit ({report['checkpoint_cpu_ratio']:.2f}x);"
            " phases: "
            + ", ".join(
                f"{phase['apply_rate']:,.0f}{' ckpt' if phase['checkpoint'] else ''}"
                for phase in report["checkpoint_phases"]
            )
        )
    low, high = report["server"]["server_rss_mib"]
    table.after.append(f"server RSS under the load: {low}..{high} MiB")
    for count, shared in [(0, report["server"]), *report.get("workers", {}).items()]:
        cores = ", ".join(f"{name} {share:.2f}" for name, share in shared["cores"].items())
        ratio = f" ({shared['apply_rate'] / report['apply_rate']:.2f}x one server)" if count else ""
        refused = f"; refused: {shared['rejected']}" if shared["rejected"] else ""
        table.after.append(f"cores used, {count or 'no'} ingest workers{ratio}: {cores}{refused}")
    return table
