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

A turn's record is laid out and signed by the driver (``write``: the messages' headers, the
payloads not copied; its Poly1305 tag by OpenSSL through ``schemas._kernels``, about 2 us a 19 KB
commit with the GIL released, so that the network thread and the journal's run meanwhile; the
cryptography package's, 2.6 us holding it, where the module is not built or finds no OpenSSL 3)
and written by the journal's own thread in one system call (the journal is opened ``O_DSYNC``:
the write returns once the record is on disk). The driver waits for it before the turn's results
leave, and processes the next turns meanwhile (``broker.driver.HELD``). The MAC is not made on the
journal's thread: taking the GIL back after it would be one more wait of up to a switch interval
(5 ms) while the driver is busy.

The file's blocks are written before a record lands on them, so that a record's sync writes data
and no file metadata (an append that grows the file makes ext4 commit its own journal at each
sync: 4.5 ms against 0.8 for a 1.2 MB record here). A new journal takes the old journal's file
(stale once the new snapshot is on disk) and writes over it; past its end the file grows by
``EXTEND_BYTES`` of zeros at a time. What lies after the last record is therefore an older
journal's bytes or zeros, and the first record that does not verify is the end: one a crash cut
short (never synced, nothing in it acknowledged), unless the record after it verifies, which a
crash cannot make (a record is written only once the one before it is on disk): that one was
damaged, and the journal is refused.

