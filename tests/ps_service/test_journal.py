"""The server's journal: a snapshot and the turns after it make the server that wrote them; a
record cut short is dropped, a forged one refused, a stale journal ignored."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from functools import partial

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ps_service.io.checkpoint import CheckpointError, save
from ps_service.io.journal import (
    MAGIC_1,
    MAGIC_2,
    Journal,
    Record,
    Recorded,
    decode_calls,
    decode_record,
    encode_inbound,
    journal_path,
    read_journal,
    recover,
)
from schemas.messages import DeviceStatus
from schemas.topics import Inbound
from tests.helpers import commit_bytes, small_server

KEY = b"k" * 32


def _turn(recorded: Recorded, journal: Journal, now: float, *messages: Inbound) -> None:
    """One driver turn: tick, messages, after_batch; its record synced."""
    recorded.on_tick(now)
    for message in messages:
        recorded.receive(message, now)
    recorded.after_batch(now)
    journal.write(messages, recorded.take()).result()


def encode_message(now: float, message: Inbound) -> bytearray:
    """A 1.x ``receive`` call, as a 1.x server wrote it: its message inside, after the clock."""
    return bytearray(b"".join(encode_inbound(message, [b"M" + struct.pack("<d", now)])))


def _hello(server, device: str) -> Inbound:
    status = DeviceStatus(device=device, state="online", incarnation=1, samples=100).to_bytes()
    return Inbound(server.topics.status(device), status, 1, 1)


def _commit(server, device: str, seq: int, scale: float = 0.1) -> Inbound:
    return Inbound(server.topics.grad(device), commit_bytes(server, device, seq, scale=scale), seq, 1)


def _job(tmp_path):
    """A bsp server with a snapshot after its start and a journal of five turns (a commit
    buffered in the open round at the end)."""
    server = small_server(pace="bsp", rounds=20, frequency="trend", balance="release")
    server.start(0.0)
    checkpoint = tmp_path / "ps.ckpt"
    save(server, checkpoint, 0.0, KEY, journal=1)
    recorded, journal = Recorded(server), Journal(journal_path(checkpoint), KEY)
    journal.restart(1).result()
    _turn(recorded, journal, 0.5, _hello(server, "a"), _hello(server, "b"))
    _turn(recorded, journal, 1.0, _commit(server, "a", 1), _commit(server, "b", 1))
    _turn(recorded, journal, 1.2)  # time only
    _turn(recorded, journal, 2.0, _commit(server, "a", 2, 0.2), _commit(server, "b", 2, 0.3))
    _turn(recorded, journal, 2.5, _commit(server, "a", 3, 0.2))  # buffered
    journal.close()
    return server, checkpoint


def test_a_snapshot_and_its_journal_make_the_server_that_wrote_them(tmp_path) -> None:
    original, checkpoint = _job(tmp_path)
    assert original.store.version == 2 and original.traffic.applied == 4
    restored = small_server(pace="bsp", rounds=20, frequency="trend", balance="release")
    number, messages = recover(restored, checkpoint, 100.0, KEY)  # a new process: another clock
    assert (number, messages) == (1, 7)
    assert restored.store.version == 2 and restored.traffic.applied == 4
    for name, values in original.store.params().items():
        np.testing.assert_array_equal(restored.store.params()[name], values)
    timeless = [[m.model_copy(update={"eval_s": 0.0}) for m in s.history] for s in (restored, original)]
    assert timeless[0] == timeless[1]  # (eval_s: how long the evaluation took, measured again)
    # the same from here on: the buffered commit is held, a redelivered one is refused as replayed
    for server, now in ((original, 3.0), (restored, 100.5)):
        server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 3, scale=0.2), now)
        server.on_message(server.topics.grad("b"), commit_bytes(server, "b", 3, scale=0.3), now)
    assert restored.store.version == original.store.version == 3
    assert restored.traffic.rejected == original.traffic.rejected == {"replayed": 1}
    assert _plain(restored.to_state(200.0)) == _plain(original.to_state(102.5))  # every field, times as ages


@pytest.mark.parametrize("writer", ["openssl", "cryptography"])
def test_records_signed_through_the_kernel_or_by_cryptography_read_back_either_way(
    tmp_path, monkeypatch, writer
) -> None:
    """A record's Poly1305 tag is the same whether ``schemas._kernels`` had OpenSSL make it (the
    journal's thread, GIL released) or the cryptography package did (a server without the module):
    written one way, the journal is read back the other."""
    from schemas.codecs import bits

    if bits.kernels is None or not bits.kernels.has_poly1305():
        pytest.skip("schemas._kernels is not built here, or found no OpenSSL 3")
    kernels = bits.kernels
    monkeypatch.setattr(bits, "kernels", kernels if writer == "openssl" else None)
    _, checkpoint = _job(tmp_path)
    monkeypatch.setattr(bits, "kernels", None if writer == "openssl" else kernels)
    restored = small_server(pace="bsp", rounds=20, frequency="trend", balance="release")
    assert recover(restored, checkpoint, 100.0, KEY) == (1, 7)
    assert restored.store.version == 2 and restored.traffic.applied == 4


def _plain(state) -> str:
    return json.dumps(
        state, default=lambda v: np.asarray(v).tolist() if hasattr(v, "shape") else list(v), sort_keys=True
    )


def _records_end(path) -> int:
    """Where the journal at ``path`` (journal 1) ends: its head and its records (zeros follow)."""
    return 64 + sum(4 + len(r.messages or b"") + 4 + len(r.calls) + 16 for r in read_journal(path, KEY, 1))


def test_a_record_a_crash_cut_short_is_dropped_and_a_forged_one_refused(tmp_path) -> None:
    _, checkpoint = _job(tmp_path)
    path = journal_path(checkpoint)
    whole = path.read_bytes()
    assert len(read_journal(path, KEY, 1)) == 5
    end = _records_end(path)
    assert len(whole) > end and not any(whole[end:])  # the file's blocks written before the records
    last = read_journal(path, KEY, 1)[-1]
    assert last.messages is not None
    size = 4 + len(last.messages) + 4 + len(last.calls) + 16  # its Poly1305 tag
    for cut in range(1, size + 1, 5):  # its MAC, its calls, its messages: never synced, never acknowledged
        path.write_bytes(whole[: end - cut])  # a copy cut short
        assert len(read_journal(path, KEY, 1)) == 4, cut
        path.write_bytes(whole[: end - cut] + bytes(len(whole) - end + cut))  # a write torn: zeros were there
        assert len(read_journal(path, KEY, 1)) == (4 if any(whole[end - cut : end]) else 5), cut  # (zeros kept)
    stale = bytes(range(256)) * (len(whole) // 256 + 1)  # or an older journal's bytes
    path.write_bytes(whole[: end - size // 2] + stale[: len(whole) - end + size // 2])
    assert len(read_journal(path, KEY, 1)) == 4
    restored = small_server(pace="bsp", rounds=20, frequency="trend", balance="release")
    assert recover(restored, checkpoint, 50.0, KEY) == (1, 6)
    assert restored.store.version == 2 and not restored.pace.take_all()  # the cut commit: from the broker again
    for at in (end // 2, end - size - 20):  # a byte of a message, a byte of a call, in records others follow
        forged = bytearray(whole)
        forged[at] ^= 1
        path.write_bytes(bytes(forged))
        with pytest.raises(CheckpointError, match="damaged or forged"):
            read_journal(path, KEY, 1)
    path.write_bytes(whole)
    with pytest.raises(CheckpointError, match="not signed"):
        read_journal(path, b"x" * 32, 1)


def test_a_new_journal_writes_over_the_old_ones_file_and_reads_back_only_its_own(tmp_path) -> None:
    """The blocks a record lands on are written before it (a sync then writes no file metadata):
    a new journal takes the old one's file, and what lies past its records is not read."""
    server, checkpoint = _job(tmp_path)
    path = journal_path(checkpoint)
    before, inode = path.stat().st_size, path.stat().st_ino
    recorded, journal = Recorded(server), Journal(path, KEY)
    journal.restart(2, partial(save, server, checkpoint, 3.0, KEY, 2)).result()
    _turn(recorded, journal, 3.5, _hello(server, "c"))
    journal.close()
    assert path.stat().st_ino == inode and path.stat().st_size == before  # the same file, grown by nothing
    assert len(read_journal(path, KEY, 2)) == 1  # the five records of journal 1 after it: stale
    restored = small_server(pace="bsp", rounds=20, frequency="trend", balance="release")
    assert recover(restored, checkpoint, 10.0, KEY) == (2, 1)
    assert restored.store.version == 2 and restored.traffic.applied == 4


