"""The site commit: what a site's aggregator sends upstream instead of its devices' commits.

``u32 length | SiteCommit JSON | frame``: the JSON header (schemas.messages.SiteCommit) names the
commits summed and the scalar sums; the frame (kind PARTIAL, fp32, its device field the site, its
seq the header's) carries the weighted sums by tensor name. docs/PROTOCOL.md §2 gives every byte.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from schemas.frame import Frame, FrameError, FrameKind, RawFrame, encode_frame, parse_frame
from schemas.messages import MAX_JSON_BYTES, SiteCommit

_LENGTH = struct.Struct("<I")


def encode_site_commit(header: SiteCommit, weighted: dict[str, np.ndarray]) -> bytes:
    """Serialise a site commit: ``header`` and the weighted sums ``weighted`` (fp32)."""
    body = header.to_bytes()
    frame = Frame(FrameKind.PARTIAL, header.version, weighted, device=header.site, seq=header.seq, codec="fp32")
    return _LENGTH.pack(len(body)) + body + encode_frame(frame)


def parse_site_commit(
    payload: bytes, shapes: dict[str, tuple[int, ...]], max_bytes: int
) -> tuple[SiteCommit, dict[str, np.ndarray]]:
    """Check and decode a site commit against the model's ``shapes``; raise FrameError (the bytes)
    or MessageError (the header) with the first problem found. The tensors are finite-checked by the
    receiver, as a commit's are."""
    if len(payload) > max_bytes:
        raise FrameError(f"site commit of {len(payload)} bytes exceeds the limit of {max_bytes}")
    if len(payload) < _LENGTH.size:
        raise FrameError("site commit shorter than its length field")
    (length,) = _LENGTH.unpack_from(payload)
    if length > MAX_JSON_BYTES or _LENGTH.size + length > len(payload):
        raise FrameError(f"site commit header of {length} bytes does not fit")
    header = SiteCommit.from_bytes(payload[_LENGTH.size : _LENGTH.size + length])
    raw: RawFrame = parse_frame(
        payload[_LENGTH.size + length :], max_bytes, max_elements=sum(math.prod(s) for s in shapes.values())
    )
    if raw.kind != FrameKind.PARTIAL or raw.codec.spec != "fp32":
        raise FrameError(f"a site commit's frame is an fp32 partial, not {raw.kind.name.lower()} {raw.codec.spec}")
    if (raw.device, raw.seq, raw.base_version) != (header.site, header.seq, header.version):
        raise FrameError("the frame's site, seq or version differs from the header's")
    if raw.shapes != shapes:
        raise FrameError(f"tensors {raw.shapes} do not match the model's {shapes}")
    return header, raw.decode().tensors
