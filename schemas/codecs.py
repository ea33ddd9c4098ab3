"""Codecs: how one tensor's values become the payload bytes of a frame.

Every codec has a wire id and, for the parameterised ones, a float argument; both travel
in the frame header, so a receiver needs nothing else to decode. docs/PROTOCOL.md gives
each byte layout. All work is vectorised with numpy; no Python loop runs per value. Where
the optional compiled module ``schemas._kernels`` was built, the hot loops (int8 and sign
encode, every decoder but fp32's and topk's) run there instead, giving the same floats.

Biased codecs (``biased = True``) are meant to be used with error feedback: the sender
keeps what the codec dropped and adds it to its next tensor (see ``ErrorFeedback``).
"""

from __future__ import annotations

import functools
import math
import sys
from abc import ABC, abstractmethod

import numpy as np

try:  # compiled loops for the hot codecs (schemas/_kernels.c); the numpy code below gives the same results
    from schemas import _kernels
except ImportError:  # built without a C compiler
    _kernels = None
if sys.byteorder != "little":  # the loops read the little-endian wire format as native numbers
    _kernels = None

BUCKET = 512  # values per scale in int8, sign, ternary and qsgd


class CodecError(ValueError):
    """A payload that does not decode under its codec, or a codec spec that does not parse."""


class UnknownCodecId(CodecError):
    """A frame header names a codec id this side does not implement."""


class Codec(ABC):
    """Turns a float32 tensor into bytes and back.

    ``encode`` may be lossy (and, for stochastic codecs, random: pass ``rng``);
    ``decode`` rejects a payload of the wrong length with CodecError and returns a new,
    writable float32 array of ``shape``.
    """

    id: int
    name: str
    arg: float = 0.0
    biased: bool = False

    @property
    def spec(self) -> str:
        """The codec's name with its parameter, e.g. ``qsgd:16``; ``make_codec`` parses it."""
        return self.name

    @abstractmethod
    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        """Payload bytes for ``values`` (any shape, cast to float32)."""

    @abstractmethod
    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        """The float32 array of ``shape`` that ``payload`` encodes."""


def _count(shape: tuple[int, ...]) -> int:
    return int(math.prod(shape))


def _flat(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).reshape(-1)


def _expect(payload: bytes | memoryview, size: int, what: str) -> None:
    if len(payload) != size:
        raise CodecError(f"{what} payload has {len(payload)} bytes, expected {size}")


