"""A device takes the server's model artifact: verified, cached, refused when tampered."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.backend import make_trainer, tflite_trainer
from edge_client.cache import cached_artifacts, save_artifact
from edge_client.core import DeviceCore
from edge_client.trainer import NumpyTrainer
from learning.model import init_mlp
from schemas.artifact import ArtifactError
from schemas.messages import Control, DeviceStatus
from tests.helpers import INCARNATION, blobs, control_bytes, params_bytes, small_server

pytest.importorskip("tensorflow", reason="the tf extra builds the artifact")
pytest.importorskip("ai_edge_litert", reason="the tflite extra runs it")

from ps_service.export import build_artifact

T = "edgeps/t"
PARAMS = init_mlp([8, 16, 3], seed=0)


@pytest.fixture(scope="module")
def artifact() -> bytes:
    return build_artifact(PARAMS, batch_size=8)


def tampered(payload: bytes) -> bytes:
    flipped = bytearray(payload)
    flipped[-50] ^= 0x10
    return bytes(flipped)


def device(backend: str) -> DeviceCore:
    trainer, artifact_trainer = make_trainer(backend)
    core = DeviceCore("t", "d1", blobs(), trainer, artifact_trainer=artifact_trainer, incarnation=INCARNATION)
    core.on_message(f"{T}/params", params_bytes(0, PARAMS))
    ctrl = Control.from_bytes(control_bytes("d1", push_every=3))
    core.on_message(f"{T}/ctrl/d1", ctrl.to_bytes())
    return core


def test_a_tflite_device_trains_only_once_a_verified_artifact_arrived(artifact) -> None:
    core = device("tflite")
    assert f"{T}/model" in core.subscriptions() and not core.ready
    core.on_message(f"{T}/model", tampered(artifact))
    assert not core.ready and "sha256" in core.backend.artifact_error
    core.on_message(f"{T}/model", artifact)
    assert core.ready and core.backend.trainer.name == "tflite" and core.backend.artifact_error is None
    commits = [m for _ in range(3) for m in core.step()]
    assert len(commits) == 1
    assert DeviceStatus.from_bytes(core.status("online").payload).backend == "tflite"


def test_numpy_and_auto_devices(artifact) -> None:
    numpy_device = device("numpy")
    assert f"{T}/model" not in numpy_device.subscriptions()
    numpy_device.on_message(f"{T}/model", artifact)  # not subscribed: ignored even if delivered
    assert numpy_device.backend.trainer.name == "numpy"
    auto = device("auto")
    assert auto.ready and auto.backend.trainer.name == "numpy"  # trains before any artifact
    auto.on_message(f"{T}/model", artifact)
    assert auto.backend.trainer.name == "tflite"


def test_an_artifact_for_another_model_is_refused(artifact) -> None:
    core = DeviceCore("t", "d1", blobs(), NumpyTrainer(), artifact_trainer=tflite_trainer)
    other = init_mlp([8, 5, 3], seed=0)
    core.on_message(f"{T}/params", params_bytes(0, other))
    core.on_message(f"{T}/model", artifact)
    assert core.backend.trainer.name == "numpy" and "differ" in core.backend.artifact_error


def test_the_cache_keeps_verified_artifacts_and_a_tampered_file_is_refused(tmp_path, artifact) -> None:
    path = save_artifact(tmp_path, artifact)
    assert cached_artifacts(tmp_path) == [artifact]
    with pytest.raises(ArtifactError):
        save_artifact(tmp_path / "other", tampered(artifact))
    path.write_bytes(tampered(artifact))  # changed on disk behind the device's back
    core = device("tflite")
    assert not core.load_artifact(cached_artifacts(tmp_path)[0]) and not core.ready


def test_the_server_publishes_its_artifact_retained_and_clears_a_stale_one(artifact) -> None:
    server = small_server()
    server.artifact = artifact
    model = next(p for p in server.start(0.0) if p.topic == server.topics.model)
    assert model.retain and model.payload == artifact
    plain = next(p for p in small_server().start(0.0) if p.topic == server.topics.model)
    assert plain.retain and plain.payload == b""


def test_the_tflite_trainer_steps_like_numpy(artifact) -> None:
    tflite, numpy_device = device("tflite"), device("numpy")
    tflite.on_message(f"{T}/model", artifact)
    for _ in range(3):
        a, b = tflite.step(), numpy_device.step()
    np.testing.assert_allclose(tflite.last_loss, numpy_device.last_loss, atol=1e-5)
    assert len(a) == len(b) == 1
