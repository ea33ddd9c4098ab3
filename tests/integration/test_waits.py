"""Silent waits look like hangs: a device with no server, a server with no devices and a watch on a
finished job each say what they wait for (issue 17, item 4). The notes' interval is shortened here."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import edge_client.mqtt
import ps_service.io.mqtt
from broker.client import BrokerAddress, MqttTransport
from edge_client.core import DeviceCore
from edge_client.mqtt import connect_device, run_device
from edge_client.trainer import NumpyTrainer
from edgeps.operator import watch
from learning.model import init_mlp
from ps_service.config import ServerConfig
from ps_service.evaluator import Evaluator
from ps_service.io.mqtt import connect_server, serve
from ps_service.server.core import ServerCore
from schemas.messages import Barrier
from schemas.topics import Publish, Topics
from tests.helpers import blobs, wait_until


@contextlib.contextmanager
def running(target: Callable[..., None], *args: object) -> Iterator[None]:
    """``target(*args, stop=...)`` in a thread until the block ends."""
    stop = threading.Event()
    thread = threading.Thread(target=target, args=args, kwargs={"stop": stop}, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def notes(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_device_without_a_server_says_what_it_waits_for(mosquitto, caplog, monkeypatch) -> None:
    monkeypatch.setattr(edge_client.mqtt, "WAIT_NOTE_S", 0.2)
    caplog.set_level(logging.INFO, logger="edgeps")  # (a bench run in-process earlier quiets "edgeps")
    core = DeviceCore("lonely", "d1", blobs(), NumpyTrainer())
    with running(run_device, core, connect_device(core, BrokerAddress(mosquitto.host, mosquitto.port))):
        wait_until(lambda: len(notes(caplog, "waiting for a Control")) >= 2, timeout=10, what="repeated notes")
    assert notes(caplog, "waiting for")[0] == (
        "waiting for a Control from job lonely's server (is `edgeps ps --job lonely` running on this broker?)"
    )


def test_a_server_without_devices_says_how_many_it_waits_for(mosquitto, caplog, monkeypatch) -> None:
    monkeypatch.setattr(ps_service.io.mqtt, "WAIT_NOTE_S", 0.2)
    caplog.set_level(logging.INFO, logger="edgeps")  # (a bench run in-process earlier quiets "edgeps")
    core = ServerCore(ServerConfig(job="empty", min_devices=3), init_mlp([8, 8, 3], seed=0), Evaluator(blobs()))
    transport = connect_server(core, BrokerAddress(mosquitto.host, mosquitto.port))
    try:
        with running(serve, core, transport):
            wait_until(lambda: len(notes(caplog, "waiting for 3 devices")) >= 2, timeout=10, what="repeated notes")
    finally:
        transport.close()
    assert notes(caplog, "waiting for 3")[0] == "waiting for 3 devices to start job empty (0 online)"


def test_watching_a_finished_job_says_so_and_ends(mosquitto, caplog) -> None:
    caplog.set_level(logging.INFO, logger="edgeps")  # (a bench run in-process earlier quiets "edgeps")
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    publisher = MqttTransport(address, "old-server", [], persistent=False)
    publisher.wait_connected(10)
    barrier = Barrier(
        run=7,
        round=42,
        version=42,
        pace="bsp",
        state="finished",
        waiting_for=[],
        committed=[],
        left=[],
        slowest_clock=0,
    )
    publisher.publish(Publish(Topics("done").barrier, barrier.to_bytes(), qos=1, retain=True))
    publisher.close()
    assert list(watch(address, "done", note_s=0.2)) == []
    assert notes(caplog, "job done has finished") == ["job done has finished (version 42)"]


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_ctrl_c_on_the_demo_is_one_line_and_leaves_no_process(tmp_path, signum) -> None:
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "demo"
    demo = subprocess.Popen(
        [sys.executable, "-m", "edgeps.cli", "demo", "--rounds", "100000", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    wait_until(lambda: (out / "logs" / "demo-dev-07.log").exists(), timeout=60, what="the demo's devices")
    time.sleep(1.0)  # let them connect and train: Ctrl-C in the middle of the job
    demo.send_signal(getattr(signal, signum))  # Ctrl-C, or kill -TERM
    _, err = demo.communicate(timeout=60)
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert demo.returncode == 130 and "Traceback" not in err and len(errors) == 1 and "interrupted" in errors[0]
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert left == []  # broker, server and devices all stopped


@pytest.mark.integration  # starts the edgeps command for each role
def test_every_role_exits_within_two_seconds_of_sigterm(mosquitto, tmp_path) -> None:
    """A server mid-job, a device training, an operator watching and a broker each stop on their
    own SIGTERM within 2 s (the demo's SIGTERM is the Ctrl-C test above)."""
    import signal
    import subprocess
    import sys
    import time

    from broker.launcher import free_port
    from learning.data import load_digits

    cli = [sys.executable, "-m", "edgeps.cli"]
    broker = ["--broker", f"{mosquitto.host}:{mosquitto.port}", "--job", "term"]
    shard = tmp_path / "dev-00.npz"
    load_digits().subset(np.arange(300)).save(shard)
    logs = {name: tmp_path / f"{name}.log" for name in ("ps", "client", "watch", "broker")}
    commands = {
        "ps": [*cli, "ps", *broker, "--rounds", "100000", "--min-devices", "1"],
        "client": [*cli, "client", *broker, "--device", "dev-00", "--data", str(shard)],
        "watch": [*cli, "ctl", *broker, "watch"],
        "broker": [
            *cli,
            "broker",
            "--port",
            str(free_port()),
            "--ws-port",
            str(free_port()),
            "--data-dir",
            str(tmp_path / "own-broker"),
        ],
    }
    processes = {}
    try:
        for name, command in commands.items():
            processes[name] = subprocess.Popen(command, stdout=logs[name].open("w"), stderr=subprocess.STDOUT)
        wait_until(lambda: "applied" in logs["watch"].read_text(), timeout=60, what="the job under way")
        for name, process in processes.items():
            assert process.poll() is None, f"{name} ended early: {logs[name].read_text()[-2000:]}"
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=10)
            took = time.monotonic() - started
            print(f"{name} exited {took:.2f} s after SIGTERM")
            assert took < 2.0, f"{name} took {took:.2f} s to exit after SIGTERM: {logs[name].read_text()[-2000:]}"
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()


