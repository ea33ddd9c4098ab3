"""Whole jobs over a real Mosquitto started from the project's config."""

from __future__ import annotations

import json
import threading
import time
from threading import Event

import numpy as np
import pytest

from broker.client import BrokerAddress, MqttTransport
from edge_client.backend import make_trainer
from edge_client.core import DeviceCore
from edge_client.mqtt import connect_device, run_device
from edge_client.trainer import NumpyTrainer
from edgeps.demo import DemoSettings, run_demo
from edgeps.report import read_metrics
from learning.data import Dataset, load_digits
from learning.model import init_mlp
from learning.prepare import prepare_shards
from ps_service.config import ServerConfig
from ps_service.core import ServerCore
from ps_service.evaluator import Evaluator
from ps_service.mqtt import connect_server, serve
from schemas.frame import decode_frame
from schemas.messages import DeviceStatus, Metrics, Notice
from schemas.topics import Publish
from tests.helpers import commit_bytes, next_message, stop_devices, wait_until


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
    from edgeps.simulator import Scenario

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


def test_a_job_survives_a_broker_restart_without_losing_or_repeating_a_commit(tmp_path) -> None:
    from broker.launcher import start_broker
    from edge_client.profile import DeviceProfile

    broker = start_broker(workdir=tmp_path / "broker", embedded=False)
    address = BrokerAddress(broker.host, broker.port)
    shards = prepare_shards(load_digits(), tmp_path / "data", devices=3, alpha=0.5, seed=0)
    server, server_thread, _ = start_server(address, Dataset.load(shards.holdout), job="rs", rounds=40, min_devices=3)
    cores = [DeviceCore("rs", f"d{i}", Dataset.load(p), NumpyTrainer(), seed=i) for i, p in enumerate(shards.devices)]
    profile = DeviceProfile(step_s=0.005)  # slow enough that the restart lands mid-job
    threads = [
        threading.Thread(target=run_device, args=(d, connect_device(d, address), profile), daemon=True) for d in cores
    ]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: server.store.version >= 10, timeout=60, what="ten rounds")
        broker.stop()  # Mosquitto saves its sessions and retained messages on the way down
        broker = start_broker(port=address.port, workdir=tmp_path / "broker", embedded=False)
        server_thread.join(timeout=120)
        for thread in threads:
            thread.join(timeout=30)
    finally:
        broker.stop()
    assert server.finished and server.store.version == 40
    # Every commit a device made was applied, once. (Not always 3 x 40: Mosquitto publishes the
    # devices' wills as it shuts down, so a round may close without a device, which then carries
    # its progress into its next commit instead of making one for that version.)
    made = sum(d.seq for d in cores)
    assert server.traffic.applied <= made <= server.traffic.applied + 3  # + a commit racing the end, per device
    # QoS 1 is at-least-once: a commit in flight at the restart may come again; it is refused.
    assert set(server.traffic.rejected) <= {"replayed"} and all(d.finished for d in cores)


def test_frequency_over_mosquitto_balances_a_slow_device_and_obeys_the_operator(mosquitto, tmp_path) -> None:
    from edge_client.profile import DeviceProfile
    from schemas.messages import Command

    address = BrokerAddress(mosquitto.host, mosquitto.port)
    shards = prepare_shards(load_digits(), tmp_path, devices=3, alpha=0.5, seed=0)
    config = {"job": "freq", "pace": "acbsp", "rounds": 400, "min_devices": 3, "frequency": "trend"}
    server, thread, stop = start_server(
        address, Dataset.load(shards.holdout), push_every_max=40, balance="steps", **config
    )
    cores = [
        DeviceCore("freq", f"dev-{i}", Dataset.load(p), NumpyTrainer(), seed=i) for i, p in enumerate(shards.devices)
    ]
    profiles = [DeviceProfile(step_s=0.002), DeviceProfile(step_s=0.002), DeviceProfile(step_s=0.002, slowdown=4)]
    runners = [
        threading.Thread(target=run_device, args=(d, connect_device(d, address), p), daemon=True)
        for d, p in zip(cores, profiles, strict=True)
    ]
    for runner in runners:
        runner.start()
    operator = MqttTransport(address, "operator", [])
    operator.wait_connected(10)
    try:
        fast, slow = cores[0], cores[2]
        wait_until(lambda: server.store.version >= 3, timeout=30, what="three versions")
        # the slow device reported its speed and got fewer steps per commit than a fast one
        wait_until(lambda: slow.control.push_every < fast.control.push_every, timeout=10, what="balancing")
        operator.publish(Publish(server.topics.cmd, Command(cmd="set_frequency", policy="fixed").to_bytes(), qos=1))
        operator.publish(Publish(server.topics.cmd, Command(cmd="set_frequency", low=7, high=7).to_bytes(), qos=1))
        wait_until(lambda: all(d.control.push_every == 7 for d in cores), timeout=10, what="the operator's value")
        version = server.store.version
        wait_until(lambda: server.store.version >= version + 3, timeout=30, what="training to go on")
        assert server.history[-1].push_every == {d.device: 7 for d in cores} and server.history[-1].frequency == "fixed"
        assert server.traffic.rejected == {}
    finally:
        stop.set()
        thread.join(timeout=10)
        stop_devices(cores, runners)
        operator.close()


