"""int8: per bucket a float32 scale, then one int8 per value."""

from __future__ import annotations

import numpy as np

from schemas.codecs import bits
from schemas.codecs.base import Codec, count, expect, finite, flat, non_finite, register
from schemas.codecs.bits import BUCKET, bucket_reduce, buckets, inverse, scale_buckets


@register
class Int8(Codec):
    """Per bucket of 512 values: a float32 scale (max |x| / 127), then one int8 per value."""

    id = 2
    name = "int8"
    biased = True

    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        x = flat(values)
        if bits.kernels is not None:
            return finite(bits.kernels.int8_encode(x, BUCKET), "int8")
        scales = bucket_reduce(x, "max") / np.float32(127)
        if not np.isfinite(scales).all():
            raise non_finite("int8")
        scaled = scale_buckets(x, inverse(scales), out=np.empty_like(x))
        np.rint(scaled, out=scaled)
        return scales.astype("<f4").tobytes() + scaled.astype(np.int8).tobytes()

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        n = count(shape)
        nb = buckets(n)
        expect(payload, 4 * nb + n, "int8")
        if bits.kernels is not None:
            out = np.empty(n, np.float32)
            bits.kernels.int8_decode(memoryview(payload)[: 4 * nb], memoryview(payload)[4 * nb :], out, BUCKET)
            return out.reshape(shape)
        scales = np.frombuffer(payload, dtype="<f4", count=nb).astype(np.float32)
        q = np.frombuffer(payload, dtype=np.int8, offset=4 * nb, count=n)
        return scale_buckets(q.astype(np.float32), scales).reshape(shape)
