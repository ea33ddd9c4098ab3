"""Bit packing and per-bucket scaling shared by the quantizing codecs.

``kernels`` is the optional compiled module ``schemas._kernels`` (None without it, or on a
big-endian machine): the codecs' hot loops run there when present, giving the same floats
as the numpy code beside them.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import numpy as np

kernels: ModuleType | None
try:  # compiled loops for the hot codecs (schemas/_kernels.c)
    kernels = importlib.import_module("schemas._kernels")
except ImportError:  # built without a C compiler
    kernels = None
if sys.byteorder != "little":  # the loops read the little-endian wire format as native numbers
    kernels = None

BUCKET = 512  # values per scale in int8, sign, ternary and qsgd


def compiled() -> bool:
    """Whether the compiled loops of ``schemas._kernels`` are in use (else numpy's)."""
    return kernels is not None


def buckets(n: int) -> int:
    """Buckets (scales) for ``n`` values."""
    return -(-n // BUCKET)


def bucket_reduce(x: np.ndarray, how: str) -> np.ndarray:
    """Per-bucket max of |x| (``max``), mean of |x| (``mean``) or L2 norm (``l2``), as float32."""
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
            parts.append(np.sqrt(sum_squares(block)))
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


def sum_squares(block: np.ndarray) -> np.ndarray:
    """Each row's sum of squares in double, in the compiled loop's order (so the float32 norms agree to the bit):
    32 partial sums, partial k taking values k mod 32 of each whole group of 32 in turn; then the partials added
    in order from 0; then the values past the last whole group, one by one."""
    wide = block.astype(np.float64)
    wide *= wide
    groups = wide.shape[1] // 32
    total = np.zeros(wide.shape[0])
    if groups:
        grouped = wide[:, : 32 * groups].reshape(wide.shape[0], groups, 32)
        partial = np.add.reduce(grouped, axis=1)  # along a strided axis: group after group, in turn
        for k in range(32):
            total += partial[:, k]
    for i in range(32 * groups, wide.shape[1]):
        total += wide[:, i]
    return total


def inverse(scales: np.ndarray, numerator: float = 1.0) -> np.ndarray:
    """numerator / scales, and 0 where a scale is too small to invert (its values quantize to 0)."""
    out = np.zeros_like(scales)
    np.divide(np.float32(numerator), scales, out=out, where=scales > np.float32(1e-30))
    return out


def scale_buckets(values: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
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


def stream_key(rng: np.random.Generator) -> tuple[int, int]:
    """The key of a stochastic encoder's random stream: two 32-bit words drawn from ``rng``."""
    s0, s1 = rng.integers(0, 2**32, size=2, dtype=np.uint64)
    return int(s0), int(s1)


def _mix32(h: np.ndarray) -> np.ndarray:
    """The lowbias32 integer hash, in place on uint32 (multiplication wraps)."""
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x7FEB352D)
    h ^= h >> np.uint32(15)
    h *= np.uint32(0x846CA68B)
    h ^= h >> np.uint32(16)
    return h


def uniforms(key: tuple[int, int], n: int) -> np.ndarray:
    """Values 0..n-1 of the counter-based stream ``key``: float32 in [0, 1) with 24 random bits,
    value i = ((mix(i + s0) ^ s1) >> 8) / 2**24, mix being the lowbias32 hash. The compiled
    encoders draw the same numbers."""
    h = np.arange(n, dtype=np.uint32)
    h += np.uint32(key[0])
    h = _mix32(h)
    h ^= np.uint32(key[1])
    h >>= np.uint32(8)
    return h.astype(np.float32) * np.float32(2.0**-24)


def bit_plane(payload: bytes | memoryview, offset: int, n: int) -> np.ndarray:
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
    packed: bytes = np.bitwise_or.reduce(padded.reshape(-1, per) << shifts, axis=1).astype(np.uint8).tobytes()
    return packed


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
    """Bytes that ``n`` codes of ``bits`` bits take."""
    return -(-n * bits // 8)


def leb128(values: np.ndarray) -> bytes:
    """``values`` (unsigned, below 2^32) as LEB128 varints: 7 bits a byte, low bits first, the
    high bit set on every byte but a value's last."""
    v = np.asarray(values, np.uint64)
    sizes = np.ones(len(v), np.int64)
    for shift in (7, 14, 21, 28):
        sizes += v >= (1 << shift)
    out = np.empty(int(sizes.sum()), np.uint8)
    starts = np.cumsum(sizes) - sizes
    for j in range(5):
        has = sizes > j
        more = (sizes[has] > j + 1).astype(np.uint8) << 7
        out[starts[has] + j] = ((v[has] >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8) | more
    return out.tobytes()


def unleb128(data: bytes | memoryview, count: int) -> np.ndarray:
    """Exactly ``count`` LEB128 varints filling ``data``, each at most 5 bytes and below 2^32, as
    uint32; ValueError otherwise."""
    b = np.frombuffer(data, np.uint8)
    ends = np.flatnonzero(b < 0x80)  # a value's last byte
    if len(ends) != count or (count and ends[-1] != len(b) - 1) or (not count and len(b)):
        raise ValueError(f"{len(b)} bytes do not hold exactly {count} varints")
    if not count:
        return np.zeros(0, np.uint32)
    sizes = np.diff(ends, prepend=-1)
    if sizes.max() > 5:
        raise ValueError("a varint longer than 5 bytes")
    starts = ends - sizes + 1
    position = np.arange(len(b)) - np.repeat(starts, sizes)  # each byte's place in its varint
    parts = (b & 0x7F).astype(np.uint64) << (7 * position).astype(np.uint64)
    values = np.add.reduceat(parts, starts)
    if values.max() >= 1 << 32:
        raise ValueError("a varint beyond 2^32 - 1")
    return values.astype(np.uint32)
