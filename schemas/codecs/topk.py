"""topk: the largest values by magnitude, their indices delta-encoded, values as int8."""

from __future__ import annotations

import math

import numpy as np

from schemas.codecs import bits
from schemas.codecs.base import Codec, CodecError, count, expect, finite, flat, non_finite, register


@register
class TopK(Codec):
    """The fraction p of the values largest in magnitude; the rest are zero (after Deep
    Gradient Compression). Payload: u32 k, f32 scale (max |kept| / 127), u8 index width w
    (1, 2 or 4), k ascending indices delta-encoded (first index, then gaps) as w-byte
    unsigned little-endian integers, then k int8 values (value / scale, rounded).

    k is exactly ``keep(n)``: ceil(P * n) with P the header's float32 argument, computed in
    double precision, at least 1 and at most n; a decoder refuses any other k."""

    id = 6
    name = "topk"
    usage = "topk:P"
    biased = True

    def __init__(self, fraction: float = 0.01) -> None:
        if not 0 < fraction <= 1:
            raise CodecError("topk needs a fraction in (0, 1]")
        self.fraction = fraction
        self.arg = float(np.float32(fraction))

    @property
    def spec(self) -> str:
        return f"topk:{self.fraction:g}"

    @classmethod
    def from_spec_arg(cls, arg: str) -> Codec:
        """``topk:P`` with 0 < P <= 1; bare ``topk`` is ``topk:0.01``."""
        return cls(float(arg) if arg else 0.01)

    @classmethod
    def from_header_arg(cls, arg: float) -> Codec:
        if not math.isfinite(arg):
            raise CodecError(f"topk needs a finite fraction, got {arg}")
        return cls(float(arg))

    def keep(self, n: int) -> int:
        """How many of ``n`` values a frame keeps."""
        return min(n, max(1, math.ceil(self.arg * n))) if n else 0

    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        x = flat(values)
        n = len(x)
        k = self.keep(n)
        if k and bits.kernels is not None:  # the same bytes as below, with a radix select rather than a partition
            return finite(bits.kernels.topk_encode(x, k), "topk")
        key = x.view(np.uint32) & np.uint32(0x7FFFFFFF)  # |x| as bits: their order is the values' order
        if k and key.max() >= 0x7F800000:
            raise non_finite("topk")
        keep = np.zeros(n, bool)
        if k:  # the k largest keys, ties going to the lower index
            threshold = np.partition(key, n - k)[n - k]
            keep = key > threshold
            keep[np.flatnonzero(key == threshold)[: k - np.count_nonzero(keep)]] = True
        idx = np.flatnonzero(keep)
        kept = x[idx]
        scale = np.float32(np.max(np.abs(kept)) / np.float32(127)) if k else np.float32(0)
        q = np.rint(kept / scale).astype(np.int8) if scale > 0 else np.zeros(k, np.int8)
        gaps = np.diff(idx, prepend=0).astype(np.uint32)
        width = 1 if k == 0 or gaps.max() < 256 else 2 if gaps.max() < 65536 else 4
        dtype = {1: "<u1", 2: "<u2", 4: "<u4"}[width]
        head = np.array([k], "<u4").tobytes() + np.array([scale], "<f4").tobytes() + bytes([width])
        return head + gaps.astype(dtype).tobytes() + q.tobytes()

    def encode_compact(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        """f32 scale, the k indices as LEB128 gaps (first index, then gaps), k int8 values: k
        follows from n, and a gap takes one byte below 128, two below 16,384."""
        payload = self.encode(values, rng)
        k, width = int(np.frombuffer(payload, "<u4", count=1)[0]), payload[8]
        gaps = np.frombuffer(payload, {1: "<u1", 2: "<u2", 4: "<u4"}[width], count=k, offset=9)
        return payload[4:8] + bits.leb128(gaps) + payload[9 + k * width :]

    def decode_compact(self, payload: bytes | memoryview, n: int) -> np.ndarray:
        k = self.keep(n)
        if len(payload) < 4 + 2 * k:
            raise CodecError(f"topk compact payload of {len(payload)} bytes is too short for k = {k}")
        scale = np.frombuffer(payload, "<f4", count=1)[0]
        try:
            gaps = bits.unleb128(memoryview(payload)[4 : len(payload) - k], k)
        except ValueError as exc:
            raise CodecError(f"topk compact gaps: {exc}") from None
        return self._place(gaps, np.frombuffer(payload, np.int8, count=k, offset=len(payload) - k), scale, n)

    def _place(self, gaps: np.ndarray, q: np.ndarray, scale: np.float32, n: int) -> np.ndarray:
        """The n values whose kept ones are at the cumulative ``gaps``, ``q`` x ``scale``."""
        idx = np.cumsum(gaps, dtype=np.int64)
        if len(idx) and (idx[-1] >= n or (len(idx) > 1 and (gaps[1:] == 0).any())):
            raise CodecError("topk indices out of range or repeated")
        out = np.zeros(n, np.float32)
        out[idx] = q * np.float32(scale)
        return out

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        n = count(shape)
        if len(payload) < 9:
            raise CodecError("topk payload shorter than its 9-byte head")
        k = int(np.frombuffer(payload, "<u4", count=1)[0])
        scale = np.frombuffer(payload, "<f4", count=1, offset=4)[0]
        width = payload[8]
        if width not in (1, 2, 4) or k != self.keep(n):
            raise CodecError(f"topk: bad index width {width}, or k {k} is not ceil({self.arg:g} * {n})")
        expect(payload, 9 + k * width + k, "topk")
        gaps = np.frombuffer(payload, {1: "<u1", 2: "<u2", 4: "<u4"}[width], count=k, offset=9)
        q = np.frombuffer(payload, np.int8, count=k, offset=9 + k * width)
        return self._place(gaps, q, scale, n).reshape(shape)