def _session_present(address: BrokerAddress, client_id: str) -> bool:
    """Whether the broker holds a session for ``client_id``: an MQTT 5 connection that asks to resume
    one (and to keep nothing after it) reads the CONNACK's session-present flag."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    present: list[bool] = []
    probe = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    probe.on_connect = lambda client, userdata, flags, reason, properties: present.append(flags.session_present)
    expiry = Properties(PacketTypes.CONNECT)
    expiry.SessionExpiryInterval = 0
    probe.connect(address.host, address.port, clean_start=False, properties=expiry)
    probe.loop_start()
    try:
        wait_until(lambda: bool(present), timeout=10, what=f"a CONNACK for {client_id}")
    finally:
        probe.disconnect()
        probe.loop_stop()
    return present[0]


@pytest.mark.integration  # starts the edgeps command
def test_finished_jobs_leave_no_sessions_and_the_brokers_disk_stays_bounded(tmp_path) -> None:
    """After a job ends, its server and devices end their persistent sessions: nothing is queued
    for them from then on, and a broker that ran several jobs holds little more than their retained
    messages (before: offline sessions kept queuing commits, 804 MB after 25 jobs)."""
    import subprocess
    import sys

    from broker.launcher import start_broker

    broker = start_broker(workdir=tmp_path / "broker", embedded=False)
    address = BrokerAddress(broker.host, broker.port)
    try:
        for job in ("j1", "j2", "j3"):
            where = f"{broker.host}:{broker.port}"
            command = [
                sys.executable,
                "-m",
                "edgeps.cli",
                "demo",
                "--broker",
                where,
                "--job",
                job,
                "--rounds",
                "20",
                "--devices",
                "3",
                "--pace",
                "asp",
                "--out",
                str(tmp_path / job),
            ]
            done = subprocess.run(command, capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, done.stderr[-3000:]
            for client in (f"edgeps-ps-{job}", *(f"edgeps-dev-{job}-dev-{i:02d}" for i in range(3))):
                assert not _session_present(address, client), f"{client} left a session behind"
    finally:
        broker.stop()
    database = tmp_path / "broker" / "mosquitto.db"
    assert database.exists() and database.stat().st_size < 512 * 1024, database.stat().st_size
