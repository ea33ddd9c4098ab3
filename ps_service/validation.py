"""Validation of inbound commits: a commit becomes an Update or a Rejection, never both."""

from __future__ import annotations

import math

import numpy as np

from ps_service.flat import Layout, layout_for, sum_squares
from ps_service.registry import DeviceRegistry
from ps_service.update import Update
from schemas.frame import FrameError, FrameKind, UnsupportedCodec, parse_frame, peek_seq
from schemas.messages import MAX_SAFE_INT, RejectReason


class Rejection(Exception):
    """A refused message: ``reason`` is counted, ``detail`` is for people, ``seq`` names the refused
    commit whenever its header could be read."""

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
    codecs: frozenset[str],
    peeked: int | None = None,
    layout: Layout | None = None,
) -> Update:
    """Check a commit payload from ``grad/{topic_device}``; raise Rejection on the first fault.

    The checks run in a fixed order (docs/PROTOCOL.md lists it); the sequence number is recorded
    as soon as the sender is established by topic and body, so a commit refused from then on
    (for its version, codec, shapes or values) still consumes its number and cannot be replayed.
    Tensor names and shapes are compared with the model's before any payload is decoded: nothing
    is allocated for more values than the model has. ``codecs``: the codec specs the job accepts;
    ``peeked``: the sequence number ``peek_seq`` read where the caller did so already; ``layout``:
    ``shapes``' (ps_service.flat), where the caller keeps one.
    """
    R = RejectReason
    layout = layout_for(shapes) if layout is None else layout
    if peeked is None:
        peeked = peek_seq(payload)
    if len(payload) > max_bytes:
        raise Rejection(R.OVERSIZED, f"{len(payload)} bytes exceed the limit of {max_bytes}", peeked)
    try:
        raw = parse_frame(payload, max_bytes=max_bytes, max_elements=layout.size)
    except UnsupportedCodec as exc:
        raise Rejection(R.UNSUPPORTED_CODEC, str(exc), peeked) from None
    except FrameError as exc:
        raise Rejection(R.MALFORMED, str(exc), peeked) from None
    seq = raw.seq
    if raw.kind != FrameKind.COMMIT:
        raise Rejection(R.WRONG_KIND, f"expected a commit frame, got {raw.kind.name.lower()}", seq)
    if raw.device != topic_device:
        raise Rejection(R.DEVICE_MISMATCH, f"body says {raw.device!r}, topic says {topic_device!r}", seq)
    if not registry.known(topic_device) or not registry.permits(topic_device):
        raise Rejection(R.UNKNOWN_DEVICE, f"device {topic_device!r} has not announced itself online", seq)
    if seq < 1 or seq > MAX_SAFE_INT:  # what a site commit, and any JSON reader, carries exactly
        raise Rejection(R.MALFORMED, "sequence numbers run from 1 to 2^53 - 1", seq)
    seq_fault = registry.check_seq(topic_device, seq)
    if seq_fault is not None:
        raise Rejection(R(seq_fault), f"sequence number {seq} was already used or passed", seq)
    # From here on the sequence number is consumed.
    if raw.base_version > version:
        raise Rejection(R.FUTURE_VERSION, f"base version {raw.base_version} > current {version}", seq)
    if raw.steps < 1 or raw.samples < 1:
        raise Rejection(R.MALFORMED, "a commit needs steps >= 1 and samples >= 1", seq)
    if raw.codec.spec not in codecs:
        raise Rejection(R.WRONG_CODEC, f"codec {raw.codec.spec} is not the job's ({', '.join(sorted(codecs))})", seq)
    if not raw.matches(shapes):
        declared = f"{raw.tensors} tensors" if raw.compact is not None else f"tensors {raw.shapes}"
        raise Rejection(R.SHAPE_MISMATCH, f"{declared} do not match the model's {shapes}", seq)
    try:  # a compact commit's values as one vector, the tensors views of it; else each tensor's, copied into one
        flat = raw.values(layout.size) if raw.compact is not None else layout.flatten(raw.decode(shapes).tensors)
    except FrameError as exc:
        raise Rejection(R.MALFORMED, str(exc), seq) from None
    squares = sum_squares(flat)  # finite exactly when every value is: a float32's square cannot overflow a double
    if not math.isfinite(squares):
        name = layout.name_of(int(np.argmin(np.isfinite(flat))))
        raise Rejection(R.NON_FINITE, f"tensor {name!r} holds NaN or Inf", seq)
    return Update(topic_device, seq, raw.base_version, raw.samples, raw.steps, None, flat, squares, layout)
