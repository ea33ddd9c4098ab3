"""Whole jobs over a real Mosquitto started from the project's config."""

from __future__ import annotations

import json
import threading
import time
from threading import Event

import numpy as np

from broker.client import BrokerAddress, MqttTransport
from edge_client.backend import make_trainer
from edge_client.core import DeviceCore
from edge_client.mqtt import connect_device, run_device
from edge_client.trainer import NumpyTrainer
from edgeps.demo import run_demo
from edgeps.localjob import DemoSettings
from edgeps.report import read_metrics
from learning.data import Dataset, load_digits
from learning.model import init_mlp
from learning.prepare import prepare_shards
from ps_service.config import ServerConfig
from ps_service.evaluator import Evaluator
from ps_service.io.mqtt import connect_server, serve
from ps_service.server.core import ServerCore
from schemas.frame import decode_frame
from schemas.messages import DeviceStatus, Metrics, Notice
from schemas.topics import Publish
from tests.helpers import commit_bytes, next_message, wait_until


def start_server(
    address: BrokerAddress, holdout: Dataset, artifact: bytes | None = None, params=None, **config
) -> tuple[ServerCore, threading.Thread, threading.Event]:
    """A ServerCore serving over MQTT in a thread; its model ``params`` (default: an MLP, 32 hidden)."""
    if params is None:
        params = init_mlp([holdout.x.shape[1], 32, holdout.classes], seed=0)
    core = ServerCore(ServerConfig(**config), params, Evaluator(holdout, clock=time.perf_counter), artifact=artifact)
    transport = connect_server(core, address)
    stop = Event()

    def main() -> None:
        try:
            serve(core, transport, stop=stop, linger_s=0.2)
        finally:
            transport.close()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return core, thread, stop


def start_device(
    job: str, name: str, data: Dataset, address: BrokerAddress, seed: int = 0, **run: object
) -> tuple[DeviceCore, threading.Thread]:
    """A numpy DeviceCore ``name`` of ``job`` on ``data``, run over MQTT in a thread (``run``: run_device's)."""
    device = DeviceCore(job, name, data, NumpyTrainer(), seed=seed)
    runner = threading.Thread(
        target=run_device, args=(device, connect_device(device, address)), kwargs=run, daemon=True
    )
    runner.start()
    return device, runner


def run_job(
    mosquitto, tmp_path, devices: int, backend: str = "numpy", artifact: bytes | None = None, **config
) -> tuple[ServerCore, list[DeviceCore]]:
    """A server and ``devices`` device threads on digits shards, run until the job ends."""
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    shards = prepare_shards(load_digits(), tmp_path, devices=devices, alpha=0.5, seed=0)
    server, server_thread, _ = start_server(address, Dataset.load(shards.holdout), artifact, **config)
    job = config["job"]
    trainer, artifact_trainer = make_trainer(backend)
    cores = [
        DeviceCore(job, f"dev-{i}", Dataset.load(p), trainer, seed=i, artifact_trainer=artifact_trainer)
        for i, p in enumerate(shards.devices)
    ]
    threads = [threading.Thread(target=run_device, args=(d, connect_device(d, address)), daemon=True) for d in cores]
    for thread in threads:
        thread.start()
    server_thread.join(timeout=120)
    for thread in threads:
        thread.join(timeout=30)
    return server, cores


def test_bsp_job_over_mosquitto_trains_digits(mosquitto, tmp_path) -> None:
    server, devices = run_job(mosquitto, tmp_path, 4, job="it", rounds=25, lr=0.2)
    assert server.finished and server.store.version == 25
    assert max(m.accuracy for m in server.history) > 0.85
    # bsp: every round took one commit of each device, nothing before the end was refused; a commit that
    # crossed the last version on its way is refused as `finished` (docs/PROTOCOL.md, Notice reasons), as devices learn
    # of the end from the barrier that follows the last parameters
    assert server.traffic.applied == 4 * 25 and set(server.traffic.rejected) <= {"finished"}
    assert all(d.finished for d in devices)


