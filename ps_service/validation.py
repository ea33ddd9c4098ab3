"""Validation of inbound commits: a commit becomes an Update or a Rejection, never both."""

from __future__ import annotations

import numpy as np

from ps_service.registry import DeviceRegistry
from ps_service.update import Update
from schemas.frame import FrameError, FrameKind, UnsupportedCodec, decode_frame
from schemas.messages import RejectReason


class Rejection(Exception):
    """A refused message: ``reason`` is counted, ``detail`` is for people."""

    def __init__(self, reason: RejectReason, detail: str, seq: int | None = None) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason, self.detail, self.seq = reason, detail, seq


def validate_commit(
    payload: bytes,
    topic_device: str,
    registry: DeviceRegistry,
    version: int,
    shapes: dict[str, tuple[int, ...]],
    max_bytes: int,
) -> Update:
    """Check a commit payload from ``grad/{topic_device}``; raise Rejection on the first fault.

    The sequence number is recorded as soon as the sender is authenticated by topic and
    body, so a commit refused for its content still consumes its number and cannot be replayed.
    """
    R = RejectReason
    if len(payload) > max_bytes:
        raise Rejection(R.OVERSIZED, f"{len(payload)} bytes exceed the limit of {max_bytes}")
    try:
        frame = decode_frame(payload, max_bytes=max_bytes)
    except UnsupportedCodec as exc:
        raise Rejection(R.UNSUPPORTED_CODEC, str(exc)) from None
    except FrameError as exc:
        raise Rejection(R.MALFORMED, str(exc)) from None
    seq = frame.seq
    if frame.kind != FrameKind.COMMIT:
        raise Rejection(R.WRONG_KIND, f"expected a commit frame, got {frame.kind.name.lower()}", seq)
    if frame.device != topic_device:
        raise Rejection(R.DEVICE_MISMATCH, f"body says {frame.device!r}, topic says {topic_device!r}", seq)
    if not registry.known(topic_device) or not registry.permits(topic_device):
        raise Rejection(R.UNKNOWN_DEVICE, f"device {topic_device!r} has not announced itself online", seq)
    if seq < 1:
        raise Rejection(R.MALFORMED, "sequence numbers start at 1", seq)
    seq_fault = registry.check_seq(topic_device, seq)
    if seq_fault is not None:
        raise Rejection(R(seq_fault), f"sequence number {seq} was already used or passed", seq)
    if frame.base_version > version:
        raise Rejection(R.FUTURE_VERSION, f"base version {frame.base_version} > current {version}", seq)
    if frame.steps < 1 or frame.samples < 1:
        raise Rejection(R.MALFORMED, "a commit needs steps >= 1 and samples >= 1", seq)
    got = {name: values.shape for name, values in frame.tensors.items()}
    if got != shapes:
        raise Rejection(R.SHAPE_MISMATCH, f"tensors {got} do not match the model's {shapes}", seq)
    for name, values in frame.tensors.items():
        if not np.isfinite(values).all():
            raise Rejection(R.NON_FINITE, f"tensor {name!r} holds NaN or Inf", seq)
    return Update(
        device=topic_device,
        seq=seq,
        base_version=frame.base_version,
        samples=frame.samples,
        steps=frame.steps,
        delta=frame.tensors,
    )
