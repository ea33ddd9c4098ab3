"""A local job's processes: the parameter server and one process per device (the Python client, the
C device, or a firmware image under QEMU) started against a broker, watched until the job ends,
then stopped, all of them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker.client import BrokerAddress, MqttTransport
from edgeps.options import nest_fields, to_flags
from edgeps.progress import JobProgress
from edgeps.report import read_metrics
from learning.prepare import ShardPaths
from learning.spec import ModelSpec
from ps_service.config import PROCESS_DEFAULTS, ServerConfig
from schemas.messages import DeviceStatus, MessageError, Metrics
from schemas.topics import Topics


class DemoSettings(BaseModel):
    """One local job: the job's options (``server``), the model, the fleet, its data, where the
    files go. ``edgeps demo`` derives its flags from it (edgeps/options.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    server: ServerConfig = ServerConfig(**PROCESS_DEFAULTS)
    model: ModelSpec = ModelSpec()
    devices: int = Field(8, ge=1, description="device processes")
    alpha: float = Field(0.5, gt=0, description="Dirichlet non-IID concentration of the device shards")
    seed: int = Field(0, description="seed of the data split, the model and the devices")
    backend: Literal["numpy", "tflite", "auto"] = Field(
        "numpy", description="devices' trainer; tflite/auto: the server exports a TFLite trainer (needs the tf extra)"
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="serve Prometheus metrics and the dashboard on this port"
    )
    task: Path | None = Field(
        None,
        description="a task file: the model, loss, metrics and data (docs/TASKS.md); default: the built-in digits job",
    )
    out: Path = Field(Path("edgeps-demo"), description="folder for data shards, logs, report.json, curves.png")
    broker: str | None = Field(None, description="use this HOST:PORT instead of starting a broker")
    dashboard_broker: str | None = Field(
        None,
        description="with --broker and --metrics-port: the broker's "
        "WebSocket URL the dashboard connects to (default: ws://HOST:9001, "
        "edgeps broker's)",
    )
    embedded_broker: bool = Field(False, description="use the embedded amqtt broker")
    embedded_devices: int = Field(
        0, ge=0, description="run the last K devices as edgeps-device, the C SDK's (built into OUT/sdk on the fly)"
    )
    firmware_devices: int = Field(
        0,
        ge=0,
        description="run the last K devices as firmware images of the C SDK "
        "under QEMU, a Cortex-M4F and an RV32IMAC in turn, their UART joined to the "
        "broker (built into OUT/firmware)",
    )
    timeout_s: float = Field(600.0, gt=0, description="give up on the job after this many seconds")
    #: Per-device compute slowdown factors (missing devices: 1.0).
    slowdowns: tuple[float, ...] = ()
    #: Emulated compute seconds per local step on a reference device.
    step_time: float = Field(0.0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _flat_fields(cls, data: Any) -> Any:
        """Flat job and model fields (``rounds=15``, ``hidden="32"``) become ``server``'s and ``model``'s."""
        data = nest_fields(data, cls, "server", ServerConfig, ServerConfig(**PROCESS_DEFAULTS))
        return nest_fields(data, cls, "model", ModelSpec, ModelSpec())


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


def spawn(args: list[str], log_path: Path, program: Path | None = None) -> subprocess.Popen[bytes]:
    """``edgeps ARGS`` (or ``program ARGS``) as a child process, its output to ``log_path``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    command = [str(program)] if program is not None else [sys.executable, "-m", "edgeps.cli"]
    with open(log_path, "wb") as log:
        return subprocess.Popen([*command, *args], stdout=log, stderr=log, env=env)


def last_error(log: Path) -> str:
    """The last line a process logged (an error's message without the log's time and level)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    return lines[-1].split(" ERROR ", 1)[-1] if lines else "no output"


def _wait_for_fresh_start(
    watcher: MqttTransport, topics: Topics, server: subprocess.Popen[bytes], deadline: float
) -> None:
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
        raise RuntimeError(f"the parameter server exited before it started (exit {server.returncode})")  # + its log
    raise RuntimeError("the parameter server did not publish its first metrics within 60 s")


def server_command(settings: DemoSettings, address: BrokerAddress, shards: ShardPaths, logs: Path) -> list[str]:
    """``edgeps ps``'s arguments for the demo's job (its report and models under ``logs``' parent)."""
    job = settings.server.job
    args = [
        "ps",
        *["--broker", f"{address.host}:{address.port}", "--job", job],
        *to_flags(settings.server, ("job", "min_devices"), PROCESS_DEFAULTS),
        *to_flags(settings.model),
        *["--seed", str(settings.seed), "--eval-data", str(shards.holdout)],
        *["--report", str(logs / f"{job}-metrics.json"), "--save-model", str(logs.parent / "model.npz")],
        *["--min-devices", str(settings.devices)],
    ]
    args += ["--task", str(settings.task)] if settings.task is not None else []
    if settings.backend != "numpy":
        args.append("--export-tflite")
    return args


def device_command(
    settings: DemoSettings, i: int, shard: Path, address: BrokerAddress, logs: Path, c_device: Path | None
) -> tuple[list[str], Path | None]:
    """Device ``i``'s arguments and program (None: ``edgeps client``; else the C device)."""
    name, job = f"dev-{i:02d}", settings.server.job
    common = ["--broker", f"{address.host}:{address.port}", "--job", job, "--device", name]
    slowdown = settings.slowdowns[i] if i < len(settings.slowdowns) else 1.0
    if c_device is not None and i >= settings.devices - settings.embedded_devices - settings.firmware_devices:
        step = str(settings.step_time * slowdown)
        return [
            *common,
            "--data",
            str(shard.with_suffix(".epsf")),
            "--seed",
            str(settings.seed + i),
            "--step-time",
            step,
        ], c_device
    task = ["--task", str(settings.task)] if settings.task is not None else []
    return [
        "client",
        *common,
        *["--data", str(shard), "--seed", str(settings.seed + i)],
        *["--slowdown", str(slowdown), "--step-time", str(settings.step_time), "--backend", settings.backend],
        *["--cache", str(logs.parent / "artifacts" / name), *task],
    ], None


def stop_all(processes: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """All told at once, then ``grace_s`` for all of them together, then killed."""
    for proc in processes:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in processes:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Watcher:
    """The job seen from the broker: its metrics (shown as progress) and each device's newest status."""

    def __init__(self, address: BrokerAddress, topics: Topics, progress: JobProgress) -> None:
        self.topics, self.progress = topics, progress
        self.statuses: dict[str, DeviceStatus] = {}
        client_id = f"edgeps-watch-{topics.job}-{os.getpid()}"
        self.transport = MqttTransport(address, client_id, [topics.metrics, topics.all_status], persistent=False)

    def drain(self, timeout: float) -> None:
        inbound = self.transport.receive(timeout=timeout)
        if inbound is None:
            return
        try:
            if inbound.topic == self.topics.metrics:
                self.progress.update(Metrics.from_bytes(inbound.payload))
            elif inbound.payload:
                status = DeviceStatus.from_bytes(inbound.payload)
                self.statuses[status.device] = status
        except MessageError:
            pass


def run_local_job(
    settings: DemoSettings,
    address: BrokerAddress,
    shards: ShardPaths,
    logs: Path,
    quiet: bool = True,
    c_device: Path | None = None,
    dashboard_broker: str | None = None,
    device_address: BrokerAddress | None = None,
    firmware: dict[int, Path] | None = None,
) -> JobResult:
    """Run the parameter server and one process per device against ``address`` until the job ends
    (the devices against ``device_address`` where given: a relay to the same broker); device i of
    ``firmware`` is that image under QEMU."""
    firmware = firmware or {}
    logs.mkdir(parents=True, exist_ok=True)
    job = settings.server.job
    watcher = Watcher(address, Topics(job), JobProgress(settings.server.rounds, settings.devices, quiet=quiet))
    processes: list[subprocess.Popen[bytes]] = []
    devices: dict[str, subprocess.Popen[bytes]] = {}
    try:
        watcher.transport.wait_connected(10)
        server_args = server_command(settings, address, shards, logs)
        if settings.metrics_port is not None:
            server_args += ["--metrics-port", str(settings.metrics_port)]
            server_args += ["--dashboard-broker", dashboard_broker] if dashboard_broker else []
        server_log = logs / f"{job}-ps.log"
        server = spawn(server_args, server_log)
        processes.append(server)
        try:
            _wait_for_fresh_start(watcher.transport, watcher.topics, server, time.monotonic() + 60)
        except RuntimeError as exc:  # the reason is in its log: say it here
            raise RuntimeError(f"{exc}: {last_error(server_log)} (log: {server_log})") from None
        devices_at = device_address or address
        for i, shard in enumerate(shards.devices):
            name = f"dev-{i:02d}"
            log = logs / f"{job}-{name}.log"
            if i in firmware:  # a firmware image under QEMU, its UART joined to the broker
                from edgeps.firmware import run_image

                devices[name] = run_image(firmware[i], devices_at.host, devices_at.port, log)
            else:
                args, program = device_command(settings, i, shard, devices_at, logs, c_device)
                devices[name] = spawn(args, log, program=program)
            processes.append(devices[name])
        if not quiet:
            print(
                f"started the parameter server ({settings.server.pace}) and {settings.devices} devices; logs in {logs}/"
            )
        _until_the_end(settings, server, devices, watcher, logs)
        history = read_metrics(logs / f"{job}-metrics.json")
    finally:
        watcher.transport.close()
        watcher.progress.close()
        stop_all(processes)
    return JobResult(history, watcher.statuses)


def _until_the_end(
    settings: DemoSettings,
    server: subprocess.Popen[bytes],
    devices: dict[str, subprocess.Popen[bytes]],
    watcher: Watcher,
    logs: Path,
) -> None:
    """Follow the job until the server exits; RuntimeError naming why where it fails or a device stops."""
    deadline = time.monotonic() + settings.timeout_s
    while server.poll() is None and time.monotonic() < deadline:
        watcher.drain(0.2)
        failed = next((name for name, proc in devices.items() if proc.poll() not in (None, 0)), None)
        if failed is not None:  # it will not come back: say why, rather than wait for the deadline
            log = logs / f"{settings.server.job}-{failed}.log"
            raise RuntimeError(f"device {failed} stopped: {last_error(log)} (log: {log})")
    if server.poll() is None:
        raise RuntimeError(f"the job did not finish within {settings.timeout_s:.0f} s; see {logs}")
    if server.returncode != 0:
        raise RuntimeError(f"the parameter server failed (exit {server.returncode}); see {logs}")
    # Each device's final (offline) status carries its busy and idle totals.
    settle = time.monotonic() + 30
    while time.monotonic() < settle and _offline(watcher.statuses) < settings.devices:
        watcher.drain(0.1)


def _offline(statuses: dict[str, DeviceStatus]) -> int:
    return sum(status.state == "offline" for status in statuses.values())