def test_bad_frames_from_a_raw_client_are_rejected_and_the_model_is_unchanged(mosquitto) -> None:
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    holdout = load_digits()
    server, thread, stop = start_server(address, holdout, job="bad", pace="bsp", rounds=50)
    t = server.topics
    raw = MqttTransport(address, "raw-attacker", [t.notice("evil"), t.params, t.metrics], persistent=False)
    raw.wait_connected(10)
    inbox: list = []

    def collect(predicate) -> list:
        while (m := raw.receive(0.05)) is not None:
            inbox.append(m)
            raw.ack(m)
        return [m for m in inbox if predicate(m)]

    def notices() -> list[str]:
        return [Notice.from_bytes(m.payload).reason.value for m in collect(lambda m: m.topic == t.notice("evil"))]

    wait_until(lambda: bool(collect(lambda m: m.topic == t.params)), what="retained parameters")
    snapshot = collect(lambda m: m.topic == t.params)[0].payload

    # Before its hello the server does not listen to its commits: the broker drops this one (no
    # count below, no notice), and a flood from a device nobody knows costs the server nothing.
    raw.publish(Publish(t.grad("evil"), commit_bytes(server, "evil", 1)))
    raw.publish(
        Publish(
            t.status("evil"),
            DeviceStatus(device="evil", state="online", incarnation=1, samples=5).to_bytes(),
            retain=True,
        )
    )
    wait_until(lambda: server.registry.known("evil"), what="hello processed")

    nan = {name: np.full(shape, np.nan, np.float32) for name, shape in server.store.shapes.items()}
    bad = [
        ("malformed", b"\x00\x01 not a frame"),
        ("device_mismatch", commit_bytes(server, "other", 2)),
        ("shape_mismatch", commit_bytes(server, "evil", 3, tensors={"w": np.zeros(3, np.float32)})),
        ("non_finite", commit_bytes(server, "evil", 4, tensors=nan)),
        ("future_version", commit_bytes(server, "evil", 5, base=7)),
        ("replayed", commit_bytes(server, "evil", 5)),
        ("out_of_order", commit_bytes(server, "evil", 2)),
    ]
    for _, payload in bad:
        raw.publish(Publish(t.grad("evil"), payload))
    expected = [reason for reason, _ in bad]
    # a number this incarnation already delivered is counted, not noticed (PROTOCOL.md §6, Restarts)
    wait_until(lambda: notices() == [r for r in expected if r != "replayed"], what="a notice per bad frame")
    assert server.store.version == 0
    assert server.store.snapshot_frame(server.run) == snapshot  # the model is unchanged, byte for byte

    # A good commit still goes through; its replay is refused; counters reach the metrics topic.
    good = commit_bytes(server, "evil", 6)
    raw.publish(Publish(t.grad("evil"), good))
    raw.publish(Publish(t.grad("evil"), good))
    wait_until(lambda: server.traffic.rejected["replayed"] == 2, what="the replay refused")
    assert notices()[-1] == "out_of_order"  # and not noticed: the device must not send its work again
    assert server.store.version == 1
    metrics = [Metrics.from_bytes(m.payload) for m in collect(lambda m: m.topic == t.metrics)]
    assert metrics[-1].version == 1
    assert metrics[-1].rejected["replayed"] == 1 and sum(metrics[-1].rejected.values()) == len(expected)
    newest = [m for m in collect(lambda m: m.topic == t.params)][-1]
    assert decode_frame(newest.payload).base_version == 1
    stop.set()
    thread.join(timeout=10)
    raw.close()


def test_demo_runs_processes_and_writes_the_report(tmp_path) -> None:
    settings = DemoSettings(devices=3, rounds=15, out=tmp_path / "demo", seed=1)
    report = run_demo(settings, json_path=str(tmp_path / "r.json"), quiet=True)
    saved = json.loads((tmp_path / "r.json").read_text())
    for key in ("best_accuracy", "final_accuracy", "rounds", "wall_s", "commits", "bytes_up", "bytes_down", "rejected"):
        assert key in saved
    assert saved["rounds"] == 15 and saved["commits"] == 3 * 15 and saved["rejected"] == 0
    assert report["best_accuracy"] > 0.7
    assert (tmp_path / "demo" / "curves.png").stat().st_size > 10_000
    with np.load(tmp_path / "demo" / "model.npz") as model:  # the final model, to deploy
        assert sorted(model.files) == ["dense0.b", "dense0.w", "dense1.b", "dense1.w"]
    # Again in the same folder: the broker's store still holds the first job's retained
    # ``finished`` barrier, which must not stop the new job's devices. acbsp this time, so that
    # its extrapolated server step (from version 10) runs over Mosquitto too.
    again = DemoSettings(devices=3, rounds=15, out=tmp_path / "demo", seed=1, pace="acbsp", timeout_s=30)
    second = run_demo(again, json_path=str(tmp_path / "r2.json"), quiet=True)
    assert second["rounds"] == 15 and second["rejected"] == 0 and second["best_accuracy"] > 0.7
    steps = [m.server_step for m in read_metrics(tmp_path / "demo" / "logs" / "demo-metrics.json")]
    assert steps[0] == 1.0 and all(step >= 1.0 for step in steps)


