from __future__ import annotations

import numpy as np
import pytest

from ps_service.aggregate import aggregate, staleness_weight
from ps_service.pace import Asp, Bsp, make_pace
from ps_service.update import Update


def upd(device: str, base: int = 0, samples: int = 10, value: float = 1.0) -> Update:
    return Update(
        device, seq=1, base_version=base, samples=samples, steps=1, delta={"w": np.full(2, value, np.float32)}
    )


def test_bsp_closes_exactly_when_every_active_device_committed() -> None:
    pace, active = Bsp(), frozenset({"a", "b", "c"})
    assert not pace.ready(active)
    pace.add(upd("a"))
    pace.add(upd("b"))
    assert not pace.ready(active)
    assert pace.waiting_for(active) == ["c"]
    pace.add(upd("c"))
    assert pace.ready(active)
    assert [u.device for u in pace.take()] == ["a", "b", "c"]
    assert not pace.ready(active) and pace.pending == 0


def test_bsp_does_not_wait_for_a_device_that_left() -> None:
    pace = Bsp()
    pace.add(upd("a"))
    assert not pace.ready(frozenset({"a", "b"}))
    assert pace.ready(frozenset({"a"}))  # b went offline


def test_bsp_with_nobody_committed_is_never_ready() -> None:
    assert not Bsp().ready(frozenset())


def test_asp_applies_one_update_at_a_time_in_arrival_order() -> None:
    pace = Asp()
    pace.add(upd("b"))
    pace.add(upd("a"))
    assert pace.ready(frozenset({"a", "b", "c"}))
    assert [u.device for u in pace.take()] == ["b"]
    assert [u.device for u in pace.take()] == ["a"]
    assert not pace.ready(frozenset({"a"}))


def test_make_pace() -> None:
    assert make_pace("bsp").wait_for_params and not make_pace("asp").wait_for_params
    with pytest.raises(ValueError, match="unknown pace"):
        make_pace("nope")


def test_aggregate_is_sample_weighted_mean() -> None:
    out = aggregate([upd("a", samples=30, value=1.0), upd("b", samples=10, value=5.0)], version=0)
    np.testing.assert_allclose(out["w"], [2.0, 2.0])


def test_stale_updates_count_less_but_never_zero() -> None:
    assert staleness_weight(0) == 1.0
    assert 0 < staleness_weight(10) < staleness_weight(1) < 1
    out = aggregate([upd("a", base=0, value=1.0)], version=3)
    np.testing.assert_allclose(out["w"], [0.5, 0.5])
