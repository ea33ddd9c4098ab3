"""The server's write-ahead log: what each turn fed its core, so that a checkpoint costs what is new.

A snapshot (ps_service.io.checkpoint: the core's whole state, signed) is written now and then;
between two snapshots, every turn appends one record to the journal beside it (``PATH.wal``):
the calls the driver made on the core that turn, in order, each with the ``now`` it carried
(``on_tick``, ``receive`` with the inbound message, ``after_batch``). The core is a pure state
machine of those calls, so a server that restarts loads the snapshot at the clock it was written
at, makes the journal's calls again (``recover``), and is where it was after the last record.

Durability (the fsync policy): a turn's record is written and ``fdatasync``-ed before its results
are published and its messages acknowledged to the broker, as the whole checkpoint was before. A
message the broker saw acknowledged is therefore in the snapshot or the journal, and made again
exactly once on recovery; one that is not was never acknowledged and comes again from the broker
(its sequence number then tells the door whether the journal had it: ``replayed``). A record cut
short by a crash was never synced, so nothing it holds was acknowledged: recovery stops before it.
Turns that fed the core only time (an idle ``on_tick``) are kept and written with the next record
that carries a message or a result, so that an idle server does not sync four times a second.

A record is written in two parts, on the journal's own thread (hashlib, the write and the sync
release the GIL). The turn's messages are known when the turn starts (``begin``): they are signed
and written while the core processes them. The calls (a few bytes each), the signature and the
sync follow at the end of the turn (``end``, a future); the driver waits for it before the turn's
results leave, and after a full batch it processes the next one meanwhile (broker.driver).

A new snapshot is taken when the journal passes ``SNAPSHOT_BYTES`` (recovery replays at most
that much), when the server starts or resumes, and then the journal starts afresh. The snapshot
names its journal (``id``, a counter) and the clock it was written at; a journal of another id
(left by a crash between the snapshot and the new journal) is stale and ignored.

File layout: ``EPSWAL02``, u64 id, HMAC-SHA256 of both (32 bytes); then records: u32 a, a bytes of
messages, u32 b, b bytes of calls, HMAC-SHA256 (32 bytes) of the id, the record's index (u64) and
the record's bytes before it, keyed with the checkpoint key: a record that is altered, moved or
taken from another journal is refused. A message: u8 flags (qos in bits 0-1, retained 2, duplicate
3, response topic 4, correlation 5), u32 mid, u16 + topic, u32 + payload, then u16 + response topic
and u32 + correlation where the flags say so. A call: ``T``, ``A`` or ``M`` and f64 now; an ``M``
is the record's next message. (A journal of 1.x, ``EPSWAL01``, is still read: its records are u32
n, n bytes of calls whose ``M`` holds its message after now, and the HMAC of the id, the index
and the calls.)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from broker.driver import Core
from ps_service.io.checkpoint import CheckpointError, load, read, write_atomic
from schemas.events import Events
from schemas.topics import Inbound, Publish

MAGIC = b"EPSWAL02"
#: The journal of 1.x: one part a record, each message inside its call (still read).
MAGIC_1 = b"EPSWAL01"
#: Journal bytes after which the server takes a new snapshot (bounds recovery's replay).
SNAPSHOT_BYTES = 64 << 20
#: Idle turns' calls kept unwritten at most (then written with a sync of their own).
IDLE_BYTES = 64 << 10
_MAC = 32
_ID = struct.Struct("<Q")
_LEN = struct.Struct("<I")
_NOW = struct.Struct("<cd")
_MSG = struct.Struct("<BI")
_U16 = struct.Struct("<H")


def journal_path(checkpoint: Path) -> Path:
    """Where the journal of the snapshot at ``checkpoint`` lives."""
    return checkpoint.with_name(checkpoint.name + ".wal")


def _record_mac(key: bytes, journal: int, index: int, body: bytes | bytearray = b"") -> Any:
    """The record's HMAC, fed ``body`` so far (``update`` it with the rest)."""
    mac = hmac.new(key, _ID.pack(journal) + _ID.pack(index), hashlib.sha256)
    mac.update(body)
    return mac


def _write(fd: int, parts: list[bytes | bytearray | memoryview]) -> int:
    """Append ``parts`` whole (a short write of a few MB is possible: what is left is written); the bytes."""
    total = sum(len(part) for part in parts)
    while parts:
        written = os.writev(fd, parts)
        while parts and written >= len(parts[0]):
            written -= len(parts.pop(0))
        if parts and written:
            parts[0] = memoryview(parts[0])[written:]
    return total