A new snapshot is taken when the journal passes ``SNAPSHOT_BYTES`` (recovery replays at most
that much), when the server starts or resumes, and then the journal starts afresh (``restart``:
the snapshot's state is encoded at once; the snapshot is written, and the new journal started,
on the journal's thread, in order after the records before it). The snapshot names its journal
(``id``, a counter) and the clock it was written at; a journal of another id (left by a crash
between the snapshot and the new journal) is stale and ignored.

File layout: ``EPSWAL04``, u64 id, 16 random bytes (the journal's salt), HMAC-SHA256 of the three
(32 bytes); then records: u32 a, a bytes of messages, u32 b, b bytes of calls, and the record's
Poly1305 tag (16 bytes) of the record's bytes before it, under a key of its own: the HMAC-SHA256,
keyed with the checkpoint key, of ``edgeps journal record``, the id, the salt and the record's
index (u64). A record that is altered, moved or taken from another journal is refused, and the
salt makes every journal's keys its own (a backup restored, whose journal ids come again, never
uses a record's key twice). A message: u8 flags (qos in bits 0-1, retained 2, duplicate 3,
response topic 4, correlation 5), u32 mid, u16 + topic, u32 + payload, then u16 + response topic
and u32 + correlation where the flags say so. A call: ``T``, ``A`` or ``M`` and f64 now; an ``M`` is
the record's next message.

Journals of earlier releases are still read, so that a server upgraded after a crash resumes:
``EPSWAL03`` is laid out as ``EPSWAL04`` and was appended to (the file ends where its records do:
any record that does not verify is refused); ``EPSWAL02`` has no salt, and a record's MAC is the
HMAC-SHA256 of the id, the index and the record's bytes before it; ``EPSWAL01`` (1.x) records are
u32 n, n bytes of calls whose ``M`` holds its message after now, and the HMAC of the id, the index
and the calls.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from cryptography.hazmat.primitives.poly1305 import Poly1305

from broker.driver import Core
from ps_service.io.checkpoint import CheckpointError, History, load, read, sync_folder, write_ahead, write_at
from schemas.codecs import bits
from schemas.events import Events
from schemas.topics import Inbound, Publish

MAGIC = b"EPSWAL04"
#: The journals of earlier releases, still read: appended to; HMAC-SHA256 records of two parts, of one.
MAGIC_3 = b"EPSWAL03"
MAGIC_2 = b"EPSWAL02"
MAGIC_1 = b"EPSWAL01"
#: Journal bytes after which the server takes a new snapshot (bounds recovery's replay).
SNAPSHOT_BYTES = 64 << 20
#: Zeros a journal's file grows by when a record would pass its end (written, then written over).
EXTEND_BYTES = 4 << 20
#: Idle turns' calls kept unwritten at most (then written with a sync of their own).
IDLE_BYTES = 64 << 10
_MAC = 32  # an EPSWAL02 or EPSWAL01 record's HMAC-SHA256, and a journal's head's
_TAG = 16  # an EPSWAL04 (and 03) record's Poly1305 tag
_SALT = 16
_ID = struct.Struct("<Q")
_LEN = struct.Struct("<I")
_NOW = struct.Struct("<cd")
_MSG = struct.Struct("<BIH")  # flags, mid, the topic's length
_U16 = struct.Struct("<H")


def journal_path(checkpoint: Path) -> Path:
    """Where the journal of the snapshot at ``checkpoint`` lives."""
    return checkpoint.with_name(checkpoint.name + ".wal")


def _head_mac(key: bytes, head: bytes) -> bytes:
    return hmac.new(key, head, hashlib.sha256).digest()


def _record_key(key: bytes, journal: int, salt: bytes, index: int) -> bytes:
    """The Poly1305 key of record ``index`` of journal ``journal`` with ``salt`` (used once)."""
    return hmac.new(key, b"edgeps journal record" + _ID.pack(journal) + salt + _ID.pack(index), hashlib.sha256).digest()


def _record_tag(
    key: bytes, journal: int, salt: bytes, index: int, parts: Sequence[bytes | bytearray | memoryview]
) -> bytes:
    """The Poly1305 tag of record ``index`` of journal ``journal`` with ``salt``: of ``parts`` in turn
    (by OpenSSL with the GIL released where ``schemas._kernels`` has it)."""
    one_time = _record_key(key, journal, salt, index)
    if bits.kernels is not None and bits.kernels.has_poly1305():
        tag: bytes = bits.kernels.poly1305(one_time, parts)
        return tag
    poly = Poly1305(one_time)
    for part in parts:
        poly.update(part)
    return poly.finalize()


def _record_mac(key: bytes, journal: int, index: int, body: bytes | bytearray | memoryview) -> bytes:
    """An ``EPSWAL02`` or ``EPSWAL01`` record's HMAC."""
    return hmac.new(key, _ID.pack(journal) + _ID.pack(index) + body, hashlib.sha256).digest()


class Journal:
    """The server's journal beside its snapshot, one record a turn (``write``: the record is on disk
    when its future is done), started afresh by ``restart`` after each snapshot. Its own thread does
    what is on disk, in the order asked; ``size``: the bytes of the current journal's records."""

    def __init__(self, path: Path, key: bytes) -> None:
        """A journal at ``path``, started by the first ``restart``."""
        self.path, self.key = path, key
        self.id, self.index, self.size, self.salt = 0, 0, 0, b""
        self._fd: int | None = None
        self._offset = self._extent = 0  # (the journal's thread's) where the next record goes; the file's size
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="edgeps-journal")

    def restart(self, journal: int, snapshot: Callable[[], None] | None = None) -> Future[None]:
        """Start journal ``journal`` afresh, on the journal's thread after what was asked before it:
        ``snapshot`` first (it writes the snapshot that names ``journal``), then the new journal in
        the old one's file (stale once the snapshot is on disk): the file is moved aside, its head
        written over and synced, and moved back, so that a crash leaves the old journal, none, or the
        new one. Done once both are on disk."""
        self.id, self.index, self.size, self.salt = journal, 0, 0, os.urandom(_SALT)
        head = MAGIC + _ID.pack(journal) + self.salt
        return self._writer.submit(self._restart, head + _head_mac(self.key, head), snapshot)

    def _restart(self, head: bytes, snapshot: Callable[[], None] | None) -> None:
        if snapshot is not None:
            snapshot()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        aside = self.path.with_name(self.path.name + ".next")
        with contextlib.suppress(FileNotFoundError):  # the first journal here (or a crash left it aside)
            os.replace(self.path, aside)
        # O_DSYNC: each record's write returns once it is on disk (one system call, one hand-off of the GIL)
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_DSYNC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            write_at(fd, [head], 0)
            os.replace(aside, self.path)
            sync_folder(self.path)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._offset, self._extent = fd, len(head), os.fstat(fd).st_size

    def write(self, messages: Sequence[Inbound], calls: bytes | bytearray) -> Future[None]:
        """Append a turn's record: its ``messages`` and ``calls``, laid out and signed here, written
        and synced on the journal's thread; the record is on disk when the future is done."""
        assert self.salt, "restart the journal first"
        parts: list[bytes | bytearray] = [b""]
        for message in messages:
            encode_inbound(message, parts)
        size = sum(len(part) for part in parts)
        parts[0] = _LEN.pack(size)
        parts += _LEN.pack(len(calls)), calls
        parts.append(_record_tag(self.key, self.id, self.salt, self.index, parts))
        self.index += 1
        size += 2 * _LEN.size + len(calls) + _TAG  # the record's
        self.size += size
        return self._writer.submit(self._append, parts, size)

    def _append(self, record: list[bytes | bytearray], size: int) -> None:
        assert self._fd is not None
        self._extent = write_ahead(self._fd, record, self._offset, self._extent, EXTEND_BYTES)
        self._offset += size

    def close(self) -> None:
        """Write what was asked, and close."""
        self._writer.shutdown()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
    magic = data[: len(MAGIC)]
    head = len(MAGIC) + _ID.size + (_SALT if magic in (MAGIC, MAGIC_3) else 0)
    if len(data) < head + _MAC or magic not in (MAGIC, MAGIC_3, MAGIC_2, MAGIC_1):
        raise CheckpointError(f"{path} is not an edgeps journal")
    if not hmac.compare_digest(data[head : head + _MAC], _head_mac(key, data[:head])):
        raise CheckpointError(f"{path}: journal damaged or not signed with this server's key: refusing it")
    if _ID.unpack_from(data, len(MAGIC))[0] != journal:
        return []  # written before the snapshot now on disk: what it holds is in the snapshot
    salt = data[head - _SALT : head] if magic in (MAGIC, MAGIC_3) else None
    parts, mac_size = (1, _MAC) if magic == MAGIC_1 else (2, _MAC) if magic == MAGIC_2 else (2, _TAG)
    view = memoryview(data)

    def signed(pos: int, index: int) -> tuple[list[memoryview], int, bool] | None:
        """The record at ``pos``: its parts, where the next one begins, whether it verifies as record
        ``index``; None if the file ends before it does."""
        bodies, end = [], pos
        for _ in range(parts):
            if end + _LEN.size > len(data):
                return None
            (n,) = _LEN.unpack_from(data, end)
            bodies.append(view[end + _LEN.size : end + _LEN.size + n])
            end += _LEN.size + n
        if end + mac_size > len(data):
            return None
        if salt is not None:
            mac = _record_tag(key, journal, salt, index, [view[pos:end]])
        else:  # 2: the record's bytes before its MAC; 1: its calls alone
            mac = _record_mac(key, journal, index, view[pos:end] if parts == 2 else bodies[0])
        return bodies, end + mac_size, hmac.compare_digest(data[end : end + mac_size], mac)

    records = list[Record]()
    pos = head + _MAC
    while (record := signed(pos, len(records))) is not None:  # None: the record a crash cut short
        bodies, after, verified = record
        if not verified:
            index = len(records)
            if magic != MAGIC or ((following := signed(after, index + 1)) is not None and following[2]):
                raise CheckpointError(f"{path}: record {index} damaged or forged: refusing the journal")
            return records  # the end: what follows is an older journal's, or zeros (or cut short)
        records.append(Record(bytes(bodies[0]), bytes(bodies[1])) if parts == 2 else Record(None, bytes(bodies[0])))
        pos = after
    return records  # never synced, nothing in the record cut short acknowledged


