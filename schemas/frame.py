"""The binary tensor frame: commits (device -> PS) and parameter snapshots (PS -> devices).

Little-endian, versioned, CRC-protected. docs/PROTOCOL.md gives every byte. The decoder
never trusts a length: every read is bounds-checked and any inconsistency raises
FrameError, so arbitrary bytes cannot crash the server.
"""

from __future__ import annotations

import math
import re
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import numpy as np

from schemas.codecs import Codec, CodecError, UnknownCodecId, codec_from_header, make_codec
from schemas.codecs.bits import kernels, leb128

MAGIC = b"EPSF"
FORMAT_VERSION = 1
MAX_TENSORS = 256
MAX_NDIM = 8
MAX_FRAME_ELEMENTS = 1 << 28  # values all tensors of a frame declare together
COMPACT = 0x01  # flags: a compact commit (one payload for the model's values, in the model's order)
_NAME = re.compile(r"^[A-Za-z0-9_.:/-]{1,64}$")

# magic, format version, kind, codec id, flags, codec arg, base version, seq, samples, steps
_HEADER = struct.Struct("<4sBBBBfQQII")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_CRC = struct.Struct("<I")
#: zlib's CRC-32, by carry-less multiplication where schemas._kernels has it (a 19 KB commit: 4.7 -> 1.5 us).
crc32 = kernels.crc32 if kernels is not None and kernels.fast_crc32 else zlib.crc32


class FrameKind(IntEnum):
    COMMIT = 1
    PARAMS = 2  # a full snapshot of version ``base_version``
    DELTA = 3  # version ``base_version`` = version ``seq`` + these tensors
    PARTIAL = 4  # a site's commits summed (schemas/sitecommit.py): the weighted sums, fp32


_KINDS = {int(kind): kind for kind in FrameKind}


class FrameError(ValueError):
    """Bytes that are not a valid frame."""


class UnsupportedCodec(FrameError):
    """A well-formed header naming a codec id this side does not implement."""


@dataclass(frozen=True)
class Frame:
    """One decoded frame. ``tensors`` keeps the order in which they were sent."""

    kind: FrameKind
    base_version: int
    tensors: dict[str, np.ndarray]
    device: str = ""
    seq: int = 0
    samples: int = 0
    steps: int = 0
    codec: str = "fp32"  # a codec spec: fp32, fp16, int8, sign, ternary, qsgd:S, topk:P
    flat: np.ndarray | None = None  # a decoded compact commit's values in one vector: ``tensors`` are views of it


def encode_frame(
    frame: Frame, rng: np.random.Generator | None = None, payloads: Mapping[str, bytes] | None = None
) -> bytes:
    """Serialise ``frame``; raise FrameError for values the format cannot carry. ``payloads``: the
    tensors already encoded under ``frame.codec`` (by ``ErrorFeedback.encode``), by name."""
    codec, parts = _head(frame, 0)
    for name, values in frame.tensors.items():
        if not _NAME.match(name):
            raise FrameError(f"invalid tensor name {name!r}")
        shape = np.shape(values)
        if len(shape) > MAX_NDIM:
            raise FrameError(f"tensor {name!r} has more than {MAX_NDIM} dimensions")
        payload = payloads[name] if payloads is not None else codec.encode(np.asarray(values), rng)
        parts += [
            _U8.pack(len(name)),
            name.encode("ascii"),
            _U8.pack(len(shape)),
            struct.pack(f"<{len(shape)}I", *shape),
            _U32.pack(len(payload)),
            payload,
        ]
    body = b"".join(parts)
    return body + _CRC.pack(crc32(body))


def _head(frame: Frame, flags: int) -> tuple[Codec, list[bytes]]:
    """``frame``'s codec, and its bytes up to its tensors: the header, the device id, the tensor
    count; FrameError for what the format cannot carry."""
    try:
        codec = make_codec(frame.codec)
    except CodecError as exc:
        raise FrameError(str(exc)) from exc
    device = frame.device.encode("ascii")
    if len(device) > 64:
        raise FrameError("device id longer than 64 bytes")
    if len(frame.tensors) > MAX_TENSORS:
        raise FrameError(f"more than {MAX_TENSORS} tensors")
    fields = (frame.base_version, frame.seq, frame.samples, frame.steps)
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, int(frame.kind), codec.id, flags, codec.arg, *fields)
    return codec, [head, _U8.pack(len(device)), device, _U16.pack(len(frame.tensors))]


