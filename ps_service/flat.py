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

    def views(self, flat: np.ndarray) -> Params:
        """The tensors of ``flat`` (views: no copy)."""
        return {name: flat[a:b].reshape(self.shapes[name]) for name, a, b in self.bounds}

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
    finite in a double), so that it is also the check that every value is finite."""
    wide = values.astype(np.float64)
    return float(np.dot(wide, wide))


@functools.lru_cache(maxsize=8)
def _layout(shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> Layout:
    return Layout(dict(shapes))


def layout_of(params: Mapping[str, np.ndarray]) -> Layout:
    """The layout of a model's ``params``, kept for the few models a process sees."""
    return _layout(tuple((name, values.shape) for name, values in params.items()))


def layout_for(shapes: Mapping[str, tuple[int, ...]]) -> Layout:
    """The layout of a model of ``shapes``, kept as ``layout_of``'s."""
    return _layout(tuple((name, tuple(shape)) for name, shape in shapes.items()))
