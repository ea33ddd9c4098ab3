"""Server checkpoints: the server core's explicit state, written atomically and signed.

The MQTT driver writes one after processing each batch of inbound messages and before
publishing the results and acknowledging the messages to the broker. So a commit the
broker saw acknowledged is in the checkpoint, and one that is not was never acknowledged:
the broker redelivers it to the restarted server (persistent session), which applies it
once, or refuses it as replayed if the checkpoint already holds it.

File layout (nothing in it is code: no pickle):

| bytes | content |
|---|---|
| 8 | magic ``EPSCKPT3`` |
| 32 | HMAC-SHA256, keyed with the server's checkpoint key, of everything after it |
| 4 + n | u32 little-endian n, then the state: UTF-8 JSON (``ServerCore.to_state``); tensors and |
|  | payloads in it are references into the archive below |
| rest | a NumPy ``.npz`` archive of the tensors and payloads (read with ``allow_pickle=False``) |

The state JSON has ``format`` (``edgeps-checkpoint/3``), the configuration the server ran with
(refused if the server now runs another), the core's fields by name (times are ages in
seconds), and ``history``: how much of the metrics history file beside it (``PATH.history``,
``History``) is this snapshot's. The history grows with the job (a record a version) and is
written once: each snapshot appends the records new since the one before, so that a snapshot
costs the state and not the job's past. ``EPSCKPT2`` (the release before) held the history in
the file, between the state and the archive (u32 m, then a JSON array of Metrics records), and
is still read. The key (32 random bytes) lives in a file of its own (by default ``PATH.key`` beside
the checkpoint, created mode 600 on first use): a file that does not verify under it is refused
before anything in it is parsed. The checkpoint is mode 600 too.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import secrets
import struct
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from schemas.messages import MessageError, Metrics

MAGIC = b"EPSCKPT3"
FORMAT = "edgeps-checkpoint/3"
#: The checkpoints of the release before, still read: the metrics history inside.
MAGIC_2, FORMAT_2 = b"EPSCKPT2", "edgeps-checkpoint/2"
HISTORY_MAGIC = b"EPSHIST1"
_HISTORY_START = hashlib.sha256(HISTORY_MAGIC).digest()  # the history's hash chain starts here
#: Zeros a history file grows by when a snapshot's part would pass its end (written, then written over).
HISTORY_EXTEND = 1 << 20
#: The parts one ``pwritev`` takes at most (Linux's IOV_MAX is 1024).
_IOV = 512
KEY_BYTES = 32
_U32 = struct.Struct("<I")


class CheckpointError(RuntimeError):
    """A checkpoint that is damaged, not signed by this server's key, or of another configuration."""