def test_a_crashed_device_leaves_the_barrier_through_its_last_will(mosquitto) -> None:
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    holdout = load_digits()
    server, thread, stop = start_server(address, holdout, job="will", pace="bsp", rounds=1000, min_devices=2)
    t = server.topics
    offline = DeviceStatus(device="doomed", state="offline", incarnation=1).to_bytes()
    online = DeviceStatus(device="doomed", state="online", incarnation=1, samples=50).to_bytes()
    doomed = MqttTransport(
        address,
        "doomed",
        [],
        will=Publish(t.status("doomed"), offline, retain=True),
        hello=Publish(t.status("doomed"), online, retain=True),
    )
    doomed.wait_connected(10)
    device = DeviceCore("will", "alive", Dataset(holdout.x[:100], holdout.y[:100]), NumpyTrainer())
    runner = threading.Thread(target=run_device, args=(device, connect_device(device, address)), daemon=True)
    runner.start()
    wait_until(lambda: server.round.quorum and server.pace.committed() == ["alive"], what="alive's first commit")
    assert server.store.version == 0  # the round waits for the doomed device
    doomed._client.loop_stop()  # crash: the socket drops without a DISCONNECT, so the broker sends the will
    doomed._client.socket().close()
    wait_until(lambda: server.store.version >= 2, timeout=20, what="rounds to go on without the dead device")
    assert "doomed" not in server.registry.active()
    stop.set()
    thread.join(timeout=10)
    device.finished = True
    runner.join(timeout=10)


def test_real_bench_measures_paces_over_mosquitto(tmp_path) -> None:
    from edgeps.bench.pace import run_bench_pace
    from edgeps.scenario import Scenario

    scenario = Scenario(devices=3, slow_fraction=1 / 3, step_s=0.002, duration_s=2.0, hidden=(16,), target=0.5)
    report = run_bench_pace(
        scenario,
        ["bsp", "acbsp"],
        real=True,
        json_path=str(tmp_path / "r.json"),
        plot_path=tmp_path / "r.png",
        out=tmp_path / "run",
    )
    runs = {r["pace"]: r for r in report["runs"]}
    assert set(runs) == {"bsp", "acbsp"}
    for run in runs.values():
        assert 0 <= run["idle_fraction"] <= 1 and run["commits"] > 0 and run["best_accuracy"] > 0.3
    assert runs["bsp"]["idle_fraction"] > runs["acbsp"]["idle_fraction"]
    assert json.loads((tmp_path / "r.json").read_text())["runs"][0]["pace"] == "bsp"


def test_clients_reconnect_and_say_hello_again_after_a_broker_restart(tmp_path) -> None:
    from broker.launcher import start_broker

    first = start_broker(workdir=tmp_path / "b", embedded=False)
    port = first.port
    address = BrokerAddress(first.host, port)
    hello = Publish(
        "edgeps/r/status/d1", DeviceStatus(device="d1", state="online", incarnation=1).to_bytes(), retain=True
    )
    device = MqttTransport(address, "d1", ["edgeps/r/params"], hello=hello)
    device.wait_connected(10)
    first.stop()
    wait_until(lambda: not device.connected.is_set(), what="the disconnect to be noticed")
    second = start_broker(port=port, workdir=tmp_path / "b", embedded=False)
    try:
        device.wait_connected(15)  # paho's backoff starts at 1 s
        watcher = MqttTransport(address, "watch", ["edgeps/r/status/+"], persistent=False)
        assert next_message(watcher).payload == hello.payload
        watcher.close()
        device.publish(Publish("edgeps/r/params", b"x", qos=1))
    finally:
        device.close()
        second.stop()


def test_compressed_job_over_mosquitto_keeps_replicas_bit_identical(mosquitto, tmp_path) -> None:
    config = {"job": "zip", "rounds": 20, "codec": "sign", "pull_codec": "ternary", "min_devices": 3}
    server, devices = run_job(mosquitto, tmp_path, 3, **config)
    assert server.finished and server.store.version == 20
    # nothing refused but commits that crossed the last version (`finished`, as above): every round's applied
    assert server.traffic.applied == 3 * 20 and set(server.traffic.rejected) <= {"finished"}
    assert max(m.accuracy for m in server.history) > 0.8
    view = server.broadcaster.view
    for device in devices:  # whoever holds the last version holds exactly the server's broadcast view
        if device.server_version == server.broadcaster.view_version:
            assert all(device.replica[k].tobytes() == view[k].tobytes() for k in view)
    assert any(d.server_version == server.broadcaster.view_version for d in devices)
