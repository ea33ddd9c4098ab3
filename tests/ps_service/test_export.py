"""The TensorFlow-built TFLite trainer against the numpy reference, and the artifact's integrity."""

from __future__ import annotations

import numpy as np
import pytest

from learning.data import load_digits
from learning.model import forward, init_cnn, init_mlp, loss_and_grads
from schemas.artifact import ArtifactError, decode_artifact, encode_artifact

pytest.importorskip("tensorflow", reason="the tf extra builds the artifact")
pytest.importorskip("ai_edge_litert", reason="the tflite extra runs it")

from edge_client.tflite import TFLiteTrainer, TrainerError
from ps_service.export import build_artifact

MODELS = {
    "mlp": init_mlp([64, 32, 10], seed=3),
    "cnn": init_cnn(8, 3, 8, [32], 10, seed=3),
    "conv1d": {  # the digits' 64 values as a window of 16 steps of 4 channels
        "tconv0.w": np.random.default_rng(3).normal(0, 0.3, (3, 4, 6)).astype(np.float32),
        "tconv0.b": np.zeros(6, np.float32),
        **init_mlp([14 * 6, 32, 10], seed=3),
    },
    "conv1d pooled": {  # the same window, the 14 positions max-pooled by 2
        "tconv0.w": np.random.default_rng(4).normal(0, 0.3, (3, 4, 6)).astype(np.float32),
        "tconv0.b": np.zeros(6, np.float32),
        **init_mlp([7 * 6, 32, 10], seed=3),
    },
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def built(request):
    params = MODELS[request.param]
    meta, tflite = decode_artifact(build_artifact(params, batch_size=16, features=64))
    return params, meta, tflite


def test_gradients_and_predictions_match_numpy(built) -> None:
    """On digits batches, at the initial parameters and after some SGD steps."""
    params, meta, tflite = built
    trainer = TFLiteTrainer(meta, tflite)
    digits = load_digits()
    rng = np.random.default_rng(7)
    for _ in range(5):
        rows = rng.integers(0, len(digits), 16)
        x, y = digits.x[rows], digits.y[rows]
        loss, grads = trainer.loss_and_grads(params, x, y)
        ref_loss, ref_grads = loss_and_grads(params, x, y)
        assert loss == pytest.approx(ref_loss, abs=1e-5)
        for name in params:
            np.testing.assert_allclose(grads[name], ref_grads[name], atol=1e-5, rtol=0)
        np.testing.assert_allclose(trainer.predict(params, x[:5]), forward(params, x[:5]), atol=1e-5, rtol=0)
        params = {name: value - 0.2 * grads[name] for name, value in params.items()}  # a step of training


def test_metadata_describes_the_trainer(built) -> None:
    params, meta, tflite = built
    assert [(s.name, s.shape) for s in meta.params] == [(n, v.shape) for n, v in params.items()]
    assert (meta.features, meta.classes, meta.batch_size) == (64, 10, 16)
    assert meta.built_with.startswith("tensorflow ") and meta.size == len(tflite)


def test_the_trainer_refuses_what_it_was_not_built_for(built) -> None:
    params, meta, tflite = built
    trainer = TFLiteTrainer(meta, tflite)
    with pytest.raises(TrainerError, match="batches of 16"):
        trainer.loss_and_grads(params, np.zeros((8, 64), np.float32), np.zeros(8, np.int64))
    other = init_mlp([64, 7, 10], seed=0)
    with pytest.raises(TrainerError, match="differ"):
        trainer.loss_and_grads(other, np.zeros((16, 64), np.float32), np.zeros(16, np.int64))


def test_a_tampered_artifact_is_refused(built) -> None:
    _, meta, tflite = built
    payload = encode_artifact(meta, tflite)
    flipped = bytearray(payload)
    flipped[-100] ^= 0x01
    with pytest.raises(ArtifactError, match="sha256"):
        decode_artifact(bytes(flipped))
    with pytest.raises(ArtifactError, match="bytes"):
        decode_artifact(payload[:-1])
    with pytest.raises(ArtifactError, match="magic"):
        decode_artifact(b"XXXX" + payload[4:])
    with pytest.raises(ArtifactError, match="metadata"):
        decode_artifact(payload[:8] + b"[" + payload[9:])


@pytest.mark.parametrize("loss_name", ["bce", "mse", "mae"])
def test_the_trainer_of_every_other_loss_matches_numpy(loss_name: str) -> None:
    params = init_mlp([6, 16, 1], seed=4)
    meta, tflite = decode_artifact(build_artifact(params, batch_size=8, loss=loss_name))
    trainer = TFLiteTrainer(meta, tflite)
    assert (meta.loss, meta.classes, trainer.loss) == (loss_name, 1, loss_name)
    rng = np.random.default_rng(5)
    x = rng.random((8, 6), dtype=np.float32)
    y = rng.integers(0, 2, 8) if loss_name == "bce" else rng.normal(0, 2, 8).astype(np.float32)
    loss, grads = trainer.loss_and_grads(params, x, y)
    ref_loss, ref_grads = loss_and_grads(params, x, y, loss_name)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    for name in params:
        np.testing.assert_allclose(grads[name], ref_grads[name], atol=1e-5, rtol=0)
