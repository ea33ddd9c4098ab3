"""Every parser against arbitrary bytes: thousands of inputs, no crash, no change to the model."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_client.backend import tflite_trainer
from ps_service.io.checkpoint import CheckpointError, decode
from schemas.artifact import ArtifactError, decode_artifact
from schemas.frame import FrameError, decode_frame
from schemas.messages import Barrier, Command, Control, DeviceStatus, MessageError, Metrics, Notice
from tests.helpers import commit_bytes, hello, small_device, small_server

# Bytes, and JSON-ish text, since the JSON parsers reject most random bytes at the first byte.
json_ish = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=12,
).map(lambda value: json.dumps(value).encode())
payloads = st.binary(max_size=300) | json_ish


@pytest.fixture(scope="module")
def server():
    server = small_server(pace="bsp", rounds=1000)
    server.start(0.0)
    hello(server, "dev")
    return server


@settings(max_examples=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=payloads, where=st.sampled_from(["grad/dev", "grad/other", "status/dev", "status/x", "cmd", "params"]))
def test_the_server_never_crashes_and_never_changes_the_model(server, payload, where) -> None:
    before = {name: values.copy() for name, values in server.store.params().items()}
    version = server.store.version
    server.on_message(f"edgeps/t/{where}", payload, 1.0)
    assert server.store.version == version
    for name, values in server.store.params().items():
        np.testing.assert_array_equal(values, before[name])


def test_the_fuzzed_server_still_trains(server) -> None:
    """After all that, valid commits from the device still make versions."""
    hello(server, "dev")
    version, seq = server.store.version, server.registry._devices["dev"].highest_seq + 1
    server.on_message(server.topics.grad("dev"), commit_bytes(server, "dev", seq), 2.0)
    assert server.store.version == version + 1 or server.paused or server.finished


@settings(max_examples=2000)
@given(payload=payloads, where=st.sampled_from(["params", "delta", "ctrl/d1", "barrier", "notice/d1", "model"]))
def test_a_device_never_crashes_and_keeps_its_replica(payload, where) -> None:
    device = small_device("d1")
    device.backend.artifact_trainer = tflite_trainer  # parse artifacts too
    device.on_message(f"edgeps/t/{where}", payload)
    assert device.replica is None  # nothing random became its parameters
    assert device.backend.trainer.name == "numpy"


@settings(max_examples=2000)
@given(payload=payloads)
def test_parsers_raise_only_their_own_errors(payload) -> None:
    for parse, error in (
        (decode_frame, FrameError),
        (decode_artifact, ArtifactError),
        (lambda blob: decode(blob, b"k" * 32), CheckpointError),  # never parses what it did not verify
        *((model.from_bytes, MessageError) for model in (DeviceStatus, Control, Barrier, Notice, Metrics, Command)),
    ):
        with contextlib.suppress(error):
            parse(payload)


def _signed_checkpoint() -> bytes:
    from pathlib import Path

    from ps_service.io.checkpoint import History, encode

    server = small_server(pace="bsp", rounds=1000)
    server.start(0.0)
    hello(server, "dev")
    server.on_message(server.topics.grad("dev"), commit_bytes(server, "dev", 1), 0.5)
    _, history = History(Path("unwritten.history")).take(server.history_json)
    return encode(server, 1.0, KEY, 0, history)


KEY = b"k" * 32
SIGNED = _signed_checkpoint()


@settings(max_examples=1000, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_damaged_checkpoint_signed_with_the_key_is_refused_or_read_never_a_crash(data) -> None:
    """Random bytes never pass the HMAC, so the parser behind it also gets checkpoints whose body is
    damaged (bytes flipped, cut or replaced) and then signed again with the server's key."""
    import hashlib
    import hmac

    from ps_service.io.checkpoint import MAGIC

    body = bytearray(SIGNED[len(MAGIC) + 32 :])
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(body) - 1))
        body[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        body = body[: data.draw(st.integers(0, len(body)))]
    blob = MAGIC + hmac.new(KEY, bytes(body), hashlib.sha256).digest() + bytes(body)
    with contextlib.suppress(CheckpointError):
        state, history = decode(blob, KEY)
        assert isinstance(state, dict) and history is None and isinstance(state["history"], dict)


def _compact_commit(codec: str) -> bytes:
    from schemas.codecs import make_codec
    from schemas.frame import Frame, FrameKind, encode_compact

    server = small_server(pace="bsp", rounds=1000)
    values = np.random.default_rng(1).standard_normal(sum(v.size for v in server.store.params().values()))
    payload = make_codec(codec).encode_compact(values.astype(np.float32), np.random.default_rng(0))
    frame = Frame(FrameKind.COMMIT, 0, server.store.params(), "dev", 1, 10, 1, codec)
    return encode_compact(frame, payload)


COMPACT = {codec: _compact_commit(codec) for codec in ("fp32", "sign", "topk:0.05", "qsgd:4")}


@settings(max_examples=1500, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), codec=st.sampled_from(sorted(COMPACT)))
def test_a_damaged_compact_commit_with_a_good_crc_is_refused_or_read_never_a_crash(server, data, codec) -> None:
    """Random bytes never pass the CRC, so the compact commit's parser (its varint length, top-k's
    varint gaps) also gets commits damaged and then given a good CRC again."""
    import zlib

    body = bytearray(COMPACT[codec][:-4])
    for _ in range(data.draw(st.integers(1, 6))):
        at = data.draw(st.integers(0, len(body) - 1))
        body[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        body = body[: data.draw(st.integers(0, len(body)))]
    frame = bytes(body) + zlib.crc32(bytes(body)).to_bytes(4, "little")
    with contextlib.suppress(FrameError):
        decode_frame(frame, shapes=server.store.shapes)
    before, version = server.store.params(), server.store.version
    server.on_message(server.topics.grad("dev"), frame, 1.0)
    assert server.store.version == version or all(np.isfinite(v).all() for v in server.store.params().values())
    if server.store.version == version:
        for name, values in server.store.params().items():
            np.testing.assert_array_equal(values, before[name])