def test_a_journal_grows_by_zeros_ahead_of_its_records(tmp_path, monkeypatch) -> None:
    """Past the file's end, zeros first (``EXTEND_BYTES`` beyond the record), then the record over them."""
    monkeypatch.setattr("ps_service.io.journal.EXTEND_BYTES", 10_000)
    server = small_server()
    journal = Journal(tmp_path / "j.wal", KEY)
    journal.restart(1).result()
    sizes = []
    for seq in range(1, 40):
        journal.write([_commit(server, "a", seq)], b"M" + struct.pack("<d", float(seq))).result()
        sizes.append((tmp_path / "j.wal").stat().st_size)
    journal.close()
    assert sizes == sorted(sizes) and len(set(sizes)) <= len(sizes) // 4  # a record of 1.9 KB: one growth in 5
    assert _records_end(tmp_path / "j.wal") < sizes[-1] <= _records_end(tmp_path / "j.wal") + 10_000
    assert len(read_journal(tmp_path / "j.wal", KEY, 1)) == 39


def test_a_journal_of_an_earlier_snapshot_is_ignored(tmp_path) -> None:
    """A crash between a new snapshot and its fresh journal leaves the old journal: what it holds
    is in the snapshot, and making it again would apply its commits twice."""
    original, checkpoint = _job(tmp_path)
    save(original, checkpoint, 3.0, KEY, journal=2)
    assert read_journal(journal_path(checkpoint), KEY, 2) == []
    restored = small_server(pace="bsp", rounds=20, frequency="trend", balance="release")
    assert recover(restored, checkpoint, 10.0, KEY) == (2, 0)
    assert restored.store.version == 2 and restored.traffic.applied == 4