class Journal:
    """An open journal, appended to turn by turn: ``begin`` a record with the turn's messages (signed
    and written meanwhile by the journal's own thread), ``end`` it with its calls (its future is done
    once the record is synced; ``append`` waits for it). ``size``: the bytes of the records synced."""

    def __init__(self, path: Path, key: bytes, journal: int) -> None:
        """Start the journal of snapshot ``journal`` afresh: written beside ``path`` and renamed over
        it once synced, so that a crash leaves the old journal (stale: another id) or the new one."""
        self.path, self.key, self.id = path, key, journal
        self.index, self.size = 0, 0
        head = MAGIC + _ID.pack(journal)
        write_atomic(path, head + hmac.new(key, head, hashlib.sha256).digest())
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="edgeps-journal")
        self._open: tuple[Any, Future[int]] | None = None  # the record begun: its HMAC, its messages written

    def begin(self, messages: Sequence[Inbound]) -> None:
        """Start the next record with a turn's ``messages``: encoded here, signed and written by the
        journal's thread while the core processes them."""
        self._finish_open()  # (a record begun and never appended: never the driver's way)
        part = bytearray()
        for message in messages:
            encode_inbound(message, part)
        mac = _record_mac(self.key, self.id, self.index)
        self._open = mac, self._writer.submit(self._messages, mac, part)

    def _messages(self, mac: Any, part: bytearray) -> int:
        head = _LEN.pack(len(part))
        mac.update(head)
        mac.update(part)
        return _write(self.fd, [head, part])

    def end(self, calls: bytes | bytearray) -> Future[None]:
        """Finish the record begun (one without messages where none was) with ``calls``, its HMAC and
        the sync, on the journal's thread: the record is on disk when the future is done."""
        if self._open is None:
            self.begin(())
        assert self._open is not None
        (mac, written), self._open = self._open, None
        self.index += 1  # the next record's (``begin`` signs with it)
        return self._writer.submit(self._end, mac, written, calls)

    def append(self, calls: bytes | bytearray) -> None:
        """``end`` the record, and wait until it is on disk."""
        self.end(calls).result()

    def _end(self, mac: Any, written: Future[int], calls: bytes | bytearray) -> None:
        size = written.result()  # written already: the thread does one thing after another
        tail = _LEN.pack(len(calls))
        mac.update(tail)
        mac.update(calls)
        size += _write(self.fd, [tail, calls, mac.digest()])
        os.fdatasync(self.fd)
        self.size += size

    def _finish_open(self) -> None:
        """Wait for a record's messages part being written, and drop that record (it is incomplete)."""
        if self._open is not None:
            _, written = self._open
            self._open = None
            written.result()

    def close(self) -> None:
        try:
            self._finish_open()
        finally:
            self._writer.shutdown()
            os.close(self.fd)


class Record(NamedTuple):
    """A journal record as read: its messages part (None in a 1.x journal, whose calls hold them)
    and its calls."""

    messages: bytes | None
    calls: bytes


def read_journal(path: Path, key: bytes, journal: int) -> list[Record]:
    """The records of the journal at ``path`` if it is snapshot ``journal``'s (none if there is no
    journal, or a stale one); the records up to one a crash cut short. CheckpointError for a journal
    that does not verify under ``key``."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    head = len(MAGIC) + _ID.size
    if len(data) < head + _MAC or data[: len(MAGIC)] not in (MAGIC, MAGIC_1):
        raise CheckpointError(f"{path} is not an edgeps journal")
    if not hmac.compare_digest(data[head : head + _MAC], hmac.new(key, data[:head], hashlib.sha256).digest()):
        raise CheckpointError(f"{path}: journal damaged or not signed with this server's key: refusing it")
    if _ID.unpack_from(data, len(MAGIC))[0] != journal:
        return []  # written before the snapshot now on disk: what it holds is in the snapshot
    parts = 1 if data[: len(MAGIC)] == MAGIC_1 else 2
    records: list[Record] = []
    pos = head + _MAC
    while True:
        bodies, end = [], pos
        for _ in range(parts):
            if end + _LEN.size > len(data):
                return records  # the record a crash cut short: never synced, nothing in it acknowledged
            (n,) = _LEN.unpack_from(data, end)
            bodies.append(data[end + _LEN.size : end + _LEN.size + n])
            end += _LEN.size + n
        if end + _MAC > len(data):
            return records
        signed = data[pos:end] if parts == 2 else bodies[0]  # 1.x: the calls alone
        if not hmac.compare_digest(data[end : end + _MAC], _record_mac(key, journal, len(records), signed).digest()):
            raise CheckpointError(f"{path}: record {len(records)} damaged or forged: refusing the journal")
        records.append(Record(bodies[0], bodies[1]) if parts == 2 else Record(None, bodies[0]))
        pos = end + _MAC


def encode_inbound(message: Inbound, out: bytearray) -> bytearray:
    """``message`` as a record holds it, appended to ``out``: each part written once, the payload copied once."""
    flags = (message.qos & 3) | message.retain << 2 | message.duplicate << 3
    flags |= (message.response_topic is not None) << 4 | (message.correlation is not None) << 5
    topic = message.topic.encode()
    out += _MSG.pack(flags, message.mid)
    out += _U16.pack(len(topic))
    out += topic
    out += _LEN.pack(len(message.payload))
    out += message.payload
    if message.response_topic is not None:
        response = message.response_topic.encode()
        out += _U16.pack(len(response))
        out += response
    if message.correlation is not None:
        out += _LEN.pack(len(message.correlation))
        out += message.correlation
    return out


Call = tuple[bytes, float, Inbound | None]


class _Cursor:
    """Reads a record's bytes, verified already: a fault here is a bug, not an attack (ValueError)."""

    def __init__(self, body: bytes) -> None:
        self.view, self.pos = memoryview(body), 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.view):
            raise ValueError("journal record cut short")
        self.pos += n
        return bytes(self.view[self.pos - n : self.pos])

    def more(self) -> bool:
        return self.pos < len(self.view)

    def inbound(self) -> Inbound:
        flags, mid = _MSG.unpack(self.take(_MSG.size))
        topic = self.take(_U16.unpack(self.take(2))[0]).decode()
        payload = self.take(_LEN.unpack(self.take(4))[0])
        response = self.take(_U16.unpack(self.take(2))[0]).decode() if flags & 16 else None
        correlation = self.take(_LEN.unpack(self.take(4))[0]) if flags & 32 else None
        return Inbound(topic, payload, mid, flags & 3, response, correlation, bool(flags & 4), bool(flags & 8))


