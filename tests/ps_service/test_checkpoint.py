"""Checkpoints: a restored server is the server that was saved; damage, forgeries and mismatches are refused."""

from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys

import numpy as np
import pytest

from ps_service.io.checkpoint import MAGIC, CheckpointError, load_key, restore, save
from schemas.messages import Notice
from tests.helpers import commit_bytes, hello, small_server

KEY = b"k" * 32


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
    save(original, tmp_path / "ps.ckpt", now=2.0, key=KEY)

    restored = small_server(pace="bsp", rounds=20, frequency="trend", balance="release")
    restore(restored, tmp_path / "ps.ckpt", now=100.0, key=KEY)  # a new process: another clock
    assert restored.store.version == original.store.version == 1
    assert restored.run == original.run and restored.history == original.history
    best = original.report.best  # the best version's parameters travel with the checkpoint
    assert best is not None and restored.report.best is not None and restored.report.best.version == best.version
    for name, values in best.params.items():
        np.testing.assert_array_equal(restored.report.best.params[name], values)
    assert restored.round.opened == pytest.approx(original.round.opened + 98.0)
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
    assert _same_state(restored, original)  # every named field, times as ages


def _same_state(restored, original) -> bool:
    """Every field but the arrays compared by value (dicts of arrays do not compare with ==)."""
    import json

    def plain(state):
        return json.dumps(
            state,
            default=lambda value: np.asarray(value).tolist() if hasattr(value, "shape") else list(value),
            sort_keys=True,
        )

    return plain(restored.to_state(200.0)) == plain(original.to_state(102.0))


def test_every_timed_state_survives_a_restore_onto_a_new_clock(tmp_path) -> None:
    """The rate limiter's buckets and its one-notice-a-second memory are named state: a device
    rate-limited before the restart is still noticed once a second after it (was: 0 notices
    for 36 refusals, because the restore did not move those times to the new clock)."""
    server = small_server(pace="asp", rounds=10**6, max_commit_rate=1.0, max_commit_burst=1)
    server.start(0.0)
    hello(server, "f")
    server.on_message(server.topics.grad("f"), commit_bytes(server, "f", 1, base=0), 1.0)
    server.on_message(server.topics.grad("f"), commit_bytes(server, "f", 2, base=0), 1.01)  # rate-limited, noticed
    save(server, tmp_path / "c", now=1.02, key=KEY)
    restored = small_server(pace="asp", rounds=10**6, max_commit_rate=1.0, max_commit_burst=1)
    restore(restored, tmp_path / "c", now=5000.0, key=KEY)
    notices = []
    for i in range(36):  # 36 refusals over 3.6 s: three or four notices, one a second
        out = restored.on_message(
            restored.topics.grad("f"), commit_bytes(restored, "f", 3 + i, base=0), 5000.0 + 0.1 * i
        )
        notices += [Notice.from_bytes(p.payload) for p in out if p.topic == restored.topics.notice("f")]
    assert 3 <= len(notices) <= 4 and all(n.reason.value == "rate_limited" for n in notices)


def test_a_damaged_or_forged_checkpoint_is_refused(tmp_path) -> None:
    path = tmp_path / "ps.ckpt"
    save(started(), path, now=1.0, key=KEY)
    blob = bytearray(path.read_bytes())
    blob[-10] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="damaged or not signed"):
        restore(small_server(pace="bsp", rounds=20), path, now=2.0, key=KEY)
    save(started(), path, now=1.0, key=b"another server's key!")
    with pytest.raises(CheckpointError, match="not signed"):  # valid, but not ours
        restore(small_server(pace="bsp", rounds=20), path, now=2.0, key=KEY)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="magic"):
        restore(small_server(pace="bsp", rounds=20), path, now=2.0, key=KEY)


class _Payload:
    """Unpickling this runs ``touch`` (what a crafted pickle checkpoint did, as root, on restart)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_file_runs_no_code_when_the_server_starts(tmp_path) -> None:
    marker = tmp_path / "pwned"
    evil = pickle.dumps({"config": "{}", "saved_at": 0, "state": _Payload(str(marker))})
    import hashlib

    path = tmp_path / "ps.ckpt"
    # the old format, its bare SHA-256 recomputed by the attacker; and the new magic in front of a pickle
    for blob in (b"EPSCKPT1" + hashlib.sha256(evil).digest() + evil, MAGIC + hashlib.sha256(evil).digest() + evil):
        path.write_bytes(blob)
        key = tmp_path / "ps.ckpt.key"
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "edgeps.cli",
                "ps",
                "--broker",
                "127.0.0.1:1",
                "--checkpoint",
                str(path),
                "--checkpoint-key",
                str(key),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode != 0 and not marker.exists()
        assert "checkpoint" in result.stderr


def test_a_checkpoint_of_another_configuration_is_refused(tmp_path) -> None:
    path = tmp_path / "ps.ckpt"
    save(started(), path, now=1.0, key=KEY)
    with pytest.raises(CheckpointError, match="another configuration"):
        restore(small_server(pace="asp", rounds=20), path, now=2.0, key=KEY)


def test_the_configuration_compares_the_same_whatever_the_hash_seed(tmp_path) -> None:
    """--devices is a set: its JSON used to follow Python's hash seed, so a restart was refused
    about 5 times in 6. Each process below has its own seed."""
    script = (
        "import sys; sys.path.insert(0, '.');"
        "from tests.helpers import small_server;"
        "print(small_server(allowed_devices=frozenset(f'dev-{i}' for i in range(8))).config.model_dump_json())"
    )
    seen = {
        subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in range(6)
    }
    assert len(seen) == 1


def test_writes_are_atomic_and_private(tmp_path) -> None:
    path = tmp_path / "ps.ckpt"
    server = started()
    save(server, path, now=1.0, key=KEY)
    first = path.read_bytes()
    save(server, path, now=2.0, key=KEY)
    assert path.read_bytes() != first and not (tmp_path / "ps.ckpt.partial").exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_key_is_made_once_private_and_must_be_there_to_resume(tmp_path) -> None:
    key = load_key(tmp_path / "k")
    assert load_key(tmp_path / "k") == key and len(key) == 32
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o600
    with pytest.raises(CheckpointError, match="no checkpoint key"):
        load_key(tmp_path / "missing", create=False)


def test_the_checkpoint_key_comes_from_a_file_or_the_environment_never_the_command_line(tmp_path) -> None:
    """The audit: --checkpoint-key took the key in hex on the command line, which every user of the
    machine can read (ps, /proc/PID/cmdline)."""
    from edgeps.cli.ps import checkpoint_key

    path = tmp_path / "ps.ckpt"
    with pytest.raises(CheckpointError, match="EDGEPS_CHECKPOINT_KEY"):
        checkpoint_key(KEY.hex(), path, None)
    assert checkpoint_key(None, path, KEY.hex()) == KEY  # the environment
    made = checkpoint_key(None, path, None)  # a new key in the default file, mode 600
    assert (tmp_path / "ps.ckpt.key").stat().st_mode & 0o777 == 0o600
    assert checkpoint_key(str(tmp_path / "ps.ckpt.key"), path, None) == made
    with pytest.raises(CheckpointError, match="shorter than 16 bytes"):
        checkpoint_key(None, path, "abcd")
