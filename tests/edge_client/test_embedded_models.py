"""The C device core and what it cannot take: a loss, a CNN, a model larger than its arena (it says
why in its status, and the server shows it), and a new run whose bigger model is laid out again
without a reboot."""

from __future__ import annotations

import json

import numpy as np
import pytest

from schemas.frame import Frame, FrameKind, encode_frame
from tests.edge_client.test_embedded_device import CDevice, CRelay, data_frame, step_until_commit
from tests.helpers import blobs, small_server


def test_a_c_device_that_cannot_take_the_job_says_why_and_the_server_shows_it(epsd, tmp_path) -> None:
    from schemas.messages import DeviceStatus

    server = small_server(pace="bsp", rounds=10**6, min_devices=1)
    relay = CRelay(server)
    relay.start()
    device = CDevice(epsd, "d1", data_frame(blobs(seed=2), tmp_path / "d1.bin"), seed=1)
    try:
        relay.connect(device)
        assert device.ready
        incarnation = device.state()["incarnation"]
        control = json.loads(relay.retained["edgeps/t/ctrl/d1"]) | {"loss": "hinge"}
        device.on_message("edgeps/t/ctrl/d1", json.dumps(control).encode())
        assert device.verdict == "model not supported" and not device.ready
        status = DeviceStatus.from_bytes(device.said[0].payload)
        assert status.state == "online" and status.incarnation == incarnation
        assert status.error == "the job's loss hinge is not one the C trainer computes (cross_entropy, bce, mse, mae)"
        relay.send(device, device.said)
        relay.flush()
        assert server.registry.unable == {"d1": status.error}
        assert server.status(relay.now)["unable"] == {"d1": status.error}
        assert "d1" not in server.registry.active()  # no round waits for it
        device.on_message("edgeps/t/ctrl/d1", relay.retained["edgeps/t/ctrl/d1"])  # the job's own loss again
        assert device.state()["unable"] == "ok" and DeviceStatus.from_bytes(device.said[0].payload).error is None
        relay.send(device, device.said)
        relay.flush()
        assert server.registry.unable == {} and "d1" in server.registry.active()
    finally:
        device.close()


def test_a_reason_naming_what_the_server_sent_stays_a_valid_status(epsd, tmp_path) -> None:
    """The reason quotes the Control's loss: whatever its bytes, the status stays printable ASCII."""
    from schemas.messages import DeviceStatus

    device = CDevice(epsd, "d1", data_frame(blobs(seed=2), tmp_path / "d1.bin"), seed=1)
    try:
        device.connected()
        control = json.loads(control_for(device)) | {"loss": "h\u00e9\u2603x"}
        device.on_message("edgeps/t/ctrl/d1", json.dumps(control, ensure_ascii=False).encode())
        error = DeviceStatus.from_bytes(device.said[0].payload).error
        assert error is not None and error.startswith("the job's loss h?????x is not")  # UTF-8's bytes, each a '?'
    finally:
        device.close()


def conv_params(run: int, name: str = "conv0") -> bytes:
    rng = np.random.default_rng(0)
    shape = (3, 3, 1, 4) if name == "conv0" else (3, 2, 4)  # a square image's kernel, or a Conv1D's
    tensors = {
        f"{name}.w": rng.standard_normal(shape).astype(np.float32),
        f"{name}.b": np.zeros(4, np.float32),
        "dense0.w": rng.standard_normal((64, 3)).astype(np.float32),
        "dense0.b": np.zeros(3, np.float32),
    }
    return encode_frame(Frame(kind=FrameKind.PARAMS, base_version=0, seq=run, tensors=tensors))


def mlp_params(sizes: list[int], run: int) -> bytes:
    from learning.model import init_mlp

    return encode_frame(Frame(kind=FrameKind.PARAMS, base_version=0, seq=run, tensors=init_mlp(sizes, seed=0)))


def control_for(device: CDevice, run: int = 7) -> bytes:
    from tests.helpers import control_bytes

    return control_bytes(run=run, incarnation=device.state()["incarnation"])


@pytest.mark.parametrize(
    ("params", "arena", "reason"),
    [
        (
            conv_params(7),
            1 << 20,
            "the job's model is not an MLP the C trainer computes (dense{i}.w and .b of matching "
            "shapes; first tensor conv0.w)",
        ),
        (
            conv_params(7, "tconv0"),
            1 << 20,
            "the job's model is not an MLP the C trainer computes (dense{i}.w and .b "
            "of matching shapes; first tensor tconv0.w)",
        ),
        (mlp_params([8, 1024, 1024, 3], 7), 1 << 20, "the job's model needs an arena of "),
    ],
)
def test_a_model_the_c_device_cannot_take_is_said_in_its_status(epsd, tmp_path, params, arena, reason) -> None:
    from schemas.messages import DeviceStatus

    device = CDevice(epsd, "d1", data_frame(blobs(seed=2), tmp_path / "d1.bin"), seed=1, arena=arena)
    try:
        device.connected()
        device.on_message("edgeps/t/ctrl/d1", control_for(device))
        device.on_message("edgeps/t/params", params)
        error = DeviceStatus.from_bytes(device.said[0].payload).error
        assert error is not None and error.startswith(reason), error
        assert device.state()["unable"] != "ok" and not device.ready
    finally:
        device.close()


def test_a_new_run_with_a_bigger_model_is_laid_out_again_without_a_reboot(epsd, tmp_path) -> None:
    device = CDevice(epsd, "d1", data_frame(blobs(seed=2), tmp_path / "d1.bin"), seed=1)
    try:
        device.connected()
        device.on_message("edgeps/t/ctrl/d1", control_for(device, run=7))
        device.on_message("edgeps/t/params", mlp_params([8, 4, 3], 7))
        assert device.ready and device.step() is not None
        device.on_message("edgeps/t/ctrl/d1", control_for(device, run=8))
        device.on_message("edgeps/t/params", mlp_params([8, 64, 64, 3], 8))  # 13 times the values
        assert device.verdict == "ok" and device.ready, device.logged
        assert [p.topic for p in step_until_commit(device)] == ["edgeps/t/grad/d1"]
        assert device.state()["run"] == 8
    finally:
        device.close()