def _signed_head(magic: bytes) -> bytearray:
    """An earlier release's journal head for journal 1: magic, id, and their HMAC-SHA256."""
    head = magic + struct.pack("<Q", 1)
    return bytearray(head + hmac.new(KEY, head, hashlib.sha256).digest())


def _resumes_as(original, checkpoint) -> None:
    """A server recovered from ``checkpoint`` makes the journal's 7 messages again and is at ``original``'s version."""
    restored = small_server(pace="bsp", rounds=20, frequency="trend", balance="release")
    assert recover(restored, checkpoint, 100.0, KEY) == (1, 7)
    assert restored.store.version == original.store.version == 2 and restored.traffic.applied == 4


def test_a_journal_of_1x_with_each_message_inside_its_call_is_still_read(tmp_path) -> None:
    """A server upgraded after a crash finds the journal its 1.x wrote: ``EPSWAL01``, one part a
    record (each message after its call's clock), signed over the id, the index and the calls."""
    original, checkpoint = _job(tmp_path)
    path = journal_path(checkpoint)
    records = read_journal(path, KEY, 1)
    legacy = _signed_head(MAGIC_1)
    for index, record in enumerate(records):
        calls = bytearray()
        for kind, now, message in decode_record(record):
            calls += encode_message(now, message) if message is not None else kind + struct.pack("<d", now)
        mac = hmac.new(KEY, struct.pack("<QQ", 1, index) + calls, hashlib.sha256).digest()
        legacy += struct.pack("<I", len(calls)) + calls + mac
    path.write_bytes(bytes(legacy))
    assert [decode_record(r) for r in read_journal(path, KEY, 1)] == [decode_record(r) for r in records]
    _resumes_as(original, checkpoint)


def test_a_journal_of_the_release_before_signed_with_hmac_is_still_read(tmp_path) -> None:
    """``EPSWAL02``: two parts a record as now, no salt, each record's MAC the HMAC-SHA256 of the id,
    the index and the record's bytes before it."""
    original, checkpoint = _job(tmp_path)
    path = journal_path(checkpoint)
    records = read_journal(path, KEY, 1)
    legacy = _signed_head(MAGIC_2)
    for index, record in enumerate(records):
        assert record.messages is not None
        body = struct.pack("<I", len(record.messages)) + record.messages + struct.pack("<I", len(record.calls))
        body += record.calls
        legacy += body + hmac.new(KEY, struct.pack("<QQ", 1, index) + body, hashlib.sha256).digest()
    path.write_bytes(bytes(legacy))
    assert read_journal(path, KEY, 1) == records
    _resumes_as(original, checkpoint)
    legacy[-40] ^= 1  # a byte of the last record's calls
    path.write_bytes(bytes(legacy))
    with pytest.raises(CheckpointError, match="record 4 damaged or forged"):
        read_journal(path, KEY, 1)


