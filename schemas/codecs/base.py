"""The Codec interface and the registry every codec joins.

A codec is one class in one module of this package, decorated with ``@register``; the
package's ``__init__`` imports the module. ``make_codec`` (from a spec such as ``qsgd:16``)
and ``codec_from_header`` (from a frame header's id and argument) then know it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import TypeVar

import numpy as np


class CodecError(ValueError):
    """A payload that does not decode under its codec, or a codec spec that does not parse."""


class UnknownCodecId(CodecError):
    """A frame header names a codec id this side does not implement."""


class Codec(ABC):
    """Turns a float32 tensor into bytes and back.

    ``encode`` may be lossy (and, for stochastic codecs, random: pass ``rng``); ``decode``
    rejects a payload of the wrong length with CodecError and returns a new, writable float32
    array of ``shape``. A codec without a parameter has ``arg`` 0; one with a parameter
    overrides ``from_spec_arg``, ``from_header_arg``, ``spec`` and ``usage``.
    """

    id: int  # the frame header's codec id (docs/PROTOCOL.md)
    name: str
    arg: float = 0.0  # the frame header's float32 codec argument
    biased: bool = False  # meant to be used with error feedback (ErrorFeedback)
    usage: str = ""  # how its spec is written, when it is not just ``name``

    @property
    def spec(self) -> str:
        """The codec's name with its parameter, e.g. ``qsgd:16``; ``make_codec`` parses it."""
        return self.name

    @classmethod
    def from_spec_arg(cls, arg: str) -> Codec:
        """The codec for the text after ``name:`` in a spec ('' when there is none)."""
        if arg:
            raise CodecError(f"{cls.name} takes no argument")
        return cls()

    @classmethod
    def from_header_arg(cls, arg: float) -> Codec:
        """The codec for a frame header's argument; CodecError for one it does not take."""
        if arg != 0:
            raise CodecError(f"{cls.name} takes no argument: the header's codec argument must be 0.0, got {arg}")
        return cls()

    @abstractmethod
    def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        """Payload bytes for ``values`` (any shape, cast to float32)."""

    @abstractmethod
    def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        """The float32 array of ``shape`` that ``payload`` encodes."""

    def encode_compact(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
        """The payload of a compact commit (docs/PROTOCOL.md §4): the model's values in one flat
        vector. The same as ``encode`` unless the codec has a leaner form for it (top-k)."""
        return self.encode(values, rng)

    def decode_compact(self, payload: bytes | memoryview, n: int) -> np.ndarray:
        """The ``n`` flat float32 values that a compact commit's ``payload`` encodes."""
        return self.decode(payload, (n,))


_BY_NAME: dict[str, type[Codec]] = {}
_BY_ID: dict[int, type[Codec]] = {}
C = TypeVar("C", bound=type[Codec])


def register(cls: C) -> C:
    """Class decorator: make ``cls`` known by its name and its wire id (each unique)."""
    taken = _BY_NAME.get(cls.name) or _BY_ID.get(cls.id)
    if taken is not None and taken is not cls:
        raise ValueError(f"codec {cls.name!r} (id {cls.id}): name or id already registered by {taken.__name__}")
    _BY_NAME[cls.name] = cls
    _BY_ID[cls.id] = cls
    return cls


def known() -> tuple[str, ...]:
    """How each registered codec's spec is written, by wire id: ``fp32``, …, ``qsgd:S``."""
    return tuple(c.usage or c.name for _, c in sorted(_BY_ID.items()))


def make_codec(spec: str) -> Codec:
    """A codec from its spec: its name, then ``:`` and its parameter where it takes one (ASCII:
    Python would read ``qsgd:٣`` as ``qsgd:3``, and a spec must mean one thing to every peer)."""
    if not spec.isascii():
        raise CodecError(f"bad codec spec {spec!r}: ASCII letters, digits and punctuation only")
    name, _, arg = spec.partition(":")
    cls = _BY_NAME.get(name)
    if cls is None:
        raise CodecError(f"unknown codec {spec!r}; known: {', '.join(known())}")
    try:
        return cls.from_spec_arg(arg)
    except ValueError as exc:  # CodecError too
        raise CodecError(f"bad codec spec {spec!r}: {exc}") from None


def codec_from_header(codec_id: int, arg: float) -> Codec:
    """The codec a frame header names: UnknownCodecId for an id this side does not implement,
    CodecError for an argument the codec does not take."""
    cls = _BY_ID.get(codec_id)
    if cls is None:
        raise UnknownCodecId(f"unknown codec id {codec_id}")
    return cls.from_header_arg(arg)


def count(shape: tuple[int, ...]) -> int:
    """Values in a tensor of ``shape``."""
    return int(math.prod(shape))


def flat(values: np.ndarray) -> np.ndarray:
    """``values`` as a contiguous flat float32 array (no copy when it is one already)."""
    return np.ascontiguousarray(values, dtype=np.float32).reshape(-1)


def non_finite(what: str) -> CodecError:
    """The error of an encoder given NaN or Inf (int8, ternary, qsgd and topk refuse them)."""
    return CodecError(f"{what} cannot encode non-finite values")


def finite(payload: bytes | None, what: str) -> bytes:
    """A compiled encoder's payload: it returns None where it met a non-finite value."""
    if payload is None:
        raise non_finite(what)
    return payload


def expect(payload: bytes | memoryview, size: int, what: str) -> None:
    """CodecError unless ``payload`` has ``size`` bytes."""
    if len(payload) != size:
        raise CodecError(f"{what} payload has {len(payload)} bytes, expected {size}")