def _buckets(n: int) -> int:
    return -(-n // BUCKET)


def _bucket_reduce(x: np.ndarray, how: str) -> np.ndarray:
    """Per-bucket max of |x| (``max``), mean of |x| (``mean``) or L2 norm (``l2``), float32."""
    n, full = len(x), len(x) // BUCKET * BUCKET
    parts = []
    for block in (x[:full].reshape(-1, BUCKET), x[full:].reshape(1, -1) if full < n else None):
        if block is None or block.size == 0:
            continue
        if how == "max":  # two reductions, no |x| temporary; + 0 turns a -0 maximum into 0
            parts.append(np.maximum(block.max(axis=1), -block.min(axis=1)) + np.float32(0))
        elif how == "mean":
            parts.append(np.mean(np.abs(block), axis=1))
        else:
            parts.append(np.sqrt(np.einsum("ij,ij->i", block, block)))
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


def _inverse(scales: np.ndarray, numerator: float = 1.0) -> np.ndarray:
    """numerator / scales, and 0 where a scale is too small to invert (its values quantize to 0)."""
    out = np.zeros_like(scales)
    np.divide(np.float32(numerator), scales, out=out, where=scales > np.float32(1e-30))
    return out


def _scale_buckets(values: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Each bucket of ``values`` (float32, flat) times its scale, into ``out`` (default: in place)."""
    out = values if out is None else out
    full = len(values) // BUCKET * BUCKET
    if full:
        np.multiply(
            values[:full].reshape(-1, BUCKET), scales[: full // BUCKET, None], out=out[:full].reshape(-1, BUCKET)
        )
    if full < len(values):
        np.multiply(values[full:], scales[-1], out=out[full:])
    return out


def _bits(payload: bytes | memoryview, offset: int, n: int) -> np.ndarray:
    """``n`` bits packed little-endian from ``offset``, as a writable int8 array of 0 and 1."""
    raw = np.frombuffer(payload, dtype=np.uint8, offset=offset, count=packed_size(n, 1))
    return np.unpackbits(raw, count=n, bitorder="little").view(np.int8)


def pack_bits(codes: np.ndarray, bits: int) -> bytes:
    """Pack unsigned codes < 2**bits (bits 1, 2, 4 or 8) into bytes, first value in the low bits."""
    if bits == 8:
        return codes.astype(np.uint8).tobytes()
    if bits == 1:
        return np.packbits(codes.astype(bool), bitorder="little").tobytes()
    per = 8 // bits
    n = len(codes)
    padded = np.zeros(-(-n // per) * per, dtype=np.uint8)
    padded[:n] = codes
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    return np.bitwise_or.reduce(padded.reshape(-1, per) << shifts, axis=1).astype(np.uint8).tobytes()


def unpack_bits(data: bytes | memoryview, bits: int, n: int) -> np.ndarray:
    """The ``n`` codes that ``pack_bits`` packed, as uint8."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if bits == 8:
        return raw[:n].copy()
    if bits == 1:
        return np.unpackbits(raw, count=n, bitorder="little")
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    return ((raw[:, None] >> shifts) & np.uint8((1 << bits) - 1)).reshape(-1)[:n]


def packed_size(n: int, bits: int) -> int:
    return -(-n * bits // 8)


class _PlainFloat(Codec):
    """Each value as an IEEE-754 float of ``wire`` type, little-endian, C order."""

    wire: str

    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        return np.ascontiguousarray(values, dtype=self.wire).tobytes()

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        _expect(payload, np.dtype(self.wire).itemsize * _count(shape), self.name)
        return np.frombuffer(payload, dtype=self.wire).astype(np.float32).reshape(shape)


class Fp32(_PlainFloat):
    """Raw IEEE-754 float32. Lossless."""

    id = 0
    name = "fp32"
    wire = "<f4"


class Fp16(_PlainFloat):
    """IEEE-754 binary16. Values beyond ±65504 are clipped to it rather than becoming ±inf."""

    id = 1
    name = "fp16"
    wire = "<f2"
    biased = True

    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        return super().encode(np.clip(_flat(values), -65504.0, 65504.0))

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        if _kernels is None:
            return super().decode(payload, shape)
        _expect(payload, 2 * _count(shape), self.name)
        out = np.empty(_count(shape), np.float32)
        _kernels.fp16_decode(payload, out)
        return out.reshape(shape)


class Int8(Codec):
    """Per bucket of 512 values: a float32 scale (max |x| / 127), then one int8 per value."""

    id = 2
    name = "int8"
    biased = True

    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        x = _flat(values)
        if _kernels is not None:
            nb = _buckets(len(x))
            out = bytearray(4 * nb + len(x))
            if not _kernels.int8_encode(x, memoryview(out)[: 4 * nb], memoryview(out)[4 * nb :], BUCKET):
                raise CodecError("int8 cannot encode non-finite values")
            return bytes(out)
        scales = _bucket_reduce(x, "max") / np.float32(127)
        if not np.isfinite(scales).all():
            raise CodecError("int8 cannot encode non-finite values")
        scaled = _scale_buckets(x, _inverse(scales), out=np.empty_like(x))
        np.rint(scaled, out=scaled)
        return scales.astype("<f4").tobytes() + scaled.astype(np.int8).tobytes()

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        n = _count(shape)
        nb = _buckets(n)
        _expect(payload, 4 * nb + n, "int8")
        if _kernels is not None:
            out = np.empty(n, np.float32)
            _kernels.int8_decode(memoryview(payload)[: 4 * nb], memoryview(payload)[4 * nb :], out, BUCKET)
            return out.reshape(shape)
        scales = np.frombuffer(payload, dtype="<f4", count=nb).astype(np.float32)
        q = np.frombuffer(payload, dtype=np.int8, offset=4 * nb, count=n)
        return _scale_buckets(q.astype(np.float32), scales).reshape(shape)


class Sign(Codec):
    """Per bucket of 512 values: a float32 scale (mean |x|); then one bit per value, 1 = negative."""

    id = 3
    name = "sign"
    biased = True

    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        x = _flat(values)
        if _kernels is not None:
            nb = _buckets(len(x))
            out = bytearray(4 * nb + packed_size(len(x), 1))
            _kernels.sign_encode(x, memoryview(out)[: 4 * nb], memoryview(out)[4 * nb :], BUCKET)
            return bytes(out)
        return _bucket_reduce(x, "mean").astype("<f4").tobytes() + np.packbits(x < 0, bitorder="little").tobytes()

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        n = _count(shape)
        nb = _buckets(n)
        _expect(payload, 4 * nb + packed_size(n, 1), "sign")
        if _kernels is not None:
            out = np.empty(n, np.float32)
            _kernels.sign_decode(memoryview(payload)[: 4 * nb], memoryview(payload)[4 * nb :], out, BUCKET)
            return out.reshape(shape)
        scales = np.frombuffer(payload, dtype="<f4", count=nb).astype(np.float32)
        signs = _bits(payload, 4 * nb, n)  # 0 or 1, as int8
        signs *= np.int8(-2)
        signs += np.int8(1)  # +1 or -1
        return _scale_buckets(signs, scales, out=np.empty(n, np.float32)).reshape(shape)


class Ternary(Codec):
    """TernGrad: per bucket a float32 scale s = max |x|; each value becomes s * sign(x) with
    probability |x| / s, else 0 (unbiased). Two bit planes of n bits each: first
    "positive" (1 = +s), then "negative" (1 = -s); a value with both bits set is invalid."""

    id = 4
    name = "ternary"

    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        rng = rng or np.random.default_rng()
        x = _flat(values)
        scales = _bucket_reduce(x, "max")
        probability = _scale_buckets(np.abs(x), _inverse(scales))
        kept = rng.random(len(x), dtype=np.float32) < probability
        negative = x < 0
        return (
            scales.astype("<f4").tobytes()
            + np.packbits(kept & ~negative, bitorder="little").tobytes()
            + np.packbits(kept & negative, bitorder="little").tobytes()
        )

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        n = _count(shape)
        nb = _buckets(n)
        plane = packed_size(n, 1)
        _expect(payload, 4 * nb + 2 * plane, "ternary")
        if _kernels is not None:
            out, view = np.empty(n, np.float32), memoryview(payload)
            planes = view[4 * nb : 4 * nb + plane], view[4 * nb + plane :]
            if not _kernels.ternary_decode(view[: 4 * nb], *planes, out, BUCKET):
                raise CodecError("ternary value both positive and negative")
            return out.reshape(shape)
        scales = np.frombuffer(payload, dtype="<f4", count=nb).astype(np.float32)
        positive = _bits(payload, 4 * nb, n)
        negative = _bits(payload, 4 * nb + plane, n)
        if (positive & negative).any():  # only the n values' bits: padding bits are ignored
            raise CodecError("ternary value both positive and negative")
        positive -= negative  # 0, +1 or -1
        return _scale_buckets(positive, scales, out=np.empty(n, np.float32)).reshape(shape)


class Qsgd(Codec):
    """QSGD with s levels: per bucket a float32 L2 norm; each value becomes
    norm * sign(x) * l / s, l in 0..s drawn so that the result is unbiased. Codes are the
    signed level sign(x) * l in two's complement: int8 for s > 7, 4-bit nibbles for s <= 7
    (first value in the low nibble), 2 bits for s = 1."""

    id = 5
    name = "qsgd"

    def __init__(self, levels: int = 16) -> None:
        if not 1 <= levels <= 127:
            raise CodecError("qsgd needs 1 to 127 levels")
        self.levels = levels
        self.arg = float(levels)
        self.bits = 2 if levels <= 1 else 4 if levels <= 7 else 8

    @property
    def spec(self) -> str:
        return f"qsgd:{self.levels}"

    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        rng = rng or np.random.default_rng()
        x = _flat(values)
        norms = _bucket_reduce(x, "l2")
        scaled = _scale_buckets(np.abs(x), _inverse(norms, self.levels))
        scaled += rng.random(len(x), dtype=np.float32)
        # min(): float rounding can put |x| * s / norm a hair above s
        level = np.minimum(np.floor(scaled), self.levels).astype(np.int8)
        np.negative(level, out=level, where=x < 0)
        codes = level.view(np.uint8) & np.uint8((1 << self.bits) - 1)
        return norms.astype("<f4").tobytes() + pack_bits(codes, self.bits)

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        n = _count(shape)
        nb = _buckets(n)
        _expect(payload, 4 * nb + packed_size(n, self.bits), self.spec)
        norms = np.frombuffer(payload, dtype="<f4", count=nb).astype(np.float32)
        if _kernels is not None:
            out = np.empty(n, np.float32)
            steps = norms / np.float32(self.levels)
            if not _kernels.qsgd_decode(steps, memoryview(payload)[4 * nb :], self.bits, self.levels, out, BUCKET):
                raise CodecError(f"qsgd level beyond +-{self.levels}")
            return out.reshape(shape)
        codes = unpack_bits(memoryview(payload)[4 * nb :], self.bits, n)
        if self.bits == 8:
            level = codes.view(np.int8)
        else:  # sign-extend the narrow two's complement codes
            top = np.uint8(1 << (self.bits - 1))
            level = ((codes ^ top) - top).view(np.int8)
        if level.size and (level.min() < -self.levels or level.max() > self.levels):
            raise CodecError(f"qsgd level beyond +-{self.levels}")
        return _scale_buckets(level, norms / np.float32(self.levels), out=np.empty(n, np.float32)).reshape(shape)


class TopK(Codec):
    """The fraction p of the values largest in magnitude; the rest are zero (after Deep
    Gradient Compression). Payload: u32 k, f32 scale (max |kept| / 127), u8 index width w
    (1, 2 or 4), k ascending indices delta-encoded (first index, then gaps) as w-byte
    unsigned little-endian integers, then k int8 values (value / scale, rounded).

    k is exactly ``keep(n)``: ceil(P * n) with P the header's float32 argument, computed in
    double precision, at least 1 and at most n; a decoder refuses any other k."""

    id = 6
    name = "topk"
    biased = True

    def __init__(self, fraction: float = 0.01) -> None:
        if not 0 < fraction <= 1:
            raise CodecError("topk needs a fraction in (0, 1]")
        self.fraction = fraction
        self.arg = float(np.float32(fraction))

    @property
    def spec(self) -> str:
        return f"topk:{self.fraction:g}"

    def keep(self, n: int) -> int:
        """How many of ``n`` values a frame keeps."""
        return min(n, max(1, math.ceil(self.arg * n))) if n else 0

    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        x = _flat(values)
        n = len(x)
        k = self.keep(n)
        idx = np.sort(np.argpartition(np.abs(x), n - k)[n - k :]) if k else np.zeros(0, np.int64)
        kept = x[idx]
        scale = np.float32(np.max(np.abs(kept)) / 127) if k else np.float32(0)
        q = np.rint(kept / scale).astype(np.int8) if scale > 0 else np.zeros(k, np.int8)
        gaps = np.diff(idx, prepend=0).astype(np.uint32)
        width = 1 if k == 0 or gaps.max() < 256 else 2 if gaps.max() < 65536 else 4
        dtype = {1: "<u1", 2: "<u2", 4: "<u4"}[width]
        head = np.array([k], "<u4").tobytes() + np.array([scale], "<f4").tobytes() + bytes([width])
        return head + gaps.astype(dtype).tobytes() + q.tobytes()

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        n = _count(shape)
        if len(payload) < 9:
            raise CodecError("topk payload shorter than its 9-byte head")
        k = int(np.frombuffer(payload, "<u4", count=1)[0])
        scale = np.frombuffer(payload, "<f4", count=1, offset=4)[0]
        width = payload[8]
        if width not in (1, 2, 4) or k != self.keep(n):
            raise CodecError(f"topk: bad index width {width}, or k {k} is not ceil({self.arg:g} * {n})")
        _expect(payload, 9 + k * width + k, "topk")
        gaps = np.frombuffer(payload, {1: "<u1", 2: "<u2", 4: "<u4"}[width], count=k, offset=9)
        idx = np.cumsum(gaps, dtype=np.int64)
        if k and (idx[-1] >= n or (k > 1 and (gaps[1:] == 0).any())):
            raise CodecError("topk indices out of range or repeated")
        out = np.zeros(n, np.float32)
        out[idx] = np.frombuffer(payload, np.int8, count=k, offset=9 + k * width) * np.float32(scale)
        return out.reshape(shape)


_SIMPLE: dict[str, type[Codec]] = {c.name: c for c in (Fp32, Fp16, Int8, Sign, Ternary)}
_BY_ID: dict[int, type[Codec]] = {c.id: c for c in (Fp32, Fp16, Int8, Sign, Ternary, Qsgd, TopK)}
CODECS = ("fp32", "fp16", "int8", "sign", "ternary", "qsgd:S", "topk:P")


def make_codec(spec: str) -> Codec:
    """A codec from its spec: ``fp32``, ``fp16``, ``int8``, ``sign``, ``ternary``, ``qsgd:S``
    (1 <= S <= 127 levels) or ``topk:P`` (0 < P <= 1)."""
    name, _, arg = spec.partition(":")
    try:
        if name in _SIMPLE and not arg:
            return _SIMPLE[name]()
        if name == "qsgd":
            return Qsgd(int(arg) if arg else 16)
        if name == "topk":
            return TopK(float(arg) if arg else 0.01)
    except ValueError as exc:
        raise CodecError(f"bad codec spec {spec!r}: {exc}") from None
    raise CodecError(f"unknown codec {spec!r}; known: {', '.join(CODECS)}")


def relative_error(codec: Codec, values: np.ndarray, rng: np.random.Generator | None = None) -> float:
    """``|decode(encode(x)) - x| / |x|``: how much of a tensor one round trip through ``codec`` gets wrong."""
    values = np.asarray(values, np.float32)
    decoded = codec.decode(codec.encode(values, rng), values.shape)
    return float(np.linalg.norm(decoded - values) / np.linalg.norm(values))


@functools.cache
def typical_error(spec: str) -> float:
    """``relative_error`` of the codec ``spec`` on 4096 standard normal values, seeded: a codec's
    noise level, the same on every run."""
    rng = np.random.default_rng(0)
    return relative_error(make_codec(spec), rng.standard_normal(4096).astype(np.float32), rng)


def compiled() -> bool:
    """Whether the compiled loops of ``schemas._kernels`` are in use (else numpy's)."""
    return _kernels is not None


def codec_from_header(codec_id: int, arg: float) -> Codec:
    """The codec a frame header names: UnknownCodecId for an id this side does not implement,
    CodecError for an argument the codec does not take (qsgd: an integer 1..127 of levels;
    topk: a fraction in (0, 1]; every other codec: exactly 0)."""
    cls = _BY_ID.get(codec_id)
    if cls is None:
        raise UnknownCodecId(f"unknown codec id {codec_id}")
    if cls is Qsgd:
        if not (math.isfinite(arg) and float(arg).is_integer()):
            raise CodecError(f"qsgd levels must be an integer, got {arg}")
        return Qsgd(int(arg))
    if cls is TopK:
        if not math.isfinite(arg):
            raise CodecError(f"topk needs a finite fraction, got {arg}")
        return TopK(float(arg))
    if arg != 0:
        raise CodecError(f"{cls.name} takes no argument: the header's codec argument must be 0.0, got {arg}")
    return cls()


class ErrorFeedback:
    """Error feedback for a biased codec (after EF-SGD): what the codec dropped from one
    tensor is added to the next one of the same name, so nothing is lost, only delayed."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.residual: dict[str, np.ndarray] = {}

    def compensate(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``tensors`` plus the carried residual; the codec's loss on them becomes the new residual.

        Returns the compensated tensors to encode. An unbiased codec keeps no residual: one left
        by a biased codec before a switch (``codec`` may change between calls) goes out once,
        added to these tensors."""
        if not self.codec.biased:
            if not self.residual:
                return tensors
            carried, self.residual = self.residual, {}
            return {name: (values + carried[name]).astype(np.float32) if name in carried else values
                    for name, values in tensors.items()}  # fmt: skip
        out = {}
        for name, values in tensors.items():
            carried = values + self.residual[name] if name in self.residual else values
            carried = carried.astype(np.float32)
            decoded = self.codec.decode(self.codec.encode(carried), carried.shape)
            self.residual[name] = carried - decoded
            out[name] = carried
        return out
