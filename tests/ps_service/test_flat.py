"""The model as one flat vector: the sum of squares that is also the finiteness check."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_service.flat import sum_squares

FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(FLOAT32, min_size=0, max_size=40), large=st.integers(0, 5000))
def test_the_sum_of_squares_is_finite_exactly_when_every_value_is(values, large) -> None:
    """A commit is refused as ``non_finite`` on this sum: never for large finite values (thousands
    at float32's largest sum to about 1e81, far within a double), always for one NaN or Inf."""
    flat = np.concatenate([np.float32(values), np.full(large, np.finfo(np.float32).max, np.float32)])
    total = sum_squares(flat)
    assert math.isfinite(total) == bool(np.isfinite(flat).all())
    if math.isfinite(total):
        reference = math.fsum(float(v) ** 2 for v in flat)
        assert math.isclose(total, reference, rel_tol=1e-12, abs_tol=1e-300)