def encode_inbound(message: Inbound, out: list[bytes | bytearray]) -> list[bytes | bytearray]:
    """``message`` as a record holds it, appended to ``out`` in parts (its payload one of them, not copied)."""
    flags = (message.qos & 3) | message.retain << 2 | message.duplicate << 3
    flags |= (message.response_topic is not None) << 4 | (message.correlation is not None) << 5
    topic = message.topic.encode()
    out += _MSG.pack(flags, message.mid, len(topic)) + topic + _LEN.pack(len(message.payload)), message.payload
    if message.response_topic is not None:
        response = message.response_topic.encode()
        out.append(_U16.pack(len(response)) + response)
    if message.correlation is not None:
        out.append(_LEN.pack(len(message.correlation)) + message.correlation)
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
        flags, mid, length = _MSG.unpack(self.take(_MSG.size))
        topic = self.take(length).decode()
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
        self.calls += _NOW.pack(b"M", now)  # the message itself is in the record's messages part (``Journal.write``)
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


def recover(core: Any, checkpoint: Path, now: float, key: bytes, history: History | None = None) -> tuple[int, int]:
    """Make ``core`` the server that wrote the snapshot at ``checkpoint`` and its journal: the
    snapshot loaded at the clock it was taken at, the journal's calls made again, then every time
    moved to ``now`` (as a snapshot taken after the last record would be). (The journal's id,
    the messages made again.) ``history``: the history file's writer, made to go on from where
    this snapshot's history ends."""
    state, metrics = read(core, checkpoint, key)
    if history is not None:
        history.resume(state.get("history"))  # a snapshot of the release before holds its history: a new file
    journal = state.get("journal") or {}  # a snapshot from before the journal has none
    number = int(journal.get("id", 0))
    records = read_journal(journal_path(checkpoint), key, number)
    if not records:
        load(core, state, metrics, now, checkpoint)
        return number, 0
    load(core, state, metrics, float(journal["clock"]), checkpoint)
    messages, last = replay(core, records)
    core.events.take()  # said when the calls were first made
    if last is not None:
        core.load_state(core.to_state(last), list(core.history), now)
    return number, messages
