"""ternary (TernGrad): per bucket a float32 scale, then two bit planes."""

from __future__ import annotations

import numpy as np

from schemas.codecs import bits
from schemas.codecs.base import Codec, CodecError, count, expect, finite, flat, non_finite, register
from schemas.codecs.bits import (
    BUCKET,
    bit_plane,
    bucket_reduce,
    buckets,
    inverse,
    packed_size,
    scale_buckets,
    stream_key,
    uniforms,
)


@register
class Ternary(Codec):
    """TernGrad: per bucket a float32 scale s = max |x|; each value becomes s * sign(x) with
    probability |x| / s, else 0 (unbiased; the draws come from ``bits.uniforms``). Two bit planes of n bits each: first
    "positive" (1 = +s), then "negative" (1 = -s); a value with both bits set is invalid."""

    id = 4
    name = "ternary"

    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        x = flat(values)
        n, key = len(x), stream_key(rng or np.random.default_rng())
        if bits.kernels is not None:
            return finite(bits.kernels.ternary_encode(x, *key, BUCKET), "ternary")
        scales = bucket_reduce(x, "max")
        if not np.isfinite(scales).all():
            raise non_finite("ternary")
        kept = uniforms(key, n) < scale_buckets(np.abs(x), inverse(scales))
        negative = x < 0
        return (
            scales.astype("<f4").tobytes()
            + np.packbits(kept & ~negative, bitorder="little").tobytes()
            + np.packbits(kept & negative, bitorder="little").tobytes()
        )

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        n = count(shape)
        nb = buckets(n)
        plane = packed_size(n, 1)
        expect(payload, 4 * nb + 2 * plane, "ternary")
        if bits.kernels is not None:
            out, view = np.empty(n, np.float32), memoryview(payload)
            planes = view[4 * nb : 4 * nb + plane], view[4 * nb + plane :]
            if not bits.kernels.ternary_decode(view[: 4 * nb], *planes, out, BUCKET):
                raise CodecError("ternary value both positive and negative")
            return out.reshape(shape)
        scales = np.frombuffer(payload, dtype="<f4", count=nb).astype(np.float32)
        positive = bit_plane(payload, 4 * nb, n)
        negative = bit_plane(payload, 4 * nb + plane, n)
        if (positive & negative).any():  # only the n values' bits: padding bits are ignored
            raise CodecError("ternary value both positive and negative")
        positive -= negative  # 0, +1 or -1
        return scale_buckets(positive, scales, out=np.empty(n, np.float32)).reshape(shape)
