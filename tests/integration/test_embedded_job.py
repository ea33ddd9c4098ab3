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
from tests.helpers import wait_until
from tests.integration.test_mqtt_job import run_job, start_server


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
            command = [str(edgeps_device), "--broker", f"{address.host}:{address.port}", "--job", "cjob",
                       "--device", f"dev-{i}", "--data", str(frame), "--seed", str(i)]  # fmt: skip
            devices.append(subprocess.Popen(command, stderr=subprocess.PIPE, env={**os.environ,
                                            "ASAN_OPTIONS": "detect_leaks=1"}))  # fmt: skip
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
    from edgeps.demo import DemoSettings, run_demo

    report = run_demo(DemoSettings(devices=3, rounds=15, out=tmp_path / "demo", embedded_devices=2), quiet=True)
    assert report["device_backends"] == {"numpy": 1, "c": 2}
    assert report["rounds"] == 15 and report["rejected"] == 0 and report["best_accuracy"] > 0.7


def test_the_demo_refuses_c_devices_it_cannot_run(tmp_path) -> None:
    from edgeps.demo import DemoSettings, run_demo

    with pytest.raises(ValueError, match="--embedded-devices 4: 1 to --devices"):
        run_demo(DemoSettings(devices=3, out=tmp_path / "demo", embedded_devices=4), quiet=True)
