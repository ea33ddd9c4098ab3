"""fp32 and fp16: each value as an IEEE-754 float."""

from __future__ import annotations

import sys

import numpy as np

from schemas.codecs import bits
from schemas.codecs.base import Codec, count, expect, flat, register

_FLOAT32 = np.dtype("<f4")


class _PlainFloat(Codec):
    """Each value as an IEEE-754 float of ``wire`` type, little-endian, C order."""

    wire: str

    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        return np.ascontiguousarray(values, dtype=self.wire).tobytes()

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        expect(payload, np.dtype(self.wire).itemsize * count(shape), self.name)
        return np.frombuffer(payload, dtype=self.wire).astype(np.float32).reshape(shape)


@register
class Fp32(_PlainFloat):
    """Raw IEEE-754 float32. Lossless."""

    id = 0
    name = "fp32"
    wire = "<f4"

    def decode_compact(self, payload: bytes | memoryview, n: int) -> np.ndarray:
        expect(payload, 4 * n, self.name)
        if sys.byteorder == "little":  # a copy (the payload's buffer is not kept) that holds the GIL: numpy's
            return np.frombuffer(bytearray(payload), np.float32)  # lets the network thread in mid-commit
        return np.frombuffer(payload, _FLOAT32).astype(np.float32)


@register
class Fp16(_PlainFloat):
    """IEEE-754 binary16. Values beyond ±65504 are clipped to it rather than becoming ±inf."""

    id = 1
    name = "fp16"
    wire = "<f2"
    biased = True

    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        if bits.kernels is None:
            return super().encode(np.clip(flat(values), -65504.0, 65504.0))
        payload: bytes = bits.kernels.fp16_encode(flat(values))  # the halves of numpy's cast of the clipped values
        return payload

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        if bits.kernels is None:
            return super().decode(payload, shape)
        expect(payload, 2 * count(shape), self.name)
        out = np.empty(count(shape), np.float32)
        bits.kernels.fp16_decode(payload, out)
        return out.reshape(shape)
