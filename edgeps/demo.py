"""``edgeps demo``: a broker, the parameter server and N device processes on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from broker.client import BrokerAddress, MqttTransport
from broker.launcher import BrokerProcess, start_broker
from edgeps.report import build_report, format_report, plot_accuracy, write_json
from learning.data import load_digits
from learning.prepare import ShardPaths, prepare_shards
from schemas.messages import DeviceStatus, MessageError, Metrics
from schemas.topics import Topics


@dataclass(frozen=True)
class DemoSettings:
    """One local job: the fleet, its data, the training settings, where the files go."""

    devices: int = 8
    alpha: float = 0.5
    pace: str = "bsp"
    rounds: int = 100
    push_every: int = 10
    lr: float = 0.2
    batch_size: int = 32
    hidden: str = "64"
    seed: int = 0
    codec: str = "fp32"
    pull_codec: str = "fp32"
    frequency: str = "fixed"
    push_every_min: int = 1
    push_every_max: int = 160
    balance: str = "off"
    extrapolation: float | None = None  # None: the pace's own (FedExP, acbsp only)
    eval_every: int = 1
    eval_sample: int | None = None
    metrics_port: int | None = None  # the server's HTTP endpoint: /metrics and the dashboard
    backend: str = "numpy"  # the devices' trainer: numpy, tflite or auto (the server then exports one)
    arch: str = "mlp"
    channels: int = 16
    kernel: int = 3
    job: str = "demo"
    out: Path = Path("edgeps-demo")
    broker: str | None = None
    embedded_broker: bool = False
    timeout_s: float = 600.0
    #: Per-device compute slowdown factors (missing devices: 1.0).
    slowdowns: tuple[float, ...] = ()
    #: Emulated compute seconds per local step on a reference device.
    step_time: float = 0.0
    #: Finish after this many seconds instead of after ``rounds``.
    duration_s: float | None = None
    round_deadline_s: float = 30.0
    #: The last K devices run as edgeps-device, the C SDK's device (built into OUT/sdk on the fly).
    embedded_devices: int = 0


@dataclass
class JobResult:
    """The server's per-version metrics and each device's final status."""

    history: list[Metrics]
    statuses: dict[str, DeviceStatus] = field(default_factory=dict)  # each device's final status

    @property
    def idle_fraction(self) -> float:
        """Device time spent unable to train over device time in the run."""
        idle = sum(s.idle_s for s in self.statuses.values())
        total = idle + sum(s.busy_s for s in self.statuses.values())
        return idle / total if total else 0.0


def spawn(args: list[str], log_path: Path, program: Path | None = None) -> subprocess.Popen:
    """``edgeps ARGS`` (or ``program ARGS``) as a child process, its output to ``log_path``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    command = [str(program)] if program is not None else [sys.executable, "-m", "edgeps.cli"]
    with open(log_path, "wb") as log:
        return subprocess.Popen([*command, *args], stdout=log, stderr=log, env=env)


