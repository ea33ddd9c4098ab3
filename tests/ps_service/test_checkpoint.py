"""Checkpoints: a restored server is the server that was saved; damage, forgeries and mismatches are refused."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import stat
import struct
import subprocess
import sys

import numpy as np
import pytest

from ps_service.io.checkpoint import (
    HISTORY_EXTEND,
    MAGIC,
    MAGIC_2,
    CheckpointError,
    History,
    history_path,
    load_key,
    restore,
    save,
    snapshot,
)
from ps_service.io.journal import recover
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
    written = save(server, path, now=2.0, key=KEY)  # the snapshot's bytes and the history's records'
    assert written == path.stat().st_size + len(history_path(path).read_bytes().rstrip(b"\0"))
    assert path.read_bytes() != first and not (tmp_path / "ps.ckpt.partial").exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(history_path(path).stat().st_mode) == 0o600


def _versions(server, start: int, count: int, at: float) -> None:
    """``count`` bsp rounds of devices a and b from sequence number ``start`` (a metrics record each)."""
    for seq in range(start, start + count):
        for device in ("a", "b"):
            server.on_message(server.topics.grad(device), commit_bytes(server, device, seq), at + seq)


def test_a_snapshot_appends_only_the_history_new_since_the_one_before(tmp_path) -> None:
    """The metrics history grows with the job; a snapshot's cost must not: each one appends the
    records new since the last, and the snapshot file stays the state's size."""
    path, server = tmp_path / "ps.ckpt", started()
    history = History(history_path(path))
    sizes = []
    for round_ in range(3):
        _versions(server, 1 + 5 * round_, 5, 10.0 * round_)
        written = snapshot(server, path, 10.0 * round_ + 6, KEY, round_ + 1, history)
        written.write()
        new = b"".join(len(r).to_bytes(4, "little") + r for r in server.history_json[-5:])
        if round_:  # the five records of the five versions since the last snapshot, nothing before them
            assert written.history.data == len(new).to_bytes(4, "little") + new
        sizes.append(path.stat().st_size)
    assert server.store.version == 15 and len(server.history) == 16
    assert max(sizes) - min(sizes) < 200  # the state's counters grow a few digits; the history is beside it
    restored = small_server(pace="bsp", rounds=20)
    restore(restored, path, now=100.0, key=KEY)
    assert restored.history == server.history and restored.store.version == 15


def test_a_history_damaged_missing_or_of_another_snapshot_is_refused(tmp_path) -> None:
    path, server = tmp_path / "ps.ckpt", started()
    _versions(server, 1, 3, 0.0)
    save(server, path, now=5.0, key=KEY)
    whole = history_path(path).read_bytes().rstrip(b"\0")  # its records (zeros follow, written ahead)
    for damaged, why in (
        (whole[:-1], "short"),
        (whole[:-3] + bytes([whole[-3] ^ 1]) + whole[-2:], "damaged"),
        (b"EPSHIST0" + whole[8:], "bad magic"),
    ):
        history_path(path).write_bytes(damaged)
        with pytest.raises(CheckpointError, match=why):
            restore(small_server(pace="bsp", rounds=20), path, now=9.0, key=KEY)
    history_path(path).unlink()
    with pytest.raises(CheckpointError, match="history is missing"):
        restore(small_server(pace="bsp", rounds=20), path, now=9.0, key=KEY)
    _versions(server, 4, 1, 5.0)  # another snapshot's history, one record longer: the prefix is not enough
    other = tmp_path / "other.ckpt"
    save(server, other, now=9.0, key=KEY)
    history_path(path).write_bytes(history_path(other).read_bytes()[: len(whole)])
    with pytest.raises(CheckpointError, match="damaged or not this checkpoint's"):
        restore(small_server(pace="bsp", rounds=20), path, now=9.0, key=KEY)


def test_what_a_snapshot_that_did_not_land_appended_is_ignored_then_written_over(tmp_path) -> None:
    """A crash between appending the history and writing the snapshot leaves records the snapshot on
    disk does not name: a resumed server reads its own and writes over the rest."""
    path, server = tmp_path / "ps.ckpt", started()
    history = History(history_path(path))
    snapshot(server, path, 1.0, KEY, 1, history).write()
    _versions(server, 1, 2, 1.0)
    landed = snapshot(server, path, 4.0, KEY, 2, history).history  # the history part landed, the snapshot not
    landed.write()
    restored = small_server(pace="bsp", rounds=20)
    again = History(history_path(path))
    assert recover(restored, path, 10.0, KEY, again) == (1, 0)  # snapshot 1 (no journal beside it here)
    assert len(restored.history) == 1 and again.records == 1 and again.size == landed.start
    _versions(restored, 1, 1, 10.0)
    part = snapshot(restored, path, 12.0, KEY, 3, again)
    part.write()
    assert part.history.start == landed.start and part.history.data != landed.data  # written over
    final = small_server(pace="bsp", rounds=20)
    restore(final, path, now=20.0, key=KEY)
    assert final.history == restored.history and len(final.history) == 2


def test_a_history_grows_by_zeros_ahead_of_its_records(tmp_path) -> None:
    """Past the file's end, zeros first (``HISTORY_EXTEND`` beyond the part), then the part over them:
    a snapshot's history sync then writes data, not the file's size."""
    path, server = tmp_path / "ps.ckpt", started()
    history = History(history_path(path))
    sizes = []
    for round_ in range(4):
        _versions(server, 1 + round_, 1, float(round_))
        snapshot(server, path, round_ + 0.5, KEY, round_ + 1, history).write()
        sizes.append(history_path(path).stat().st_size)
    assert len(set(sizes)) == 1 and history.size < sizes[0] <= history.size + HISTORY_EXTEND  # one growth
    restored = small_server(pace="bsp", rounds=20)
    restore(restored, path, now=9.0, key=KEY)
    assert restored.history == server.history


def test_a_checkpoint_of_the_release_before_with_its_history_inside_is_still_read(tmp_path) -> None:
    """``EPSCKPT2`` held the metrics history between the state and the archive; a server upgraded
    with one on disk resumes, and its next snapshot writes the whole history beside it."""
    path, server = tmp_path / "ps.ckpt", started()
    _versions(server, 1, 2, 0.0)
    save(server, path, now=3.0, key=KEY)
    body = path.read_bytes()[len(MAGIC) + 32 :]
    (n,) = struct.unpack_from("<I", body)
    state = json.loads(body[4 : 4 + n])
    state["format"] = "edgeps-checkpoint/2"
    del state["history"]
    text, history = json.dumps(state).encode(), b"[" + b",".join(server.history_json) + b"]"
    old = struct.pack("<I", len(text)) + text + struct.pack("<I", len(history)) + history + body[4 + n :]
    path.write_bytes(MAGIC_2 + hmac.new(KEY, old, hashlib.sha256).digest() + old)
    history_path(path).unlink()
    restored = small_server(pace="bsp", rounds=20)
    fresh = History(history_path(path))
    recover(restored, path, 10.0, KEY, fresh)
    assert restored.history == server.history and restored.store.version == 2
    snapshot(restored, path, 11.0, KEY, 1, fresh).write()
    final = small_server(pace="bsp", rounds=20)
    restore(final, path, now=20.0, key=KEY)
    assert final.history == server.history and path.read_bytes()[: len(MAGIC)] == MAGIC
    assert history_path(path).read_bytes()[:8] == b"EPSHIST1"


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
