"""The model as one flat float32 vector, its tensors in the model's order: the commit path adds,
scales and checks a commit with a handful of numpy calls instead of a few per tensor.

An elementwise operation gives the same bits on the vector as tensor by tensor; a reduction (a
norm) is summed tensor by tensor over slices of the vector, as it was over the tensors, so that
its bits do not change either."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import numpy as np

from learning.model import Params
from schemas.codecs import bits
from schemas.codecs.bits import kernels


class Layout:
    """Where each tensor of a model lies in its flat vector (names and shapes in the model's order)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.shapes = dict(shapes)
        self.bounds: list[tuple[str, int, int]] = []
        start = 0
        for name, shape in self.shapes.items():
            self.bounds.append((name, start, start + math.prod(shape)))
            start += math.prod(shape)
        self.size = start
        self._slices = [(name, slice(a, b), self.shapes[name]) for name, a, b in self.bounds]

    def views(self, flat: np.ndarray) -> Params:
        """The tensors of ``flat`` (views: no copy)."""
        return {name: flat[where].reshape(shape) for name, where, shape in self._slices}

    def flatten(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        """``params`` (the model's names and shapes) as a new float32 vector."""
        if not self.bounds:
            return np.zeros(0, np.float32)
        return np.concatenate([np.asarray(params[name], np.float32).reshape(-1) for name, _, _ in self.bounds])

    def squares(self, flat: np.ndarray) -> float:
        """The sum of ``flat``'s squares, tensor by tensor (each tensor's in ``flat``'s precision)."""
        return float(sum(float(np.vdot(flat[a:b], flat[a:b])) for _, a, b in self.bounds))

    def name_of(self, index: int) -> str:
        """The tensor that holds value ``index`` of the vector."""
        return next(name for name, a, b in self.bounds if a <= index < b)


def sum_squares(values: np.ndarray) -> float:
    """The sum of float32 ``values``' squares in double precision, in one pass: NaN or Inf exactly
    when a value is (a float32's square, 3.4e38² at most, and a sum of fewer than 2^53 of them stay
    finite in a double), so that it is also the check that every value is finite. Summed as
    ``schemas.codecs.bits.sum_squares`` sums (32 partial sums), compiled or in numpy alike."""
    if kernels is not None:
        return float(kernels.squares(values))
    return float(bits.sum_squares(values[None, :])[0])


def scaled(values: np.ndarray, a: float, b: float, c: float) -> np.ndarray:
    """A new vector ``((values * a) * b) * c + 0``, each step in float32 (the + 0 turns -0 into 0)."""
    out = np.empty_like(values)
    if kernels is not None:
        kernels.scaled(values, a, b, c, out)
        return out
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):  # Inf as the compiled loop makes it, silently
        np.multiply(values, np.float32(a), out=out)
        out *= np.float32(b)
        out *= np.float32(c)
        out += np.float32(0)
    return out


def add_finite(x: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    """A new vector ``x + y`` in float32, or None when a sum is NaN or Inf."""
    out = np.empty_like(x)
    if kernels is not None:
        return out if kernels.add_finite(x, y, out) else None
    with np.errstate(over="ignore", invalid="ignore"):
        np.add(x, y, out=out)
    return out if np.isfinite(out).all() else None


@functools.lru_cache(maxsize=8)
def _layout(shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> Layout:
    return Layout(dict(shapes))


def layout_of(params: Mapping[str, np.ndarray]) -> Layout:
    """The layout of a model's ``params``, kept for the few models a process sees."""
    return _layout(tuple((name, values.shape) for name, values in params.items()))


def layout_for(shapes: Mapping[str, tuple[int, ...]]) -> Layout:
    """The layout of a model of ``shapes``, kept as ``layout_of``'s."""
    return _layout(tuple((name, tuple(shape)) for name, shape in shapes.items()))
