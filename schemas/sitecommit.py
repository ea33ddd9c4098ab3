"""The site commit: what a site's aggregator sends upstream instead of its devices' commits.

``u32 length | SiteCommit JSON | frame``: the JSON header (schemas.messages.SiteCommit) names the
commits summed and the scalar sums; the frame (kind PARTIAL, fp32, its device field the site, its
seq the header's) carries the weighted sums by tensor name. docs/PROTOCOL.md §2 gives every byte.
"""

from __future__ import annotations

import math
import struct

import numpy as np
from pydantic import Field, field_validator, model_validator

from schemas.frame import Frame, FrameError, FrameKind, RawFrame, encode_frame, parse_frame
from schemas.messages import MAX_JSON_BYTES, MAX_SAFE_INT, MAX_U32, DeviceId, Message, Name, RejectReason

_LENGTH = struct.Struct("<I")


#: The most commits one site commit carries (its JSON header stays under ``MAX_JSON_BYTES``).
MAX_SITE_COMMITS = 256


class SiteEntry(Message):
    """A device's commits a site commit covers (those since the site's last site commit, summed):
    ``seq`` the newest one's, ``base_version`` the oldest one's, ``samples`` and ``steps`` summed
    (at most 2^32 - 1 each); ``weight`` the data size n_i the aggregator weighted its update by and
    ``norm`` the length of that update per local step, |d_i|, after clipping (protocol 1.6)."""

    device: DeviceId
    seq: int = Field(ge=1, le=MAX_SAFE_INT)
    base_version: int = Field(ge=0, le=MAX_SAFE_INT)
    samples: int = Field(ge=1, le=MAX_U32)
    steps: int = Field(ge=1, le=MAX_U32)
    weight: float = Field(gt=0, le=MAX_U32, description="n_i: the data size its update is weighted by")
    norm: float = Field(ge=0, description="|d_i|: its update's length per local step, after clipping")


class SiteCommit(Message):
    """The JSON header of a site commit (``part/{site}``, schemas/sitecommit.py): the commits its
    aggregator summed, made at ``version``, and the two sums that travel beside the tensors.
    ``data`` is the sum of the devices' data sizes n_i, ``spread`` the sum of n_i |d_i|^2 (d_i a
    device's staleness-weighted update per local step; ps_service/aggregate.py ``Partial``)."""

    site: Name
    seq: int = Field(ge=1, le=MAX_SAFE_INT, description="the site's own count of its site commits")
    version: int = Field(ge=0, le=MAX_SAFE_INT, description="the version the staleness weights were taken at")
    data: float = Field(gt=0, description="sum of the devices' data sizes")
    spread: float = Field(ge=0, description="sum of n_i |d_i|^2")
    commits: list[SiteEntry] = Field(min_length=1, max_length=MAX_SITE_COMMITS)
    refused: dict[str, int] = Field(
        default_factory=dict, description="the commits the aggregator refused so far, by reason (protocol 1.6)"
    )

    @field_validator("refused")
    @classmethod
    def _reasons(cls, refused: dict[str, int]) -> dict[str, int]:
        known = {r.value for r in RejectReason}
        if not set(refused) <= known or not all(0 <= n <= MAX_SAFE_INT for n in refused.values()):
            raise ValueError("refused: counts (0 .. 2^53 - 1) of the protocol's reasons")
        return refused

    @model_validator(mode="after")
    def _one_commit_a_device(self) -> SiteCommit:
        devices = [c.device for c in self.commits]
        if len(set(devices)) != len(devices):
            raise ValueError("a device appears twice: its commits are summed into one entry")
        return self


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
