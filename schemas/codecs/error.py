"""How much a codec gets wrong: one round trip's relative error, and the share of the norm it keeps."""

from __future__ import annotations

import functools

import numpy as np

from schemas.codecs.base import Codec, make_codec


def relative_error(codec: Codec, values: np.ndarray, rng: np.random.Generator | None = None) -> float:
    """``|decode(encode(x)) - x| / |x|``: how much of a tensor one round trip through ``codec`` gets wrong."""
    values = np.asarray(values, np.float32)
    decoded = round_trip(codec, values, rng)
    return float(np.linalg.norm(decoded - values) / np.linalg.norm(values))


def round_trip(codec: Codec, values: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
    """``decode(encode(values))`` under ``codec``."""
    return codec.decode(codec.encode(values, rng), values.shape)


@functools.cache
def typical_error(spec: str) -> float:
    """``relative_error`` of the codec ``spec`` on 4096 standard normal values, seeded: a codec's
    noise level, the same on every run."""
    values, rng = _normal_values()
    return relative_error(make_codec(spec), values, rng)


@functools.cache
def typical_energy(spec: str) -> float:
    """``|decode(encode(x))|^2 / |x|^2`` of the codec ``spec`` on the same 4096 values: the share of
    a tensor's squared norm one round trip keeps. A biased codec keeps less (sign about 2/pi, top-k
    its largest values' share), an unbiased one more (its noise adds)."""
    values, rng = _normal_values()
    decoded = round_trip(make_codec(spec), values, rng)
    return float(np.vdot(decoded, decoded) / np.vdot(values, values))


def _normal_values() -> tuple[np.ndarray, np.random.Generator]:
    """4096 standard normal values and the generator after them, seeded: the same on every run."""
    rng = np.random.default_rng(0)
    return rng.standard_normal(4096).astype(np.float32), rng
