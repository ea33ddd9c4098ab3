"""Server checkpoints: the server core's explicit state, written atomically and signed.

The MQTT driver writes one after processing each batch of inbound messages and before
publishing the results and acknowledging the messages to the broker. So a commit the
broker saw acknowledged is in the checkpoint, and one that is not was never acknowledged:
the broker redelivers it to the restarted server (persistent session), which applies it
once, or refuses it as replayed if the checkpoint already holds it.

File layout (nothing in it is code: no pickle):

| bytes | content |
|---|---|
| 8 | magic ``EPSCKPT2`` |
| 32 | HMAC-SHA256, keyed with the server's checkpoint key, of everything after it |
| 4 + n | u32 little-endian n, then the state: UTF-8 JSON (``ServerCore.to_state``); tensors and |
|  | payloads in it are references into the archive below |
| 4 + m | u32 m, then the metrics history: a JSON array of Metrics records |
| rest | a NumPy ``.npz`` archive of the tensors and payloads (read with ``allow_pickle=False``) |

The state JSON has ``format`` (``edgeps-checkpoint/2``), the configuration the server ran with
(refused if the server now runs another), and the core's fields by name; times are ages in
seconds. The key (32 random bytes) lives in a file of its own (by default ``PATH.key`` beside
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from schemas.messages import MessageError, Metrics

MAGIC = b"EPSCKPT2"
FORMAT = "edgeps-checkpoint/2"
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


def encode(core: Any, now: float, key: bytes, journal: int = 0) -> bytes:
    """``core``'s state at ``now``; ``journal``: the id of the journal that follows this snapshot
    (ps_service.io.journal), written with the clock it was taken at."""
    arrays: dict[str, np.ndarray] = {}
    config = json.loads(core.config.model_dump_json())
    state = {"format": FORMAT, "config": config, "journal": {"id": journal, "clock": now}, "core": core.to_state(now)}
    text = json.dumps(state, separators=(",", ":"), default=_splitter(arrays)).encode()
    history = b"[" + b",".join(core.history_json) + b"]"
    archive = io.BytesIO()
    np.savez(archive, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as bool
    body = _U32.pack(len(text)) + text + _U32.pack(len(history)) + history + archive.getvalue()
    return MAGIC + hmac.new(key, body, hashlib.sha256).digest() + body


def decode(blob: bytes, key: bytes) -> tuple[dict[str, Any], list[Metrics]]:
    """(state, metrics history) of a checkpoint; CheckpointError unless it verifies under ``key``."""
    if blob[: len(MAGIC)] != MAGIC:
        raise CheckpointError("not an edgeps checkpoint of this version (bad magic)")
    mac, body = blob[len(MAGIC) : len(MAGIC) + 32], blob[len(MAGIC) + 32 :]
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
        raise CheckpointError("checkpoint damaged or not signed with this server's key: refusing it")
    try:
        (n,) = _U32.unpack_from(body)
        text = body[4 : 4 + n]
        (m,) = _U32.unpack_from(body, 4 + n)
        history_text = body[8 + n : 8 + n + m]
        with np.load(io.BytesIO(body[8 + n + m :]), allow_pickle=False) as arrays:
            state = _join(json.loads(text), arrays)
        history = [Metrics.model_validate(record) for record in json.loads(history_text)]
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
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint format {state.get('format') if isinstance(state, dict) else '?'}")
    return state, history


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


def sync_folder(path: Path) -> None:
    """Make a rename to ``path`` durable: fsync the folder that holds it."""
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def save(core: Any, path: Path, now: float, key: bytes, journal: int = 0) -> None:
    write_atomic(path, encode(core, now, key, journal))


def read(core: Any, path: Path, key: bytes) -> tuple[dict[str, Any], list[Metrics]]:
    """The snapshot at ``path`` (``decode``), refused unless ``core``'s configuration wrote it."""
    state, history = decode(path.read_bytes(), key)
    if state["config"] != json.loads(core.config.model_dump_json()):
        raise CheckpointError(f"{path} was written by a server with another configuration; refusing to resume")
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
