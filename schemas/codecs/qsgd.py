"""qsgd: per bucket a float32 L2 norm, then a signed level per value in 2, 4 or 8 bits."""

from __future__ import annotations

import math

import numpy as np

from schemas.codecs import bits
from schemas.codecs.base import Codec, CodecError, count, expect, finite, flat, non_finite, register
from schemas.codecs.bits import (
    BUCKET,
    bucket_reduce,
    buckets,
    inverse,
    pack_bits,
    packed_size,
    scale_buckets,
    stream_key,
    uniforms,
    unpack_bits,
)


@register
class Qsgd(Codec):
    """QSGD with s levels: per bucket a float32 L2 norm; each value becomes
    norm * sign(x) * l / s, l in 0..s drawn so that the result is unbiased. Codes are the
    signed level sign(x) * l in two's complement: int8 for s > 7, 4-bit nibbles for s <= 7
    (first value in the low nibble), 2 bits for s = 1."""

    id = 5
    name = "qsgd"
    usage = "qsgd:S"

    def __init__(self, levels: int = 16) -> None:
        if not 1 <= levels <= 127:
            raise CodecError("qsgd needs 1 to 127 levels")
        self.levels = levels
        self.arg = float(levels)
        self.bits = 2 if levels <= 1 else 4 if levels <= 7 else 8

    @property
    def spec(self) -> str:
        return f"qsgd:{self.levels}"

    @classmethod
    def from_spec_arg(cls, arg: str) -> Codec:
        """``qsgd:S`` with 1 <= S <= 127 levels; bare ``qsgd`` is ``qsgd:16``."""
        return cls(int(arg) if arg else 16)

    @classmethod
    def from_header_arg(cls, arg: float) -> Codec:
        if not (math.isfinite(arg) and float(arg).is_integer()):
            raise CodecError(f"qsgd levels must be an integer, got {arg}")
        return cls(int(arg))

    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        x = flat(values)
        n, key = len(x), stream_key(rng or np.random.default_rng())
        if bits.kernels is not None:
            return finite(bits.kernels.qsgd_encode(x, *key, self.levels, self.bits, BUCKET), self.spec)
        norms = bucket_reduce(x, "l2")
        if not np.isfinite(norms).all():
            raise non_finite(self.spec)
        scaled = scale_buckets(np.abs(x), inverse(norms, self.levels))
        scaled += uniforms(key, n)
        # min(): float rounding can put |x| * s / norm a hair above s
        level = np.minimum(np.floor(scaled), self.levels).astype(np.int8)
        np.negative(level, out=level, where=x < 0)
        codes = level.view(np.uint8) & np.uint8((1 << self.bits) - 1)
        return norms.astype("<f4").tobytes() + pack_bits(codes, self.bits)

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        n = count(shape)
        nb = buckets(n)
        expect(payload, 4 * nb + packed_size(n, self.bits), self.spec)
        norms = np.frombuffer(payload, dtype="<f4", count=nb).astype(np.float32)
        if bits.kernels is not None:
            out = np.empty(n, np.float32)
            steps = norms / np.float32(self.levels)
            if not bits.kernels.qsgd_decode(steps, memoryview(payload)[4 * nb :], self.bits, self.levels, out, BUCKET):
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
        return scale_buckets(level, norms / np.float32(self.levels), out=np.empty(n, np.float32)).reshape(shape)