def _progress(metrics: Metrics, rounds: int) -> None:
    """A live progress bar on a terminal; every tenth of the job as a line otherwise."""
    done = int(30 * metrics.version / rounds)
    line = (
        f"[{'#' * done}{'.' * (30 - done)}] round {metrics.version:>3}/{rounds}  accuracy {metrics.accuracy:.4f}  "
        f"loss {metrics.loss:.4f}  commits {metrics.commits:>5}  {metrics.elapsed_s:6.1f} s"
    )
    if sys.stdout.isatty():
        print("\r" + line, end="\n" if metrics.finished else "", flush=True)
    elif metrics.finished or metrics.version % max(1, rounds // 10) == 0:
        print(line, flush=True)


def _wait_for_fresh_start(watcher: MqttTransport, topics: Topics, server: subprocess.Popen, deadline: float) -> None:
    """Wait for the new server's first metrics (version 0). Until then the broker may still hold
    the retained messages of an earlier job of the same name, and a device that read its
    ``finished`` barrier would stop at once."""
    while time.monotonic() < deadline and server.poll() is None:
        inbound = watcher.receive(timeout=0.2)
        if inbound is None or inbound.topic != topics.metrics:
            continue
        try:
            metrics = Metrics.from_bytes(inbound.payload)
        except MessageError:
            continue
        if metrics.version == 0 and not metrics.finished:
            return
    if server.poll() is not None:
        raise RuntimeError(f"the parameter server exited before it started (exit {server.returncode})")
    raise RuntimeError("the parameter server did not publish its first metrics within 60 s")


def run_local_job(
    settings: DemoSettings,
    address: BrokerAddress,
    shards: ShardPaths,
    logs: Path,
    quiet: bool = True,
    c_device: Path | None = None,
) -> JobResult:
    """Run the parameter server and one process per device against ``address`` until the job ends."""
    logs.mkdir(parents=True, exist_ok=True)
    topics = Topics(settings.job)
    watcher = MqttTransport(
        address, f"edgeps-watch-{settings.job}-{os.getpid()}", [topics.metrics, topics.all_status], persistent=False
    )
    processes: list[subprocess.Popen] = []
    statuses: dict[str, DeviceStatus] = {}
    try:
        watcher.wait_connected(10)
        common = ["--broker", f"{address.host}:{address.port}", "--job", settings.job]
        server_report = logs / f"{settings.job}-metrics.json"
        server_args = [
            "ps", *common, "--pace", settings.pace, "--rounds", str(settings.rounds),
            "--push-every", str(settings.push_every), "--lr", str(settings.lr),
            "--batch-size", str(settings.batch_size), "--hidden", settings.hidden, "--seed", str(settings.seed),
            "--eval-data", str(shards.holdout), "--report", str(server_report),
            "--min-devices", str(settings.devices), "--round-deadline", str(settings.round_deadline_s),
            "--codec", settings.codec, "--pull-codec", settings.pull_codec,
            "--frequency", settings.frequency, "--push-every-min", str(settings.push_every_min),
            "--push-every-max", str(settings.push_every_max), "--eval-every", str(settings.eval_every),
            "--balance", settings.balance, "--arch", settings.arch, "--channels", str(settings.channels),
            "--kernel", str(settings.kernel),
        ]  # fmt: skip
        if settings.backend != "numpy":
            server_args.append("--export-tflite")
        if settings.metrics_port is not None:
            server_args += ["--metrics-port", str(settings.metrics_port)]
        if settings.eval_sample:
            server_args += ["--eval-sample", str(settings.eval_sample)]
        if settings.extrapolation is not None:
            server_args += ["--extrapolation", str(settings.extrapolation)]
        if settings.duration_s:
            server_args += ["--duration", str(settings.duration_s)]
        server = spawn(server_args, logs / f"{settings.job}-ps.log")
        processes.append(server)
        _wait_for_fresh_start(watcher, topics, server, time.monotonic() + 60)
        for i, shard in enumerate(shards.devices):
            name = f"dev-{i:02d}"
            slowdown = settings.slowdowns[i] if i < len(settings.slowdowns) else 1.0
            if c_device is not None and i >= settings.devices - settings.embedded_devices:  # the C SDK's device
                device = [*common, "--device", name, "--data", str(shard.with_suffix(".epsf")), "--seed",
                          str(settings.seed + i), "--step-time", str(settings.step_time * slowdown)]  # fmt: skip
                processes.append(spawn(device, logs / f"{settings.job}-{name}.log", program=c_device))
                continue
            device = [
                "client", *common, "--device", name, "--data", str(shard), "--seed", str(settings.seed + i),
                "--slowdown", str(slowdown), "--step-time", str(settings.step_time),
                "--backend", settings.backend, "--cache", str(logs.parent / "artifacts" / name),
            ]  # fmt: skip
            processes.append(spawn(device, logs / f"{settings.job}-{name}.log"))
        if not quiet:
            print(f"started the parameter server ({settings.pace}) and {settings.devices} devices; logs in {logs}/")

        deadline = time.monotonic() + settings.timeout_s

        def drain(timeout: float) -> None:
            inbound = watcher.receive(timeout=timeout)
            if inbound is None:
                return
            try:
                if inbound.topic == topics.metrics:
                    if not quiet:
                        _progress(Metrics.from_bytes(inbound.payload), settings.rounds)
                elif inbound.payload:
                    status = DeviceStatus.from_bytes(inbound.payload)
                    statuses[status.device] = status
            except MessageError:
                pass

        while server.poll() is None and time.monotonic() < deadline:
            drain(0.2)
        if server.poll() is None:
            raise RuntimeError(f"the job did not finish within {settings.timeout_s:.0f} s; see {logs}")
        if server.returncode != 0:
            raise RuntimeError(f"the parameter server failed (exit {server.returncode}); see {logs}")
        # Each device's final (offline) status carries its busy and idle totals.
        settle = time.monotonic() + 30
        while time.monotonic() < settle and sum(s.state == "offline" for s in statuses.values()) < settings.devices:
            drain(0.1)
        history = [Metrics.model_validate(m) for m in json.loads(server_report.read_text())]
    finally:
        watcher.close()
        for proc in processes:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=10)
    return JobResult(history, statuses)


