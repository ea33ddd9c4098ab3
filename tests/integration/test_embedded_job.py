"""C devices in real jobs: `edgeps-device` (the SDK on libmosquitto, built with ASan/UBSan)
processes against the parameter server over the project's Mosquitto, beside the same job with
Python devices."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from broker.client import BrokerAddress
from learning.data import Dataset, load_digits
from learning.prepare import prepare_shards
from schemas.frame import encode_data_frame
from tests.helpers import stop_devices, wait_until
from tests.integration.test_mqtt_job import run_job, start_device, start_server


@pytest.fixture
def edgeps_device(sdk) -> Path:
    if not (sdk / "edgeps-device").exists():
        pytest.fail("edgeps-device needs libmosquitto's headers (apt-get install libmosquitto-dev)")
    return sdk / "edgeps-device"


@pytest.mark.parametrize(("pace", "codec", "pull"), [("bsp", "fp32", "fp32"), ("acbsp", "sign", "ternary")])
def test_c_devices_over_mosquitto_train_as_the_python_ones(mosquitto, tmp_path, edgeps_device, pace, codec, pull):
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    shards = prepare_shards(load_digits(), tmp_path / "data", devices=3, alpha=0.5, seed=0)
    config = {"pace": pace, "rounds": 40, "min_devices": 3, "codec": codec, "pull_codec": pull}
    server, thread, stop = start_server(address, Dataset.load(shards.holdout), job="cjob", **config)
    devices = []
    try:
        for i, shard in enumerate(shards.devices):
            data = Dataset.load(shard)
            frame = shard.with_suffix(".epsf")
            frame.write_bytes(encode_data_frame(data.x, data.y))
            command = [
                str(edgeps_device),
                "--broker",
                f"{address.host}:{address.port}",
                "--job",
                "cjob",
                "--device",
                f"dev-{i}",
                "--data",
                str(frame),
                "--seed",
                str(i),
            ]
            devices.append(
                subprocess.Popen(command, stderr=subprocess.PIPE, env={**os.environ, "ASAN_OPTIONS": "detect_leaks=1"})
            )
        wait_until(lambda: server.finished, timeout=120, what="the job of C devices to finish")
        for device in devices:
            assert device.wait(timeout=30) == 0, device.stderr.read().decode()  # a sanitizer's finding fails
    finally:
        stop.set()
        thread.join(timeout=10)
        for device in devices:
            if device.poll() is None:
                device.kill()
    assert server.store.version == 40 and server.traffic.applied >= 40 * 3 - 3
    assert set(server.traffic.rejected) <= {"finished"}  # commits crossing the job's end only
    c_best = max(m.accuracy for m in server.history)
    python, _ = run_job(mosquitto, tmp_path / "python", 3, job="pyjob", **config)
    python_best = max(m.accuracy for m in python.history)
    assert c_best >= python_best - 0.02, (c_best, python_best)


def test_the_demo_runs_c_devices_beside_python_ones(tmp_path) -> None:
    from edgeps.demo import run_demo
    from edgeps.localjob import DemoSettings

    report = run_demo(DemoSettings(devices=3, rounds=15, out=tmp_path / "demo", embedded_devices=2), quiet=True)
    assert report["device_backends"] == {"numpy": 1, "c": 2}
    assert report["rounds"] == 15 and report["rejected"] == 0 and report["best_accuracy"] > 0.7


def test_the_demo_refuses_c_devices_it_cannot_run(tmp_path) -> None:
    from edgeps.demo import run_demo
    from edgeps.localjob import DemoSettings

    with pytest.raises(ValueError, match="--embedded-devices 4: 1 to --devices"):
        run_demo(DemoSettings(devices=3, out=tmp_path / "demo", embedded_devices=4), quiet=True)


def spawn_device(edgeps_device: Path, address: BrokerAddress, job: str, shard: Path, *extra: str) -> subprocess.Popen:
    data = Dataset.load(shard)
    frame = shard.with_suffix(".epsf")
    frame.write_bytes(encode_data_frame(data.x, data.y))
    command = [
        str(edgeps_device),
        "--broker",
        f"{address.host}:{address.port}",
        "--job",
        job,
        "--device",
        "dev-0",
        "--data",
        str(frame),
        "--seed",
        "0",
        *extra,
    ]
    return subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, env={**os.environ, "ASAN_OPTIONS": "detect_leaks=1"}
    )


@pytest.mark.parametrize("pace", ["bsp", "ssp:2"])
def test_a_lone_c_device_muted_for_its_rate_reaches_the_jobs_end(mosquitto, tmp_path, edgeps_device, pace) -> None:
    """As the Python device (tests/integration/test_mqtt_job.py): the commits the broker dropped while
    the server did not listen would hold it for good; it sends its newest again after --resend-s."""
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    shards = prepare_shards(load_digits(), tmp_path, devices=1, alpha=0.5, seed=0)
    rounds = 6
    server, thread, stop = start_server(
        address,
        Dataset.load(shards.holdout),
        job="cmute",
        pace=pace,
        rounds=rounds,
        min_devices=1,
        max_commit_rate=20.0,
        max_commit_burst=2,
    )
    device = spawn_device(edgeps_device, address, "cmute", shards.devices[0], "--resend-s", "0.5")
    try:
        wait_until(lambda: server.finished, timeout=60, what="the job's end")
        assert device.wait(timeout=30) == 0, device.stderr.read()  # type: ignore[union-attr]
        log = device.stderr.read()  # type: ignore[union-attr]
        assert server.traffic.rejected["rate_limited"] >= 1  # the limit did bite
        assert "brought no new version: sent again" in log, log
        assert server.store.version == rounds and server.traffic.applied == rounds  # no round lost or doubled
    finally:
        stop.set()
        thread.join(timeout=10)
        if device.poll() is None:
            device.kill()


def _cases() -> list:
    from learning.model import init_cnn, init_mlp

    return [
        pytest.param({"params": init_cnn(8, 3, 4, [16], 10, seed=0)}, "is not an MLP the C trainer computes", id="cnn"),
        pytest.param({"params": init_mlp([64, 1024, 1024, 10], seed=0)}, "needs an arena of", id="too-big"),
        pytest.param({"loss": "hinge", "metrics": "accuracy"}, "loss hinge is not one the C", id="loss"),
    ]


@pytest.mark.parametrize(("config", "reason"), _cases())
def test_a_c_device_that_cannot_take_the_job_says_why_and_exits_non_zero(
    mosquitto, tmp_path, edgeps_device, config, reason
) -> None:
    from edgeps.report import build_report

    address = BrokerAddress(mosquitto.host, mosquitto.port)
    shards = prepare_shards(load_digits(), tmp_path, devices=2, alpha=0.5, seed=0)
    server, thread, stop = start_server(
        address, Dataset.load(shards.holdout), job="cannot", pace="asp", rounds=3, min_devices=1, **config
    )
    device = spawn_device(edgeps_device, address, "cannot", shards.devices[0])
    try:
        assert device.wait(timeout=60) == 3
        log = device.stderr.read()  # type: ignore[union-attr]
        assert reason in log and "it cannot take part in this job" in log, log
        wait_until(lambda: "dev-0" in server.registry.unable, timeout=10, what="the server to hear why")
        assert reason in server.registry.unable["dev-0"]
        assert reason in server.status(0.0)["unable"]["dev-0"]  # what `edgeps ctl status` prints
        if "loss" not in config:  # a Python device trains the model the C one cannot: the report says who could not
            python, runner = start_device("cannot", "dev-1", Dataset.load(shards.devices[1]), address, seed=1)
            wait_until(lambda: server.finished, timeout=60, what="the job's end")
            stop_devices([python], [runner])
            report = build_report(server.history, 1.0, {})
            assert reason in report["unable"]["dev-0"]
    finally:
        stop.set()
        thread.join(timeout=10)
        if device.poll() is None:
            device.kill()
