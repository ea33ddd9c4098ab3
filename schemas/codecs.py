"""Codecs: how one tensor's values become the payload bytes of a frame.

Only ``fp32`` exists so far; the frame carries a codec id and a float argument so that
quantizing codecs plug in without a format change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class CodecError(ValueError):
    """A payload that does not decode under its codec."""


class Codec(ABC):
    """Turns a float32 tensor into bytes and back.

    ``encode`` may be lossy; ``decode`` must reject a payload of the wrong length with
    CodecError and must return a new, writable float32 array of ``shape``.
    """

    id: int
    name: str
    arg: float = 0.0

    @abstractmethod
    def encode(self, values: np.ndarray) -> bytes:
        """Payload bytes for ``values`` (any shape, cast to float32)."""

    @abstractmethod
    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        """The float32 array of ``shape`` that ``payload`` encodes."""


class Fp32(Codec):
    """Raw IEEE-754 float32, little-endian, C order. Lossless."""

    id = 0
    name = "fp32"

    def encode(self, values: np.ndarray) -> bytes:
        return np.ascontiguousarray(values, dtype="<f4").tobytes()

    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        if len(payload) != 4 * count:
            raise CodecError(f"fp32 payload has {len(payload)} bytes, shape {shape} needs {4 * count}")
        return np.frombuffer(payload, dtype="<f4").astype(np.float32).reshape(shape)


_BY_ID: dict[int, Codec] = {c.id: c for c in (Fp32(),)}
_BY_NAME: dict[str, Codec] = {c.name: c for c in _BY_ID.values()}


def codec_by_id(codec_id: int) -> Codec:
    """The codec registered under a frame's codec id; CodecError if there is none."""
    try:
        return _BY_ID[codec_id]
    except KeyError:
        raise CodecError(f"unknown codec id {codec_id}") from None


def codec_by_name(name: str) -> Codec:
    """The codec registered under ``name`` (e.g. ``fp32``); CodecError if there is none."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}; known: {sorted(_BY_NAME)}") from None
