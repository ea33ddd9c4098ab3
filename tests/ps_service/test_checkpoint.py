"""Checkpoints: a restored server is the server that was saved; damage and mismatches are refused."""

from __future__ import annotations

import numpy as np
import pytest

from ps_service.checkpoint import CheckpointError, restore, save
from tests.helpers import commit_bytes, hello, small_server


def started(**overrides):
    server = small_server(pace="bsp", rounds=20, **overrides)
    server.start(0.0)
    for device in ("a", "b"):
        hello(server, device)
    return server


def test_a_restored_server_goes_on_exactly_like_the_saved_one(tmp_path) -> None:
    original = started(frequency="trend", balance="release")
    original.on_message(original.topics.grad("a"), commit_bytes(original, "a", 1), 1.0)
    original.on_message(original.topics.grad("b"), commit_bytes(original, "b", 1), 1.5)
    original.on_message(original.topics.grad("a"), commit_bytes(original, "a", 2, scale=0.2), 2.0)  # buffered
    save(original, tmp_path / "ps.ckpt", now=2.0)

    restored = small_server(pace="bsp", rounds=20, frequency="trend", balance="release")
    restore(restored, tmp_path / "ps.ckpt", now=100.0)  # a new process: another clock
    assert restored.store.version == original.store.version == 1
    assert restored.round_started == pytest.approx(original.round_started + 98.0)
    resumed = restored.resume(100.0)
    assert {p.topic for p in resumed} >= {restored.topics.params, restored.topics.barrier, restored.topics.model}
    for server, now in ((original, 3.0), (restored, 101.0)):
        server.on_message(server.topics.grad("b"), commit_bytes(server, "b", 2, scale=0.3), now)
        # a redelivered commit that the checkpoint already holds is refused, not applied twice
        server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 2, scale=0.2), now)
    assert restored.store.version == original.store.version == 2
    for name, values in original.store.params().items():
        np.testing.assert_array_equal(restored.store.params()[name], values)
    assert restored.traffic.applied == original.traffic.applied == 4
    assert restored.traffic.rejected == original.traffic.rejected == {"replayed": 1}


def test_a_damaged_checkpoint_is_refused(tmp_path) -> None:
    path = tmp_path / "ps.ckpt"
    save(started(), path, now=1.0)
    blob = bytearray(path.read_bytes())
    blob[-10] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="damaged"):
        restore(small_server(pace="bsp", rounds=20), path, now=2.0)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="magic"):
        restore(small_server(pace="bsp", rounds=20), path, now=2.0)


def test_a_checkpoint_of_another_configuration_is_refused(tmp_path) -> None:
    path = tmp_path / "ps.ckpt"
    save(started(), path, now=1.0)
    with pytest.raises(CheckpointError, match="another configuration"):
        restore(small_server(pace="asp", rounds=20), path, now=2.0)


def test_writes_are_atomic(tmp_path) -> None:
    path = tmp_path / "ps.ckpt"
    server = started()
    save(server, path, now=1.0)
    first = path.read_bytes()
    save(server, path, now=2.0)
    assert path.read_bytes() != first and not (tmp_path / "ps.ckpt.partial").exists()
