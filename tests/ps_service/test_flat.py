"""The model as one flat vector: the commit path's passes over it, compiled and in numpy alike."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_service import flat
from ps_service.flat import add_finite, scaled, sum_squares

FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
VECTORS = st.lists(FLOAT32 | st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 3.4028235e38]), min_size=0, max_size=200)
FACTOR = st.floats(-4, 4, width=32) | st.sampled_from([1.0, 0.5, 1e-30])


COMPILED = flat.kernels
#: Each test runs on the compiled loops (schemas/_kernels.c) and on numpy.
path = pytest.mark.parametrize(
    "compiled", [pytest.param(True, marks=pytest.mark.skipif(COMPILED is None, reason="not built")), False]
)


@contextlib.contextmanager
def on(compiled: bool) -> Iterator[None]:
    flat.kernels = COMPILED if compiled else None
    try:
        yield
    finally:
        flat.kernels = COMPILED


@path
@settings(max_examples=300, deadline=None)
@given(values=st.lists(FLOAT32, min_size=0, max_size=40), large=st.integers(0, 5000))
def test_the_sum_of_squares_is_finite_exactly_when_every_value_is(compiled, values, large) -> None:
    """A commit is refused as ``non_finite`` on this sum: never for large finite values (thousands
    at float32's largest sum to about 1e81, far within a double), always for one NaN or Inf."""
    vector = np.concatenate([np.float32(values), np.full(large, np.finfo(np.float32).max, np.float32)])
    with on(compiled):
        total = sum_squares(vector)
    assert math.isfinite(total) == bool(np.isfinite(vector).all())
    if math.isfinite(total):
        reference = math.fsum(float(v) ** 2 for v in vector)
        assert math.isclose(total, reference, rel_tol=1e-12, abs_tol=1e-300)


def order(vector: np.ndarray) -> float:
    """The sum of squares in the documented order, one addition at a time in plain Python."""
    groups = len(vector) // 32
    partial = [0.0] * 32
    for g in range(groups):
        for k in range(32):
            partial[k] += float(vector[32 * g + k]) ** 2
    total = 0.0
    for value in partial if groups else []:
        total += value
    for value in vector[32 * groups :]:
        total += float(value) ** 2
    return total


@path
@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(-1e6, 1e6, width=32), min_size=0, max_size=300))
def test_the_sum_of_squares_adds_in_one_order_on_both_paths(compiled, values) -> None:
    """The same bits compiled or not: 32 partial sums, then the rest one by one."""
    vector = np.float32(values)
    with on(compiled):
        assert sum_squares(vector) == order(vector)


@path
@settings(max_examples=300, deadline=None)
@given(values=VECTORS, a=FACTOR, b=FACTOR, c=FACTOR)
def test_scaled_is_three_float32_products_and_a_zero_added(compiled, values, a, b, c) -> None:
    vector = np.float32(values)
    with np.errstate(all="ignore"):
        expected = ((vector * np.float32(a)) * np.float32(b)) * np.float32(c) + np.float32(0)
    with on(compiled):
        assert scaled(vector, a, b, c).tobytes() == expected.tobytes()


@path
@settings(max_examples=300, deadline=None)
@given(pairs=st.lists(st.tuples(FLOAT32, FLOAT32), min_size=0, max_size=100))
def test_add_finite_is_the_float32_sum_or_none_when_one_is_not_finite(compiled, pairs) -> None:
    x, y = np.float32([p[0] for p in pairs]), np.float32([p[1] for p in pairs])
    with np.errstate(all="ignore"):
        expected = x + y
    with on(compiled):
        out = add_finite(x, y)
    if np.isfinite(expected).all():
        assert out is not None and out.tobytes() == expected.tobytes()
    else:
        assert out is None
