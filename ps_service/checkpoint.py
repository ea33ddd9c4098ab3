"""Server checkpoints: everything the server core knows, written atomically.

The MQTT driver writes one after processing each batch of inbound messages and before
publishing the results and acknowledging the messages to the broker. So a commit the
broker saw acknowledged is in the checkpoint, and one that is not was never acknowledged:
the broker redelivers it to the restarted server (persistent session), which applies it
once, or refuses it as replayed if the checkpoint already holds it.

File layout: ``EPSCKPT1`` magic, the SHA-256 of the body, the body (a pickle of the core's
state, the configuration it ran with, and the driver's clock when it was written). Only a
file this server wrote is ever loaded (pickle runs code); keep the checkpoint directory as
private as the server's credentials.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

MAGIC = b"EPSCKPT1"
#: Not saved: given again when the server starts (the evaluator holds the held-out data).
TRANSIENT = frozenset({"config", "evaluator", "artifact"})


class CheckpointError(RuntimeError):
    """A checkpoint that is damaged or belongs to another job configuration."""


def encode(core: Any, now: float) -> bytes:
    state = {key: value for key, value in vars(core).items() if key not in TRANSIENT}
    body = pickle.dumps(
        {"config": core.config.model_dump_json(), "saved_at": now, "state": state}, protocol=pickle.HIGHEST_PROTOCOL
    )
    return MAGIC + hashlib.sha256(body).digest() + body


def decode(blob: bytes) -> dict[str, Any]:
    if blob[: len(MAGIC)] != MAGIC:
        raise CheckpointError("not an edgeps checkpoint (bad magic)")
    digest, body = blob[len(MAGIC) : len(MAGIC) + 32], blob[len(MAGIC) + 32 :]
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError("checkpoint damaged: its SHA-256 does not match")
    return pickle.loads(body)  # our own file, integrity-checked above


def write_atomic(path: Path, blob: bytes) -> None:
    """Replace ``path`` with ``blob`` so that a crash leaves either the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as file:
        file.write(blob)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def save(core: Any, path: Path, now: float) -> None:
    write_atomic(path, encode(core, now))


def restore(core: Any, path: Path, now: float) -> None:
    """Load ``path`` into ``core`` (built with the same configuration); times move to ``now``."""
    saved = decode(path.read_bytes())
    if saved["config"] != core.config.model_dump_json():
        raise CheckpointError(f"{path} was written by a server with another configuration; refusing to resume")
    vars(core).update(saved["state"])
    core.shift_clock(now - saved["saved_at"])
