"""``edgeps demo``: a broker, the parameter server and N device processes on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker.client import BrokerAddress, MqttTransport
from broker.launcher import BrokerProcess, start_broker
from edgeps.options import nest_fields, to_flags
from edgeps.progress import JobProgress
from edgeps.report import build_report, format_report, plot_curves, read_metrics, write_json
from edgeps.sdk.build import C_LOSSES
from edgeps.task import Task, builtin_task, load_task
from learning.data import Dataset
from learning.prepare import ShardPaths, prepare_device_shards, prepare_shards
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


def build_demo_firmware(settings: DemoSettings, task: Any, shards: ShardPaths, out: Path, say: Any) -> dict[int, Path]:
    """The firmware images of the last ``settings.firmware_devices`` devices, a Cortex-M4F and an
    RV32IMAC in turn (their shards in flash, the arena sized for the job's model and codecs): each
    image's folder, by device index. ValueError in one line when this machine cannot build them."""
    from edgeps.firmware import BOARDS, build_image, check_tools

    first = settings.devices - settings.firmware_devices
    boards = {i: list(BOARDS)[k % len(BOARDS)] for k, i in enumerate(range(first, settings.devices))}
    for board in sorted(set(boards.values())):
        check_tools(board)
    say(f"building {settings.firmware_devices} firmware images ({', '.join(boards.values())}) ...")
    holdout = Dataset.load(shards.holdout)
    sizes = [holdout.x.shape[1], *(int(h) for h in task.model.hidden.split(",")), holdout.classes]
    images = {}
    for i, board in boards.items():
        data = Dataset.load(shards.devices[i])
        name = f"dev-{i:02d}"
        build_image(
            out / name,
            board,
            settings.server.job,
            name,
            data.x.astype("float32"),
            data.y.astype("float32"),
            sizes,
            settings.server.codec,
            settings.server.pull_codec,
            seed=settings.seed + i,
        )
        images[i] = out / name
    return images


def _an_mlp(task: Task) -> bool:
    """Whether the task's model is an MLP, which the C trainer runs: the built-in one, or a Keras
    model whose layers convert to it (Dense layers only)."""
    if isinstance(task.model, ModelSpec):
        return task.model.arch == "mlp"
    if task.keras_model is None:
        return False
    from learning.keras import KerasError, from_keras
    from learning.model import architecture

    try:
        return architecture(from_keras(task.keras_model, task.loss)) == "mlp"
    except KerasError:
        return False  # refused with its reason when the job starts


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
    topics = Topics(job)
    watcher = MqttTransport(
        address, f"edgeps-watch-{job}-{os.getpid()}", [topics.metrics, topics.all_status], persistent=False
    )
    processes: list[subprocess.Popen[bytes]] = []
    progress = JobProgress(settings.server.rounds, settings.devices, quiet=quiet)
    devices: dict[str, subprocess.Popen[bytes]] = {}
    statuses: dict[str, DeviceStatus] = {}
    try:
        watcher.wait_connected(10)
        common = ["--broker", f"{address.host}:{address.port}", "--job", settings.server.job]
        devices_at = device_address or address
        device_common = ["--broker", f"{devices_at.host}:{devices_at.port}", "--job", settings.server.job]
        server_report = logs / f"{settings.server.job}-metrics.json"
        server_args = [
            "ps",
            *common,
            *to_flags(settings.server, ("job", "min_devices"), PROCESS_DEFAULTS),
            *to_flags(settings.model),
            "--seed",
            str(settings.seed),
            "--eval-data",
            str(shards.holdout),
            "--report",
            str(server_report),
            "--save-model",
            str(logs.parent / "model.npz"),
            "--min-devices",
            str(settings.devices),
        ]
        task = ["--task", str(settings.task)] if settings.task is not None else []
        server_args += task
        if settings.backend != "numpy":
            server_args.append("--export-tflite")
        if settings.metrics_port is not None:
            server_args += ["--metrics-port", str(settings.metrics_port)]
            server_args += ["--dashboard-broker", dashboard_broker] if dashboard_broker else []
        server_log = logs / f"{settings.server.job}-ps.log"
        server = spawn(server_args, server_log)
        processes.append(server)
        try:
            _wait_for_fresh_start(watcher, topics, server, time.monotonic() + 60)
        except RuntimeError as exc:  # the reason is in its log: say it here
            raise RuntimeError(f"{exc}: {last_error(server_log)} (log: {server_log})") from None
        for i, shard in enumerate(shards.devices):
            name = f"dev-{i:02d}"
            slowdown = settings.slowdowns[i] if i < len(settings.slowdowns) else 1.0
            if i in firmware:  # a firmware image under QEMU, its UART joined to the broker
                from edgeps.firmware import run_image

                log = logs / f"{settings.server.job}-{name}.log"
                devices[name] = run_image(firmware[i], devices_at.host, devices_at.port, log)
                processes.append(devices[name])
                continue
            if c_device is not None and i >= settings.devices - settings.embedded_devices - settings.firmware_devices:
                device = [
                    *device_common,
                    "--device",
                    name,
                    "--data",
                    str(shard.with_suffix(".epsf")),
                    "--seed",
                    str(settings.seed + i),
                    "--step-time",
                    str(settings.step_time * slowdown),
                ]
                devices[name] = spawn(device, logs / f"{settings.server.job}-{name}.log", program=c_device)
                processes.append(devices[name])
                continue
            device = [
                "client",
                *device_common,
                "--device",
                name,
                "--data",
                str(shard),
                "--seed",
                str(settings.seed + i),
                "--slowdown",
                str(slowdown),
                "--step-time",
                str(settings.step_time),
                "--backend",
                settings.backend,
                "--cache",
                str(logs.parent / "artifacts" / name),
                *task,
            ]
            devices[name] = spawn(device, logs / f"{settings.server.job}-{name}.log")
            processes.append(devices[name])
        if not quiet:
            print(
                f"started the parameter server ({settings.server.pace}) and {settings.devices} devices; logs in {logs}/"
            )

        deadline = time.monotonic() + settings.timeout_s

        def drain(timeout: float) -> None:
            inbound = watcher.receive(timeout=timeout)
            if inbound is None:
                return
            try:
                if inbound.topic == topics.metrics:
                    progress.update(Metrics.from_bytes(inbound.payload))
                elif inbound.payload:
                    status = DeviceStatus.from_bytes(inbound.payload)
                    statuses[status.device] = status
            except MessageError:
                pass

        while server.poll() is None and time.monotonic() < deadline:
            drain(0.2)
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
        while time.monotonic() < settle and sum(s.state == "offline" for s in statuses.values()) < settings.devices:
            drain(0.1)
        history = read_metrics(server_report)
    finally:
        watcher.close()
        progress.close()
        for proc in processes:  # all told at once, then 10 s for all of them together, then killed
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in processes:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return JobResult(history, statuses)


def run_demo(
    settings: DemoSettings, json_path: str | None = None, quiet: bool = False, device_broker: str | None = None
) -> dict[str, Any]:
    """Run the whole job; return the report (also written to OUT/report.json and OUT/curves.png).
    ``device_broker``: where the devices connect, if not where the server does (a relay)."""
    started = time.monotonic()
    out = settings.out
    logs = out / "logs"  # made once the settings are known to be good
    say = (lambda *a, **k: None) if quiet else print
    if settings.metrics_port:  # the server's endpoint: a port in use is refused before anything starts
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", settings.metrics_port))
            except OSError as exc:
                raise ValueError(f"--metrics-port {settings.metrics_port}: {exc.strerror or exc}") from None
    if settings.task is not None:  # refused before anything starts
        task = load_task(settings.task)
        settings = settings.model_copy(update={"server": settings.server.model_copy(update=task.server_options())})
    else:  # the built-in job: examples/digits.py, with the model and job options of the flags
        task = builtin_task(settings.model, settings.server.loss, settings.server.metric_names)
    c_device = None
    firmware: dict[int, Path] = {}
    if settings.firmware_devices:
        mlp = isinstance(task.model, ModelSpec) and task.model.arch == "mlp"
        k = settings.firmware_devices
        if not 0 < k <= settings.devices - settings.embedded_devices or not mlp or settings.server.loss not in C_LOSSES:
            raise ValueError(
                f"--firmware-devices {k}: 1 to --devices ({settings.devices}) less --embedded-devices "
                f"firmware devices, with the built-in MLP and loss {' or '.join(C_LOSSES)}"
            )
    if settings.embedded_devices:
        mlp = _an_mlp(task)
        if not 0 < settings.embedded_devices <= settings.devices or not mlp or settings.server.loss not in C_LOSSES:
            raise ValueError(
                f"--embedded-devices {settings.embedded_devices}: 1 to --devices ({settings.devices}) C devices, "
                f"with an MLP (the built-in one, or Keras Dense layers) and loss {' or '.join(C_LOSSES)} "
                "(the C trainer's)"
            )
        from edgeps.sdk.build import build_device

        say("building edgeps-device, the C SDK's device ...")
        c_device = build_device(out / "sdk")
    data, devices = task.dataset()
    if devices is not None:  # split by the gateway each row came from
        shards = prepare_device_shards(data, devices, out / "data", settings.seed)
        settings = settings.model_copy(update={"devices": len(shards.devices)})
    else:
        shards = prepare_shards(data, out / "data", settings.devices, settings.alpha, settings.seed)
    task.init(Dataset.load(shards.holdout), settings.seed)  # a model that does not fit: refused now
    logs.mkdir(parents=True, exist_ok=True)
    how = "one shard per device column value" if devices is not None else f"Dirichlet alpha {settings.alpha}"
    say(f"data: {settings.task or 'digits'}, {len(data)} rows, {settings.devices} devices ({how}); files under {out}/")
    if settings.firmware_devices:
        firmware = build_demo_firmware(settings, task, shards, out / "firmware", say)
    if c_device is not None:
        from schemas.frame import encode_data_frame

        first_c = settings.devices - settings.embedded_devices - settings.firmware_devices
        for shard in shards.devices[first_c : settings.devices - settings.firmware_devices]:
            data = Dataset.load(shard)
            shard.with_suffix(".epsf").write_bytes(encode_data_frame(data.x, data.y))
        say(
            f"devices: {settings.devices - settings.embedded_devices - settings.firmware_devices} edgeps client, "
            f"{settings.embedded_devices} edgeps-device (C)"
        )
    if firmware:
        say(f"devices: {settings.firmware_devices} firmware images under QEMU, their UART on the broker")

    broker: BrokerProcess | None = None
    dashboard_broker = None
    if settings.broker:
        address = BrokerAddress.parse(settings.broker)
        if settings.metrics_port:
            dashboard_broker = settings.dashboard_broker or f"ws://{address.host}:9001"
            said = "" if settings.dashboard_broker else " (edgeps broker's WebSocket port; another: --dashboard-broker)"
            say(
                f"dashboard: http://127.0.0.1:{settings.metrics_port}/?job={settings.server.job}"
                f"&broker={dashboard_broker}{said}"
            )
    else:
        broker = start_broker(workdir=out / "broker", embedded=True if settings.embedded_broker else None)
        address = BrokerAddress(broker.host, broker.port)
        how = "with broker/mosquitto.conf" if broker.kind == "mosquitto" else "(embedded fallback)"
        say(f"broker: {broker.kind} on {broker.host}:{broker.port} {how}")
        if settings.metrics_port and broker.ws_port:
            dashboard_broker = f"ws://{broker.host}:{broker.ws_port}"
            say(
                f"dashboard: http://127.0.0.1:{settings.metrics_port}/?job={settings.server.job}"
                f"&broker={dashboard_broker}"
            )
    try:
        devices_at = BrokerAddress.parse(device_broker) if device_broker else None
        result = run_local_job(
            settings,
            address,
            shards,
            logs,
            quiet=quiet,
            c_device=c_device,
            dashboard_broker=dashboard_broker,
            device_address=devices_at,
            firmware=firmware,
        )
    finally:
        if broker is not None:
            broker.stop()

    settings_dict = settings.model_dump(mode="json")
    report = build_report(result.history, time.monotonic() - started, settings_dict)
    report["idle_fraction"] = round(result.idle_fraction, 4)
    report["device_backends"] = dict(
        Counter(
            s.backend if s.error is None else f"{s.backend} (could not take part)" for s in result.statuses.values()
        )
    )
    write_json(report, out / "report.json")
    if json_path:
        write_json(report, json_path)
    title = f"edgeps demo: {settings.devices} devices, {settings.server.pace}"
    plot_curves(report, out / "curves.png", title=title)
    say("")
    if not quiet:
        format_report(report).print()
    also = f" and {json_path}" if json_path else ""
    say(
        f"\nreport: {out / 'report.json'}{also}; plot: {out / 'curves.png'}; models: {out / 'model.npz'} (final), "
        f"{out / 'model-best.npz'} (best; edgeps predict --model FILE --csv READINGS)"
    )
    return report
