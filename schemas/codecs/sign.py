"""sign: per bucket a float32 scale, then one bit per value."""

from __future__ import annotations

import numpy as np

from schemas.codecs import bits
from schemas.codecs.base import Codec, count, expect, flat, register
from schemas.codecs.bits import BUCKET, bit_plane, bucket_reduce, buckets, packed_size, scale_buckets


@register
class Sign(Codec):
    """Per bucket of 512 values: a float32 scale (mean |x|); then one bit per value, 1 = negative."""

    id = 3
    name = "sign"
    biased = True

    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        x = flat(values)
        if bits.kernels is not None:
            payload: bytes = bits.kernels.sign_encode(x, BUCKET)
            return payload
        return bucket_reduce(x, "mean").astype("<f4").tobytes() + np.packbits(x < 0, bitorder="little").tobytes()

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        n = count(shape)
        nb = buckets(n)
        expect(payload, 4 * nb + packed_size(n, 1), "sign")
        if bits.kernels is not None:
            out = np.empty(n, np.float32)
            bits.kernels.sign_decode(memoryview(payload)[: 4 * nb], memoryview(payload)[4 * nb :], out, BUCKET)
            return out.reshape(shape)
        scales = np.frombuffer(payload, dtype="<f4", count=nb).astype(np.float32)
        signs = bit_plane(payload, 4 * nb, n)  # 0 or 1, as int8
        signs *= np.int8(-2)
        signs += np.int8(1)  # +1 or -1
        return scale_buckets(signs, scales, out=np.empty(n, np.float32)).reshape(shape)