class _Reader:
    """Bounds-checked cursor over a buffer."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def _advance(self, n: int, what: str) -> int:
        """Move past ``n`` bytes (FrameError if the buffer has fewer left); where they start."""
        at = self.pos
        if n < 0 or at + n > len(self.data):
            raise FrameError(f"truncated frame: {what} needs {n} bytes at offset {at}")
        self.pos = at + n
        return at

    def take(self, n: int, what: str) -> memoryview:
        at = self._advance(n, what)
        return self.data[at : self.pos]

    def unpack(self, fmt: struct.Struct, what: str) -> tuple[Any, ...]:
        return fmt.unpack_from(self.data, self._advance(fmt.size, what))

    def varint(self, what: str) -> int:
        """An LEB128 unsigned integer of at most 4 bytes (below 2^28)."""
        value = 0
        for shift in (0, 7, 14, 21):
            byte = self.data[self._advance(1, what)]
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
        raise FrameError(f"{what}: a varint longer than 4 bytes")

    def ascii(self, what: str) -> str:
        (length,) = self.unpack(_U8, what + " length")
        try:
            return str(self.take(length, what), "ascii")
        except UnicodeDecodeError:
            raise FrameError(f"{what} is not ASCII") from None


@dataclass(frozen=True)
class RawTensor:
    """One tensor record as read from a frame, its payload not yet decoded."""

    name: str
    shape: tuple[int, ...]
    payload: memoryview

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


class RawFrame(NamedTuple):
    """A frame whose header, lengths and CRC are verified and whose tensor payloads are still
    bytes: a receiver checks names and shapes against what it expects *before* ``decode``
    allocates anything (a small top-k payload may declare a huge tensor). (A NamedTuple: one is
    made for every message, and a frozen dataclass's fields cost a call each.)"""

    kind: FrameKind
    base_version: int
    records: list[RawTensor]
    codec: Codec
    device: str = ""
    seq: int = 0
    samples: int = 0
    steps: int = 0
    compact: memoryview | None = None  # a compact commit's one payload (``records`` is then empty)
    tensors: int = 0  # how many it holds

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensors' names and shapes as the frame declares them (a compact commit declares none)."""
        return {record.name: record.shape for record in self.records}

    def matches(self, shapes: Mapping[str, tuple[int, ...]]) -> bool:
        """Whether the frame holds exactly the tensors of a model of ``shapes`` (a compact commit: as many)."""
        return self.tensors == len(shapes) if self.compact is not None else self.shapes == shapes

    def decode(self, shapes: Mapping[str, tuple[int, ...]] | None = None) -> Frame:
        """Decode every payload; FrameError if one does not fit its codec. A compact commit needs
        the model's ``shapes`` (in the model's order: the parameter frame's), which it ``matches``."""
        tensors: dict[str, np.ndarray] = {}
        values = None
        if self.compact is not None:
            if shapes is None or not self.matches(shapes):
                raise FrameError(f"a compact commit of {self.tensors} tensors needs the model's shapes")
            sizes = [math.prod(shape) for shape in shapes.values()]
            values = self.values(sum(sizes))
            end = 0
            for (name, shape), size in zip(shapes.items(), sizes, strict=True):
                tensors[name] = values[end : end + size].reshape(shape)
                end += size
        for record in self.records:
            try:
                tensors[record.name] = self.codec.decode(record.payload, record.shape)
            except CodecError as exc:
                raise FrameError(f"tensor {record.name!r}: {exc}") from exc
        return Frame(
            kind=self.kind,
            base_version=self.base_version,
            tensors=tensors,
            device=self.device,
            seq=self.seq,
            samples=self.samples,
            steps=self.steps,
            codec=self.codec.spec,
            flat=values if self.compact is not None else None,
        )

    def values(self, n: int) -> np.ndarray:
        """A compact commit's values decoded into one vector: the ``n`` of a model whose tensors it
        ``matches``, in the model's order (``decode`` without the tensors' views and the ``Frame``)."""
        if self.compact is None:
            raise FrameError("only a compact commit holds its values in one payload")
        try:
            return self.codec.decode_compact(self.compact, n)
        except CodecError as exc:
            raise FrameError(f"compact payload: {exc}") from exc


def peek_seq(data: bytes) -> int | None:
    """The ``seq`` field of what looks like a frame header (magic and length), unverified: for
    naming a refused message in a notice before (or without) parsing it."""
    if len(data) < _HEADER.size or data[:4] != MAGIC:
        return None
    return int(_HEADER.unpack_from(data)[7])


def peek_base_version(data: bytes) -> int | None:
    """The ``base_version`` field of what looks like a frame header, unverified (as ``peek_seq``)."""
    if len(data) < _HEADER.size or data[:4] != MAGIC:
        return None
    return int(_HEADER.unpack_from(data)[6])


def fp32_commit_size(shapes: Mapping[str, tuple[int, ...]], device_bytes: int = 64) -> int:
    """The bytes of an fp32 commit of tensors ``shapes`` from a device id of ``device_bytes``: the
    largest valid commit of a model (no codec encodes a tensor larger than fp32 does)."""
    size = _HEADER.size + _U8.size + device_bytes + _U16.size + _CRC.size
    for name, shape in shapes.items():
        size += _U8.size + len(name) + _U8.size + 4 * len(shape) + _U32.size + 4 * math.prod(shape)
    return size


def parse_frame(data: bytes, max_bytes: int = 64 << 20, max_elements: int = MAX_FRAME_ELEMENTS) -> RawFrame:
    """Verify a frame's CRC, header and every length, without decoding the tensors; raise
    FrameError with the first problem found (UnsupportedCodec for an unknown codec id).
    ``max_elements`` bounds the values all tensors declare together."""
    if len(data) > max_bytes:
        raise FrameError(f"frame of {len(data)} bytes exceeds the limit of {max_bytes}")
    if len(data) < _HEADER.size + _CRC.size:
        raise FrameError(f"frame of {len(data)} bytes is shorter than the {_HEADER.size}-byte header")
    view = memoryview(data)
    if view[:4] != MAGIC:
        raise FrameError("bad magic: not an edgeps frame")
    (crc,) = _CRC.unpack(view[-4:])
    if crc32(view[:-4]) != crc:
        raise FrameError("CRC-32 mismatch: frame corrupted")
    reader = _Reader(view[:-4])
    _, fmt_version, kind, codec_id, flags, codec_arg, base_version, seq, samples, steps = reader.unpack(
        _HEADER, "header"
    )
    if fmt_version != FORMAT_VERSION:
        raise FrameError(f"unsupported frame format version {fmt_version}")
    if kind not in _KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    kind = _KINDS[kind]
    if flags & ~COMPACT or (flags and kind != FrameKind.COMMIT):
        raise FrameError(f"flags {flags:#x}: only a commit may be compact (0x01); the other bits are reserved")
    try:
        codec = codec_from_header(codec_id, codec_arg)
    except UnknownCodecId as exc:
        raise UnsupportedCodec(str(exc)) from None
    except CodecError as exc:  # a known codec with an argument it does not take
        raise FrameError(str(exc)) from None
    device = reader.ascii("device id")
    (count,) = reader.unpack(_U16, "tensor count")
    if count > MAX_TENSORS:
        raise FrameError(f"{count} tensors exceed the limit of {MAX_TENSORS}")
    if flags & COMPACT:
        length = reader.varint("compact payload length")
        compact = reader.take(length, "compact payload")
        if reader.pos != len(reader.data):
            raise FrameError(f"{len(reader.data) - reader.pos} trailing bytes after the compact payload")
        fields = {"device": device, "seq": seq, "samples": samples, "steps": steps}
        return RawFrame(kind, base_version, [], codec, **fields, compact=compact, tensors=count)
    records: list[RawTensor] = []
    names: set[str] = set()
    total = 0
    for i in range(count):
        name = reader.ascii(f"tensor {i} name")
        if not _NAME.match(name) or name in names:
            raise FrameError(f"tensor {i}: invalid or duplicate name {name!r}")
        names.add(name)
        (ndim,) = reader.unpack(_U8, f"tensor {name!r} ndim")
        if ndim > MAX_NDIM:
            raise FrameError(f"tensor {name!r}: {ndim} dimensions exceed {MAX_NDIM}")
        shape = tuple(struct.unpack(f"<{ndim}I", reader.take(4 * ndim, f"tensor {name!r} dims")))
        total += math.prod(shape)
        if total > max_elements:
            raise FrameError(f"tensors declare more than {max_elements} values in all")
        (length,) = reader.unpack(_U32, f"tensor {name!r} payload length")
        records.append(RawTensor(name, shape, reader.take(length, f"tensor {name!r} payload")))
    if reader.pos != len(reader.data):
        raise FrameError(f"{len(reader.data) - reader.pos} trailing bytes after the last tensor")
    return RawFrame(
        kind=kind,
        base_version=base_version,
        records=records,
        codec=codec,
        device=device,
        seq=seq,
        samples=samples,
        steps=steps,
    )


def decode_frame(
    data: bytes,
    max_bytes: int = 64 << 20,
    max_elements: int = MAX_FRAME_ELEMENTS,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> Frame:
    """Parse, verify and decode a frame; raise FrameError with the first problem found. ``shapes``:
    the model's, in its order (a compact commit names none of its own)."""
    return parse_frame(data, max_bytes, max_elements).decode(shapes)


def encode_compact(frame: Frame, payload: bytes) -> bytes:
    """A compact commit: ``frame``'s header (its tensors counted, not named), then ``payload``, the
    codec's ``encode_compact`` of the model's values concatenated in the model's order."""
    if frame.kind != FrameKind.COMMIT:
        raise FrameError("only a commit may be compact")
    if len(payload) >= 1 << 28:
        raise FrameError("compact payload of 256 MiB or more")
    _, parts = _head(frame, COMPACT)
    body = b"".join([*parts, leb128(np.array([len(payload)])), payload])
    return body + _CRC.pack(crc32(body))


def encode_data_frame(x: np.ndarray, y: np.ndarray) -> bytes:
    """A device's training data as the C SDK reads it (edge_client/embedded): a parameter-kind fp32
    frame holding ``x`` (n, features) and ``y`` (n,), the labels as floats."""
    x, y = np.asarray(x, np.float32), np.asarray(y)
    if x.ndim != 2 or y.shape != (len(x),) or len(x) == 0:
        raise FrameError(f"data needs x (n, features) and y (n,), got {x.shape} and {y.shape}")
    return encode_frame(Frame(kind=FrameKind.PARAMS, base_version=0, tensors={"x": x, "y": y.astype(np.float32)}))