def decode_calls(body: bytes) -> list[Call]:
    """A 1.x record's calls: (``T``, ``M`` or ``A``, now, the message of an ``M``)."""
    calls: list[Call] = []
    cursor = _Cursor(body)
    while cursor.more():
        kind, now = _NOW.unpack(cursor.take(_NOW.size))
        calls.append((kind, now, cursor.inbound() if kind == b"M" else None))
    return calls


def decode_record(record: Record) -> list[Call]:
    """A record's calls, each ``M`` with its message: (``T``, ``M`` or ``A``, now, message or None)."""
    if record.messages is None:
        return decode_calls(record.calls)
    messages, calls = _Cursor(record.messages), _Cursor(record.calls)
    out: list[Call] = []
    while calls.more():
        kind, now = _NOW.unpack(calls.take(_NOW.size))
        out.append((kind, now, messages.inbound() if kind == b"M" else None))
    if messages.more():
        raise ValueError("journal record holds messages no call takes")
    return out


class Recorded:
    """A core (the driver's ``Core`` protocol) whose state-changing calls are written down: the
    driver runs this in its place, and the server takes each turn's ``calls`` into its journal."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.events: Events = core.events  # the core's own: what it says, the driver logs
        self.calls = bytearray()

    @property
    def done(self) -> bool:
        return self.core.done

    def receive(self, message: Inbound, now: float) -> list[Publish]:
        self.calls += _NOW.pack(b"M", now)  # the message itself is in the record's messages part (``Journal.begin``)
        return self.core.receive(message, now)

    def on_tick(self, now: float) -> list[Publish]:
        self.calls += _NOW.pack(b"T", now)
        return self.core.on_tick(now)

    def after_batch(self, now: float) -> list[Publish]:
        self.calls += _NOW.pack(b"A", now)
        return self.core.after_batch(now)

    def next_deadline(self) -> float | None:
        return self.core.next_deadline()

    def subscriptions(self) -> list[str]:
        return self.core.subscriptions()

    def resubscriptions(self) -> list[str]:
        return self.core.resubscriptions()

    def acknowledge(self, batch: list[Inbound]) -> list[Inbound]:
        return self.core.acknowledge(batch)

    def take(self) -> bytearray:
        """The calls since the last ``take``."""
        calls, self.calls = self.calls, bytearray()
        return calls


def replay(core: Core, records: list[Record]) -> tuple[int, float | None]:
    """Make ``records``' calls on ``core`` again, in order (their results were published when they
    were made): the number of messages made again, and the last call's clock."""
    messages, last = 0, None
    for record in records:
        for kind, now, message in decode_record(record):
            if kind == b"T":
                core.on_tick(now)
            elif kind == b"A":
                core.after_batch(now)
            else:
                assert message is not None
                core.receive(message, now)
                messages += 1
            last = now
    return messages, last


def recover(core: Any, checkpoint: Path, now: float, key: bytes) -> tuple[int, int]:
    """Make ``core`` the server that wrote the snapshot at ``checkpoint`` and its journal: the
    snapshot loaded at the clock it was taken at, the journal's calls made again, then every time
    moved to ``now`` (as a snapshot taken after the last record would be). (The journal's id,
    the messages made again.)"""
    state, history = read(core, checkpoint, key)
    journal = state.get("journal") or {}  # a snapshot from before the journal has none
    number = int(journal.get("id", 0))
    records = read_journal(journal_path(checkpoint), key, number)
    if not records:
        load(core, state, history, now, checkpoint)
        return number, 0
    load(core, state, history, float(journal["clock"]), checkpoint)
    messages, last = replay(core, records)
    core.events.take()  # said when the calls were first made
    if last is not None:
        core.load_state(core.to_state(last), list(core.history), now)
    return number, messages