def test_a_restart_writes_the_snapshot_after_the_records_before_it_and_journals_afresh(tmp_path) -> None:
    """``restart`` with a snapshot: written on the journal's thread in order, then the journal of the
    new id; what follows is recorded there, and the snapshot and it make the server."""
    server = small_server(pace="bsp", rounds=20)
    server.start(0.0)
    checkpoint = tmp_path / "ps.ckpt"
    save(server, checkpoint, 0.0, KEY, journal=1)
    recorded, journal = Recorded(server), Journal(journal_path(checkpoint), KEY)
    journal.restart(1).result()
    _turn(recorded, journal, 0.5, _hello(server, "a"), _hello(server, "b"))
    recorded.receive(_commit(server, "a", 1), 1.0)  # a turn whose state goes into the snapshot instead
    snapshot = partial(save, server, checkpoint, 1.0, KEY, 2)  # the state now, written on the thread
    recorded.take()
    journal.restart(2, snapshot).result()
    assert journal.size == 0 and read_journal(journal_path(checkpoint), KEY, 2) == []
    _turn(recorded, journal, 2.0, _commit(server, "b", 1))
    journal.close()
    assert server.store.version == 1
    restored = small_server(pace="bsp", rounds=20)
    assert recover(restored, checkpoint, 10.0, KEY) == (2, 1)  # the snapshot, then one commit made again
    assert restored.store.version == 1 and restored.traffic.applied == 2


def test_a_record_from_another_journal_of_the_same_id_is_refused(tmp_path) -> None:
    """Each journal has its salt, so its records' key: a backup restored makes journal ids again,
    and a record of one never verifies in another (nor does a nonce come again under a key)."""
    server = small_server()
    journals = []
    for name in ("one.wal", "two.wal"):
        journal = Journal(tmp_path / name, KEY)
        journal.restart(1).result()
        for _ in range(2):
            journal.write([_hello(server, "a")], b"M" + struct.pack("<d", 1.0))
        journal.close()
        journals.append((tmp_path / name).read_bytes())
    head, end = 8 + 8 + 16 + 32, _records_end(tmp_path / "one.wal")
    record = (end - head) // 2
    assert journals[0][:8] == b"EPSWAL04" and journals[0][8:16] == journals[1][8:16]
    assert journals[0][16:32] != journals[1][16:32]  # the salts
    assert journals[0][head : head + record - 16] == journals[1][head : head + record - 16]
    assert journals[0][head + record - 16 : head + record] != journals[1][head + record - 16 : head + record]  # tags
    spliced = tmp_path / "spliced.wal"
    spliced.write_bytes(journals[0][:head] + journals[1][head : head + record] + journals[0][head + record :])
    with pytest.raises(CheckpointError, match="record 0 damaged or forged"):  # one record in another's place
        read_journal(spliced, KEY, 1)
    spliced.write_bytes(journals[0][:head] + journals[1][head:])  # all of another's: none of them read
    assert read_journal(spliced, KEY, 1) == [] and len(read_journal(tmp_path / "two.wal", KEY, 1)) == 2


def test_a_journal_of_the_release_before_appended_to_refuses_any_record_that_fails(tmp_path) -> None:
    """``EPSWAL03``: laid out as now, but the file ended where its records did, so a record that does
    not verify is damage even at the end (a crash could only cut it short)."""
    original, checkpoint = _job(tmp_path)
    path = journal_path(checkpoint)
    records, end = read_journal(path, KEY, 1), _records_end(path)
    head = b"EPSWAL03" + path.read_bytes()[8:32]
    legacy = bytearray(head + hmac.new(KEY, head, hashlib.sha256).digest() + path.read_bytes()[64:end])
    path.write_bytes(bytes(legacy))
    assert read_journal(path, KEY, 1) == records
    _resumes_as(original, checkpoint)
    path.write_bytes(bytes(legacy[:-7]))
    assert len(read_journal(path, KEY, 1)) == 4
    legacy[-20] ^= 1  # a byte of the last record's calls
    path.write_bytes(bytes(legacy))
    with pytest.raises(CheckpointError, match="record 4 damaged or forged"):
        read_journal(path, KEY, 1)


@given(
    topic=st.text(min_size=1, max_size=40),
    payload=st.binary(max_size=200),
    mid=st.integers(0, 65535),
    qos=st.integers(0, 2),
    response=st.none() | st.text(max_size=30),
    correlation=st.none() | st.binary(max_size=30),
    retain=st.booleans(),
    duplicate=st.booleans(),
    now=st.floats(allow_nan=False, allow_infinity=False),
)
def test_a_message_call_reads_back_as_it_was_written(
    topic, payload, mid, qos, response, correlation, retain, duplicate, now
) -> None:
    message = Inbound(topic, payload, mid, qos, response, correlation, retain, duplicate)
    tick = b"T" + np.float64(now).tobytes()
    expected = [(b"T", now, None), (b"M", now, message), (b"T", now, None)]
    assert decode_calls(tick + encode_message(now, message) + tick) == expected  # 1.x
    calls = tick + b"M" + np.float64(now).tobytes() + tick
    assert decode_record(Record(b"".join(encode_inbound(message, [])), calls)) == expected