def load_key(path: Path, create: bool = True) -> bytes:
    """The checkpoint key in ``path``; with ``create``, a new random one written mode 600 if none exists."""
    if not path.exists():
        if not create:
            raise CheckpointError(f"no checkpoint key at {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(secrets.token_bytes(KEY_BYTES).hex().encode() + b"\n")
    return parse_key(path.read_text(), str(path))


def parse_key(text: str, where: str) -> bytes:
    """A checkpoint key written in hex (at least 16 bytes); CheckpointError naming ``where`` otherwise."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise CheckpointError(f"{where} does not hold a checkpoint key (hex)") from None
    if len(key) < 16:
        raise CheckpointError(f"the checkpoint key in {where} is shorter than 16 bytes")
    return key


def _splitter(arrays: dict[str, np.ndarray]) -> Callable[[Any], Any]:
    """``json.dumps``'s ``default``: an array or bytes value becomes a reference into ``arrays``
    (the rest of the tree is written by json's own encoder, in one pass)."""

    def split(value: Any) -> Any:
        key = f"t{len(arrays)}"
        if isinstance(value, np.ndarray):
            arrays[key] = value
            return {"$tensor": key}
        if isinstance(value, bytes):
            arrays[key] = np.frombuffer(value, np.uint8)
            return {"$bytes": key}
        raise TypeError(f"a checkpoint holds no {type(value).__name__}")

    return split


def _join(tree: Any, arrays: Any) -> Any:
    if isinstance(tree, dict):
        if set(tree) == {"$tensor"}:
            return np.array(arrays[tree["$tensor"]])
        if set(tree) == {"$bytes"}:
            return np.array(arrays[tree["$bytes"]], np.uint8).tobytes()
        return {k: _join(v, arrays) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_join(v, arrays) for v in tree]
    return tree


def encode(core: Any, now: float, key: bytes, journal: int, history: dict[str, Any]) -> bytes:
    """``core``'s state at ``now``; ``journal``: the id of the journal that follows this snapshot
    (ps_service.io.journal), written with the clock it was taken at; ``history``: the reference
    to the metrics history file that ``History.take`` gave."""
    arrays: dict[str, np.ndarray] = {}
    config = json.loads(core.config.model_dump_json())
    state = {
        "format": FORMAT,
        "config": config,
        "journal": {"id": journal, "clock": now},
        "history": history,
        "core": core.to_state(now),
    }
    text = json.dumps(state, separators=(",", ":"), default=_splitter(arrays)).encode()
    archive = io.BytesIO()
    np.savez(archive, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as bool
    body = _U32.pack(len(text)) + text + archive.getvalue()
    return MAGIC + hmac.new(key, body, hashlib.sha256).digest() + body


def decode(blob: bytes, key: bytes) -> tuple[dict[str, Any], list[Metrics] | None]:
    """(state, metrics history) of a checkpoint; CheckpointError unless it verifies under ``key``.
    The history is None where it is in the file beside the snapshot (``read_history``)."""
    magic = blob[: len(MAGIC)]
    if magic not in (MAGIC, MAGIC_2):
        raise CheckpointError("not an edgeps checkpoint of this version (bad magic)")
    mac, body = blob[len(MAGIC) : len(MAGIC) + 32], blob[len(MAGIC) + 32 :]
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
        raise CheckpointError("checkpoint damaged or not signed with this server's key: refusing it")
    history: list[Metrics] | None = None
    try:
        (n,) = _U32.unpack_from(body)
        text, archive = body[4 : 4 + n], 4 + n
        if magic == MAGIC_2:
            (m,) = _U32.unpack_from(body, archive)
            history = [Metrics.model_validate(record) for record in json.loads(body[archive + 4 : archive + 4 + m])]
            archive += 4 + m
        with np.load(io.BytesIO(body[archive:]), allow_pickle=False) as arrays:
            state = _join(json.loads(text), arrays)
    except (
        struct.error,
        ValueError,
        KeyError,
        TypeError,
        OSError,
        EOFError,
        NotImplementedError,
        zipfile.BadZipFile,
        MessageError,
    ) as exc:  # NotImplementedError: zipfile reading a damaged "version needed" field
        raise CheckpointError(f"checkpoint unreadable: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != (FORMAT if magic == MAGIC else FORMAT_2):
        raise CheckpointError(f"checkpoint format {state.get('format') if isinstance(state, dict) else '?'}")
    if history is None and not isinstance(state.get("history"), dict):
        raise CheckpointError("checkpoint names no metrics history")
    return state, history


def history_path(checkpoint: Path) -> Path:
    """Where the metrics history of the snapshot at ``checkpoint`` lives."""
    return checkpoint.with_name(checkpoint.name + ".history")


class History:
    """The metrics history beside a snapshot (``PATH.history``), only appended: ``HISTORY_MAGIC``,
    then a chunk per snapshot of the records new since the one before (u32 n, then n bytes: each
    record u32 m and m bytes of Metrics JSON). A snapshot names how far the file is its:
    ``{"records", "bytes", "sha256"}``, the last link of the chain sha256(link before + chunk)
    that starts at sha256(magic), so that the history is signed with the snapshot and a snapshot
    goes on from its own reference (after a crash, what a snapshot that did not land appended
    is written over)."""

    def __init__(self, path: Path, reference: dict[str, Any] | None = None) -> None:
        """The history at ``path``, as a snapshot's ``reference`` names it (None: none yet)."""
        self.path = path
        self.resume(reference)

    def resume(self, reference: dict[str, Any] | None) -> None:
        """Go on from the end of the history a snapshot's ``reference`` names (None: a new file)."""
        reference = reference or {"records": 0, "bytes": 0, "sha256": _HISTORY_START.hex()}
        self.records, self.size = int(reference["records"]), int(reference["bytes"])
        self.link = bytes.fromhex(reference["sha256"])

    def take(self, records: Sequence[bytes]) -> tuple[HistoryPart, dict[str, Any]]:
        """For a snapshot of a history of ``records`` (serialised Metrics, those named before
        first): the part to append before the snapshot is written, and the reference it names."""
        if len(records) < self.records:  # not the history this file holds the start of: a new file
            self.resume(None)
        body = b"".join(_U32.pack(len(record)) + record for record in records[self.records :])
        chunk = _U32.pack(len(body)) + body if body else b""
        start, head = self.size, b"" if self.size else HISTORY_MAGIC
        self.link = hashlib.sha256(self.link + chunk).digest() if chunk else self.link
        self.records, self.size = len(records), self.size + len(head) + len(chunk)
        reference = {"records": self.records, "bytes": self.size, "sha256": self.link.hex()}
        return HistoryPart(self.path, start, head + chunk), reference


class HistoryPart(NamedTuple):
    """Bytes of a history file to write at ``start`` (``History.take``)."""

    path: Path
    start: int
    data: bytes

    def write(self) -> None:
        """Write them, on disk when this returns (``O_DSYNC``), over zeros written ahead (``write_ahead``)."""
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_DSYNC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            size = os.fstat(fd).st_size
            write_ahead(fd, [self.data], self.start, size, HISTORY_EXTEND)
        finally:
            os.close(fd)
        if size == 0:
            sync_folder(self.path)


def read_history(path: Path, reference: Any) -> list[Metrics]:
    """The metrics history a snapshot names (``History``); CheckpointError unless the file's first
    ``bytes`` make the chain the reference ends with (nothing is parsed before)."""
    try:
        records, size, link = int(reference["records"]), int(reference["bytes"]), bytes.fromhex(reference["sha256"])
        with open(path, "rb") as file:
            data = file.read(size)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: the snapshot's metrics history is missing") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint names its metrics history wrongly: {exc!r}") from None
    if len(data) < size or data[: len(HISTORY_MAGIC)] != HISTORY_MAGIC:
        raise CheckpointError(f"{path}: not the metrics history of this checkpoint (short or bad magic)")
    chain, chunks, pos = _HISTORY_START, [], len(HISTORY_MAGIC)
    while pos + 4 <= size:
        end = pos + 4 + _U32.unpack_from(data, pos)[0]
        chain = hashlib.sha256(chain + data[pos:end]).digest()
        chunks.append((pos + 4, end))
        pos = end
    if pos != size or not hmac.compare_digest(chain, link):
        raise CheckpointError(f"{path}: metrics history damaged or not this checkpoint's: refusing it")
    history = []
    try:
        for start, end in chunks:
            while start < end:
                (m,) = _U32.unpack_from(data, start)
                history.append(Metrics.model_validate_json(data[start + 4 : start + 4 + m]))
                start += 4 + m
    except (struct.error, ValueError, MessageError) as exc:
        raise CheckpointError(f"{path}: metrics history unreadable: {exc}") from None
    if len(history) != records:
        raise CheckpointError(f"{path}: {len(history)} metrics records where the checkpoint names {records}")
    return history


class Snapshot(NamedTuple):
    """A snapshot ready to be written: the file, and the history's part it names (written first)."""

    path: Path
    blob: bytes
    history: HistoryPart

    def write(self) -> None:
        self.history.write()
        write_atomic(self.path, self.blob)


def snapshot(core: Any, path: Path, now: float, key: bytes, journal: int, history: History) -> Snapshot:
    """``core``'s snapshot at ``now`` for ``path``, naming journal ``journal`` and the records of
    its history that ``history`` (this checkpoint's) has not written yet."""
    part, reference = history.take(core.history_json)
    return Snapshot(path, encode(core, now, key, journal, reference), part)


def write_atomic(path: Path, blob: bytes) -> None:
    """Replace ``path`` with ``blob`` (mode 600) so that a crash leaves either the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        os.fchmod(file.fileno(), 0o600)  # a partial file left by an older version may have other bits
        file.write(blob)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
    sync_folder(path)


def write_at(fd: int, parts: Sequence[bytes | bytearray | memoryview], offset: int) -> None:
    """Write ``parts`` whole at ``offset`` (a short write of a few MB is possible: what is left is written)."""
    left: list[bytes | bytearray | memoryview] = list(parts)
    while left:
        written = os.pwritev(fd, left[:_IOV], offset)
        offset += written
        while left and written >= len(left[0]):
            written -= len(left.pop(0))
        if left and written:
            left[0] = memoryview(left[0])[written:]


def write_zeros(fd: int, start: int, end: int) -> None:
    """Write zeros from ``start`` to ``end`` (in one system call)."""
    zeros = memoryview(bytes(1 << 20))
    write_at(fd, [zeros] * ((end - start) >> 20) + [zeros[: (end - start) & 0xFFFFF]], start)


def write_ahead(fd: int, parts: Sequence[bytes | bytearray | memoryview], offset: int, size: int, extend: int) -> int:
    """Write ``parts`` at ``offset`` in a file of ``size`` bytes opened ``O_DSYNC``; where they would
    pass its end, zeros first, ``extend`` bytes beyond them (synced with the file's new size), so that
    the parts' own sync writes data and no file metadata. The file's size after."""
    end = offset + sum(len(part) for part in parts)
    if end > size:
        write_zeros(fd, size, end + extend)
        size = end + extend
    write_at(fd, parts, offset)
    return size


def sync_folder(path: Path) -> None:
    """Make a rename to ``path`` durable: fsync the folder that holds it."""
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def save(core: Any, path: Path, now: float, key: bytes, journal: int = 0) -> int:
    """Write ``core``'s snapshot at ``path`` (and its whole history beside it): the bytes of both
    (the history's records, not the zeros written ahead of them)."""
    history = History(history_path(path))
    written = snapshot(core, path, now, key, journal, history)
    written.write()
    return len(written.blob) + history.size


def read(core: Any, path: Path, key: bytes) -> tuple[dict[str, Any], list[Metrics]]:
    """The snapshot at ``path`` (``decode``) and its history, refused unless ``core``'s configuration wrote it."""
    state, history = decode(path.read_bytes(), key)
    if state["config"] != json.loads(core.config.model_dump_json()):
        raise CheckpointError(f"{path} was written by a server with another configuration; refusing to resume")
    if history is None:
        history = read_history(history_path(path), state["history"])
    return state, history


def load(core: Any, state: dict[str, Any], history: list[Metrics], now: float, where: Path) -> None:
    """Make ``core`` the server of ``read``'s ``state``; its times move to ``now``."""
    try:
        core.load_state(state["core"], history, now)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CheckpointError(f"{where}: state unreadable: {exc!r}") from None


def restore(core: Any, path: Path, now: float, key: bytes) -> None:
    """Load ``path`` into ``core`` (built with the same configuration); times move to ``now``."""
    state, history = read(core, path, key)
    load(core, state, history, now, path)