def run_demo(settings: DemoSettings, json_path: str | None = None, quiet: bool = False) -> dict[str, Any]:
    """Run the whole job; return the report (also written to OUT/report.json and OUT/accuracy.png)."""
    started = time.monotonic()
    out = settings.out
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    say = (lambda *a, **k: None) if quiet else print
    c_device = None
    if settings.embedded_devices:
        if not 0 < settings.embedded_devices <= settings.devices or settings.arch != "mlp":
            raise ValueError(f"--embedded-devices {settings.embedded_devices}: 1 to --devices ({settings.devices}) "
                             "C devices, with --arch mlp (the C trainer is the MLP)")  # fmt: skip
        from edgeps.embedded import build_device

        say("building edgeps-device, the C SDK's device ...")
        c_device = build_device(out / "sdk")
    shards = prepare_shards(load_digits(), out / "data", settings.devices, settings.alpha, settings.seed)
    say(f"data: digits, {settings.devices} devices, Dirichlet alpha {settings.alpha}; files under {out}/")
    if c_device is not None:
        from learning.data import Dataset
        from schemas.frame import encode_data_frame

        for shard in shards.devices[settings.devices - settings.embedded_devices :]:
            data = Dataset.load(shard)
            shard.with_suffix(".epsf").write_bytes(encode_data_frame(data.x, data.y))
        say(f"devices: {settings.devices - settings.embedded_devices} edgeps client, "
            f"{settings.embedded_devices} edgeps-device (C)")  # fmt: skip

    broker: BrokerProcess | None = None
    if settings.broker:
        address = BrokerAddress.parse(settings.broker)
    else:
        broker = start_broker(workdir=out / "broker", embedded=True if settings.embedded_broker else None)
        address = BrokerAddress(broker.host, broker.port)
        how = "with broker/mosquitto.conf" if broker.kind == "mosquitto" else "(embedded fallback)"
        say(f"broker: {broker.kind} on {broker.host}:{broker.port} {how}")
        if settings.metrics_port and broker.ws_port:
            say(f"dashboard: http://127.0.0.1:{settings.metrics_port}/?job={settings.job}"
                f"&broker=ws://{broker.host}:{broker.ws_port}")  # fmt: skip
    try:
        result = run_local_job(settings, address, shards, logs, quiet=quiet, c_device=c_device)
    finally:
        if broker is not None:
            broker.stop()

    settings_dict = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()}
    report = build_report(result.history, time.monotonic() - started, settings_dict)
    report["idle_fraction"] = round(result.idle_fraction, 4)
    report["device_backends"] = dict(Counter(s.backend for s in result.statuses.values()))
    write_json(report, out / "report.json")
    if json_path:
        write_json(report, json_path)
    plot_accuracy(report, out / "accuracy.png", title=f"edgeps demo: {settings.devices} devices, {settings.pace}")
    say("")
    say(format_report(report))
    also = f" and {json_path}" if json_path else ""
    say(f"\nreport: {out / 'report.json'}{also}; plot: {out / 'accuracy.png'}")
    return report
