"""Jobs over a real Mosquitto that things happen to: a broker restart, a slow device, a server stopped
mid-job, churn, operators steering, a muted device resending."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from broker.client import BrokerAddress, MqttTransport
from edge_client.core import DeviceCore
from edge_client.mqtt import connect_device, run_device
from edge_client.trainer import NumpyTrainer
from edgeps.report import read_metrics
from learning.data import Dataset, load_digits
from learning.model import init_mlp
from learning.prepare import prepare_shards
from ps_service.evaluator import Evaluator
from schemas.messages import Metrics
from schemas.topics import Publish
from tests.helpers import next_message, stop_devices, wait_until
from tests.integration.test_mqtt_job import run_job, start_device, start_server


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
    """`edgeps ps --checkpoint` is killed five times (or stopped twice) mid-training and restarted,
    each time resuming from its snapshot and journal (ps_service.io.journal); 3 devices
    train on. bsp: each round takes exactly one commit per device, so applied == rounds x devices
    means that no acknowledged commit was lost and none was applied twice. Training goes on at
    once, not after the round deadline (1.0, SIGTERM: the server acknowledged commits during its
    shutdown linger without writing them to the checkpoint, and the job stalled until the deadline)."""
    import os
    import signal
    import subprocess
    import sys

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
        for kill_at in (8, 16, 24, 32, 40) if how == "SIGKILL" else (10, 30):  # SIGKILL: the kill-storm
            watch(kill_at, timeout=60)
            os.kill(server.pid, getattr(signal, how))
            assert server.wait(timeout=20) in (0, -signal.SIGKILL)
            assert checkpoint.exists()
            restarted = time.monotonic()
            with open(tmp_path / f"ps-{kill_at}.log", "wb") as log:
                server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
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
    resumed = [log.read_text() for log in sorted(tmp_path.glob("ps-*.log"))]
    assert all("resumed job ck" in text for text in resumed)
    assert any("of its journal made again" in text for text in resumed)  # the turns after the snapshot
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