def test_tflite_devices_train_as_well_as_numpy_ones_over_mosquitto(mosquitto, tmp_path) -> None:
    pytest.importorskip("tensorflow", reason="the tf extra builds the artifact")
    pytest.importorskip("ai_edge_litert", reason="the tflite extra runs it")
    from ps_service.export import build_artifact

    holdout_features, classes = 64, 10
    artifact = build_artifact(init_mlp([holdout_features, 32, classes], seed=0), batch_size=32)
    best = {}
    for backend in ("numpy", "tflite"):
        config = {"job": f"tfl-{backend}", "rounds": 30, "min_devices": 3, "lr": 0.2}
        server, cores = run_job(mosquitto, tmp_path / backend, 3, backend, artifact, **config)
        assert server.finished and server.traffic.applied == 90
        assert all(core.backend.trainer.name == backend for core in cores)
        best[backend] = max(m.accuracy for m in server.history)
    assert best["numpy"] > 0.85
    assert abs(best["tflite"] - best["numpy"]) <= 0.01


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_server_stopped_mid_job_resumes_from_its_checkpoint_losing_and_repeating_nothing(
    mosquitto, tmp_path, how
) -> None:
    """`edgeps ps --checkpoint` is killed (or stopped) twice mid-training and restarted; 3 devices
    train on. bsp: each round takes exactly one commit per device, so applied == rounds x devices
    means that no acknowledged commit was lost and none was applied twice. Training goes on at
    once, not after the round deadline (1.0, SIGTERM: the server acknowledged commits during its
    shutdown linger without writing them to the checkpoint, and the job stalled until the deadline)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    address = BrokerAddress(mosquitto.host, mosquitto.port)
    shards = prepare_shards(load_digits(), tmp_path / "data", devices=3, alpha=0.5, seed=0)
    checkpoint, report = tmp_path / "ps.ckpt", tmp_path / "metrics.json"
    rounds = 60
    command = [
        sys.executable,
        "-m",
        "edgeps.cli",
        "ps",
        "--broker",
        f"{address.host}:{address.port}",
        "--job",
        "ck",
        "--rounds",
        str(rounds),
        "--min-devices",
        "3",
        "--eval-data",
        str(shards.holdout),
        "--checkpoint",
        str(checkpoint),
        "--report",
        str(report),
        "--round-deadline",
        "20",
        "--save-model",
        str(tmp_path / "model.npz"),
    ]
    watcher = MqttTransport(address, "watcher", ["edgeps/ck/metrics"], persistent=False)
    watcher.wait_connected(10)
    latest = {"version": -1}

    def watch(until: int, timeout: float) -> None:
        def reached() -> bool:
            while (message := watcher.receive(timeout=0.05)) is not None:
                latest["version"] = max(latest["version"], Metrics.from_bytes(message.payload).version)
            return latest["version"] >= until

        wait_until(reached, timeout=timeout, what=f"version {until}")

    cores = [
        DeviceCore("ck", f"dev-{i}", Dataset.load(p), NumpyTrainer(), seed=i) for i, p in enumerate(shards.devices)
    ]
    from edge_client.profile import DeviceProfile

    # Slow enough for the kills to land mid-job: 60 rounds of 10 steps of 20 ms, 12 s. With 4 ms steps the
    # job took 2.8 s, and the watcher here (one thread among the devices' in this process) once saw
    # version 10 only after the job had ended: the kill then hit a finished server.
    profile = DeviceProfile(step_s=0.02)
    runners = [
        threading.Thread(target=run_device, args=(d, connect_device(d, address), profile), daemon=True) for d in cores
    ]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for runner in runners:
            runner.start()
        for kill_at in (10, 30):
            watch(kill_at, timeout=60)
            os.kill(server.pid, getattr(signal, how))
            assert server.wait(timeout=20) in (0, -signal.SIGKILL)
            assert checkpoint.exists()
            restarted = time.monotonic()
            server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            watch(latest["version"] + 2, timeout=60)
            assert time.monotonic() - restarted < 10, "training resumed only after the round deadline"
        assert server.wait(timeout=120) == 0
    finally:
        if server.poll() is None:
            server.kill()
        stop_devices(cores, runners)
        watcher.close()
    history = read_metrics(report)
    final = history[-1]
    assert final.finished and final.version == rounds
    assert final.applied == rounds * 3
    # commits redelivered after a kill, already applied; and the last ones, after the job's end
    assert set(final.rejected) <= {"replayed", "finished"}
    with np.load(tmp_path / "model.npz") as saved:  # the final model, as the last metrics measured it
        model = {name: saved[name] for name in saved.files}
    assert Evaluator(Dataset.load(shards.holdout))(model).values["accuracy"] == pytest.approx(final.accuracy)


def test_churn_late_joiners_leavers_and_flapping_devices_neither_stall_nor_double_count(mosquitto, tmp_path) -> None:
    from edge_client.profile import DeviceProfile

    address = BrokerAddress(mosquitto.host, mosquitto.port)
    shards = prepare_shards(load_digits(), tmp_path, devices=4, alpha=0.5, seed=0)
    server, thread, stop = start_server(
        address, Dataset.load(shards.holdout), job="churn", pace="acbsp", rounds=60, min_devices=2, round_deadline_s=3.0
    )
    cores = [
        DeviceCore("churn", f"dev-{i}", Dataset.load(p), NumpyTrainer(), seed=i) for i, p in enumerate(shards.devices)
    ]
    transports, runners = {}, {}

    def launch(core: DeviceCore) -> None:
        transports[core.device] = connect_device(core, address)
        runners[core.device] = threading.Thread(
            target=run_device, args=(core, transports[core.device], DeviceProfile(step_s=0.002)), daemon=True
        )
        runners[core.device].start()

    try:
        launch(cores[0])
        launch(cores[1])
        wait_until(lambda: server.store.version >= 5, timeout=30, what="five versions with two devices")
        launch(cores[2])  # joins late
        wait_until(lambda: server.store.version >= 15, timeout=30, what="fifteen versions")
        for _ in range(2):  # dev-1 flaps: its connection drops without a goodbye, paho reconnects
            transports["dev-1"]._client.socket().close()
            wait_until(lambda: transports["dev-1"].connected.is_set(), timeout=15, what="dev-1 back")
        leaver = cores[2]
        leaver.finished = True  # dev-2 leaves cleanly: its offline status goes out
        runners["dev-2"].join(timeout=10)
        launch(cores[3])  # another late joiner
        wait_until(lambda: server.finished, timeout=60, what="the job to finish despite the churn")
    finally:
        stop.set()
        thread.join(timeout=10)
        stop_devices(cores, runners.values())
    assert server.store.version == 60
    # at-least-once redeliveries, refused; commits that crossed the job's end, refused and counted
    assert set(server.traffic.rejected) <= {"replayed", "finished"}
    sent = sum(core.seq for core in cores)
    assert server.traffic.applied + server.traffic.rejected.get("replayed", 0) <= server.traffic.commits
    assert server.traffic.applied <= sent  # nothing counted twice


def test_edgeps_ctl_pauses_resumes_and_steers_a_running_job(mosquitto) -> None:
    from edgeps.cli import main

    address = BrokerAddress(mosquitto.host, mosquitto.port)
    holdout = load_digits()
    server, thread, stop = start_server(address, holdout, job="ctl", pace="asp", rounds=10**6, frequency="trend")
    broker = ["--broker", f"{address.host}:{address.port}", "--job", "ctl"]
    try:
        assert main(["ctl", "pause", *broker]) == 0
        wait_until(lambda: server.paused, timeout=10, what="the pause")
        assert main(["ctl", "resume", *broker]) == 0
        wait_until(lambda: not server.paused, timeout=10, what="the resume")
        assert main(["ctl", "set-frequency", "--policy", "fixed", "--low", "3", "--high", "3", *broker]) == 0
        wait_until(lambda: server.frequency.base == 3, timeout=10, what="the new frequency")
        assert main(["ctl", "set-frequency", *broker]) == 2  # nothing to set: refused before sending
        assert main(["ctl", "set-codec", "nonsense", *broker]) == 2
        assert main(["ctl", "set-pace", "warp", *broker]) == 2  # refused before sending: no such pace
        assert main(["ctl", "evict", "nobody", *broker]) == 1  # the server refuses it, and says why
        assert server.pace.name == "asp"
        assert main(["ctl", "set-pace", "acbsp", *broker]) == 0
        assert server.pace.name == "acbsp"
        assert main(["ctl", "status", *broker]) == 0
        assert main(["ctl", "stop", *broker]) == 0
        wait_until(lambda: server.finished, timeout=10, what="the stop")
    finally:
        stop.set()
        thread.join(timeout=10)


def test_commands_over_mqtt5_carry_their_reply_address_as_properties(mosquitto) -> None:
    from schemas.messages import Command, Reply

    address = BrokerAddress(mosquitto.host, mosquitto.port)
    server, thread, stop = start_server(address, load_digits(), job="m5", pace="asp", rounds=10**6)
    reply_topic = server.topics.reply("op")
    operator = MqttTransport(address, "op5", [reply_topic], persistent=False, mqtt5=True)
    try:
        operator.wait_connected(10)
        operator.publish(
            Publish(
                server.topics.cmd,
                Command(cmd="status").to_bytes(),
                qos=1,
                response_topic=reply_topic,
                correlation=b"abc-1",
            )
        )
        answer = next_message(operator)
        assert answer.correlation == b"abc-1"  # the MQTT 5 property, echoed
        reply = Reply.from_bytes(answer.payload)
        assert reply.ok and reply.correlation == "abc-1" and reply.status["pace"] == "asp"
    finally:
        operator.close()
        stop.set()
        thread.join(timeout=10)


@pytest.mark.parametrize("pace", ["bsp", "ssp:2"])
def test_a_lone_device_muted_for_its_rate_resends_the_commit_the_broker_dropped(mosquitto, tmp_path, pace) -> None:
    """A device over its commit rate is refused and not listened to for a while; the commits it sends
    meanwhile go to a broker with no subscriber for them. Alone in a bsp job it used to wait for
    parameters for good (under ssp:2, at its staleness bound: the lost commits keep the slowest clock
    low); it now sends its newest commit again (the same bytes) when no version came, and the job
    runs to its end with every round applied once."""
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    shards = prepare_shards(load_digits(), tmp_path, devices=1, alpha=0.5, seed=0)
    rounds = 6
    server, thread, stop = start_server(
        address,
        Dataset.load(shards.holdout),
        job="mute",
        pace=pace,
        rounds=rounds,
        min_devices=1,
        max_commit_rate=20.0,
        max_commit_burst=2,
    )
    device, runner = start_device("mute", "dev-0", Dataset.load(shards.devices[0]), address, resend_s=0.5)
    try:
        wait_until(lambda: server.finished, timeout=60, what="the job's end")
        assert server.traffic.rejected["rate_limited"] >= 1  # the limit did bite
        assert server.store.version == rounds and server.traffic.applied == rounds  # no round lost or doubled
    finally:
        stop.set()
        stop_devices([device], [runner])
        thread.join(timeout=10)
