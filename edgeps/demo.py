"""``edgeps demo``: a broker, the parameter server and N device processes on loopback."""

from __future__ import annotations

import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

from broker.client import BrokerAddress
from broker.launcher import BrokerProcess, start_broker
from edgeps.localjob import DemoSettings, JobResult, run_local_job
from edgeps.report import build_report, format_report, plot_curves, write_json
from edgeps.sdk.build import C_LOSSES
from edgeps.task import Task, builtin_task, load_task
from learning.data import Dataset
from learning.prepare import ShardPaths, prepare_device_shards, prepare_shards
from learning.spec import ModelSpec


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


def run_demo(
    settings: DemoSettings, json_path: str | None = None, quiet: bool = False, device_broker: str | None = None
) -> dict[str, Any]:
    """Run the whole job; return the report (also written to OUT/report.json and OUT/curves.png).
    ``device_broker``: where the devices connect, if not where the server does (a relay)."""
    started = time.monotonic()
    out = settings.out
    say = (lambda *a, **k: None) if quiet else print
    settings, task = _checked(settings)  # refused before anything starts
    c_device = None
    if settings.embedded_devices:
        from edgeps.sdk.build import build_device

        say("building edgeps-device, the C SDK's device ...")
        c_device = build_device(out / "sdk")
    settings, shards = _shards(settings, task, say)
    firmware = build_demo_firmware(settings, task, shards, out / "firmware", say) if settings.firmware_devices else {}
    if c_device is not None:
        _c_shards(settings, shards, say)
    if firmware:
        say(f"devices: {settings.firmware_devices} firmware images under QEMU, their UART on the broker")
    broker, address, dashboard_broker = _broker(settings, say)
    try:
        devices_at = BrokerAddress.parse(device_broker) if device_broker else None
        result = run_local_job(
            settings,
            address,
            shards,
            out / "logs",
            quiet=quiet,
            c_device=c_device,
            dashboard_broker=dashboard_broker,
            device_address=devices_at,
            firmware=firmware,
        )
    finally:
        if broker is not None:
            broker.stop()
    return _report(settings, result, time.monotonic() - started, json_path, quiet, say)


def _checked(settings: DemoSettings) -> tuple[DemoSettings, Task]:
    """The settings with the task's job options, and the task; ValueError for what cannot run."""
    if settings.metrics_port:  # the server's endpoint: a port in use is refused before anything starts
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", settings.metrics_port))
            except OSError as exc:
                raise ValueError(f"--metrics-port {settings.metrics_port}: {exc.strerror or exc}") from None
    if settings.task is not None:
        task = load_task(settings.task)
        settings = settings.model_copy(update={"server": settings.server.model_copy(update=task.server_options())})
    else:  # the built-in job: examples/digits.py, with the model and job options of the flags
        task = builtin_task(settings.model, settings.server.loss, settings.server.metric_names)
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
    return settings, task


def _shards(settings: DemoSettings, task: Task, say: Any) -> tuple[DemoSettings, ShardPaths]:
    """The task's data split into the held-out set and a shard per device (by the rows' device
    column where it has one: the settings then count those devices)."""
    out = settings.out
    data, devices = task.dataset()
    if devices is not None:  # split by the gateway each row came from
        shards = prepare_device_shards(data, devices, out / "data", settings.seed)
        settings = settings.model_copy(update={"devices": len(shards.devices)})
    else:
        shards = prepare_shards(data, out / "data", settings.devices, settings.alpha, settings.seed)
    task.init(Dataset.load(shards.holdout), settings.seed)  # a model that does not fit: refused now
    (out / "logs").mkdir(parents=True, exist_ok=True)
    how = "one shard per device column value" if devices is not None else f"Dirichlet alpha {settings.alpha}"
    say(f"data: {settings.task or 'digits'}, {len(data)} rows, {settings.devices} devices ({how}); files under {out}/")
    return settings, shards


def _c_shards(settings: DemoSettings, shards: ShardPaths, say: Any) -> None:
    """The C devices' shards as data frames (``.epsf``) beside their ``.npz``."""
    from schemas.frame import encode_data_frame

    first_c = settings.devices - settings.embedded_devices - settings.firmware_devices
    for shard in shards.devices[first_c : settings.devices - settings.firmware_devices]:
        data = Dataset.load(shard)
        shard.with_suffix(".epsf").write_bytes(encode_data_frame(data.x, data.y))
    say(f"devices: {first_c} edgeps client, {settings.embedded_devices} edgeps-device (C)")


def _broker(settings: DemoSettings, say: Any) -> tuple[BrokerProcess | None, BrokerAddress, str | None]:
    """The broker (started, unless ``--broker`` names one), its address, and the WebSockets address the
    dashboard follows the job at (with ``--metrics-port``)."""
    page = f"dashboard: http://127.0.0.1:{settings.metrics_port}/?job={settings.server.job}"
    if settings.broker:
        address = BrokerAddress.parse(settings.broker)
        if not settings.metrics_port:
            return None, address, None
        given = settings.dashboard_broker or f"ws://{address.host}:9001"
        said = "" if settings.dashboard_broker else " (edgeps broker's WebSocket port; another: --dashboard-broker)"
        say(f"{page}&broker={given}{said}")
        return None, address, given
    broker = start_broker(workdir=settings.out / "broker", embedded=True if settings.embedded_broker else None)
    how = "with broker/mosquitto.conf" if broker.kind == "mosquitto" else "(embedded fallback)"
    say(f"broker: {broker.kind} on {broker.host}:{broker.port} {how}")
    ws = f"ws://{broker.host}:{broker.ws_port}" if settings.metrics_port and broker.ws_port else None
    if ws is not None:
        say(f"{page}&broker={ws}")
    return broker, BrokerAddress(broker.host, broker.port), ws


def _report(
    settings: DemoSettings, result: JobResult, seconds: float, json_path: str | None, quiet: bool, say: Any
) -> dict[str, Any]:
    """The job's report, written to OUT/report.json (and ``json_path``) with its plot, and shown."""
    out = settings.out
    report = build_report(result.history, seconds, settings.model_dump(mode="json"))
    report["idle_fraction"] = round(result.idle_fraction, 4)
    backends = (
        s.backend if s.error is None else f"{s.backend} (could not take part)" for s in result.statuses.values()
    )
    report["device_backends"] = dict(Counter(backends))
    write_json(report, out / "report.json")
    if json_path:
        write_json(report, json_path)
    plot_curves(report, out / "curves.png", title=f"edgeps demo: {settings.devices} devices, {settings.server.pace}")
    say("")
    if not quiet:
        format_report(report).print()
    also = f" and {json_path}" if json_path else ""
    say(
        f"\nreport: {out / 'report.json'}{also}; plot: {out / 'curves.png'}; models: {out / 'model.npz'} (final), "
        f"{out / 'model-best.npz'} (best; edgeps predict --model FILE --csv READINGS)"
    )
    return report
