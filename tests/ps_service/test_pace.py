from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ps_service.aggregate import aggregate, extrapolation, staleness_weight
from ps_service.paces import Asp, Bsp, make_pace
from ps_service.update import Update


def upd(device: str, base: int = 0, samples: int = 10, value: float = 1.0) -> Update:
    return Update(
        device, seq=1, base_version=base, samples=samples, steps=1, tensors={"w": np.full(2, value, np.float32)}
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
    assert make_pace("bsp").configure("d").wait_for_params and not make_pace("asp").configure("d").wait_for_params
    acbsp = make_pace("acbsp")
    assert acbsp.rounds and not acbsp.configure("d").wait_for_params and acbsp.configure("d").one_commit_per_version
    ssp = make_pace("ssp:3")
    assert ssp.configure("d").staleness_bound == 3 and ssp.name == "ssp:3" and not ssp.rounds
    for bad in ("nope", "ssp", "ssp:-1", "ssp:x", "bsp:2"):
        with pytest.raises(ValueError, match="unknown pace"):
            make_pace(bad)


def test_acbsp_round_closes_like_bsp_and_takes_several_commits_per_device() -> None:
    pace, barrier = make_pace("acbsp"), frozenset({"fast", "slow"})
    pace.add(upd("fast"))
    pace.add(upd("fast"))
    assert not pace.ready(barrier) and pace.waiting_for(barrier) == ["slow"]
    pace.add(upd("slow"))
    assert pace.ready(barrier) and len(pace.take()) == 3


def test_aggregate_with_equal_steps_is_fedavg_by_data_size() -> None:
    out = aggregate([upd("a", value=1.0), upd("b", value=5.0)], version=0, sizes={"a": 30, "b": 10}).delta
    np.testing.assert_allclose(out["w"], [2.0, 2.0])


def test_aggregate_normalises_devices_that_did_more_steps() -> None:
    # Equal data; "fast" made 4 commits of 1 step, "slow" 1 commit of 1 step, each step moving
    # its own way by 1.0 resp. -1.0. FedNova: the mean per-step directions cancel (no pull
    # towards the fast device), scaled by tau_eff = median(4, 1) = 2.5 steps.
    fast = [Update("fast", 1, 0, 10, 1, {"w": np.float32([1.0, 1.0])}) for _ in range(4)]
    slow = [Update("slow", 1, 0, 10, 1, {"w": np.float32([-1.0, 1.0])})]
    out = aggregate(fast + slow, version=0, sizes={"fast": 100, "slow": 100}).delta
    np.testing.assert_allclose(out["w"], [0.0, 2.5])


def test_aggregate_scales_by_mixing() -> None:
    out = aggregate([upd("a", value=2.0)], version=0, sizes={"a": 1}, mixing=0.5).delta
    np.testing.assert_allclose(out["w"], [1.0, 1.0])


def test_stale_updates_count_less_but_never_zero() -> None:
    assert staleness_weight(0) == staleness_weight(1) == 1.0  # one version behind is normal in a round
    assert 0 < staleness_weight(10) < staleness_weight(2) < 1
    out = aggregate([upd("a", base=0, value=1.0)], version=4, sizes={"a": 10}).delta
    np.testing.assert_allclose(out["w"], [0.5, 0.5])


def vec(*values: float) -> dict[str, np.ndarray]:
    return {"w": np.float32(values)}


def test_extrapolation_is_one_when_devices_agree() -> None:
    assert extrapolation({"a": vec(1, 2), "b": vec(1, 2)}, {"a": 0.5, "b": 0.5}, vec(1, 2)) == 1.0
    out = aggregate([upd("a", value=1.0), upd("b", value=1.0)], 0, {"a": 10, "b": 10}, max_extrapolation=3.0).delta
    np.testing.assert_allclose(out["w"], [1.0, 1.0])


def test_extrapolation_is_fedexp_step_when_devices_disagree() -> None:
    # D_a = (5, 1), D_b = (-3, 1), equal shares: mean (1, 1), |D_i|^2 = 26 and 10, so FedExP's step
    # is (0.5 * 26 + 0.5 * 10) / (2 * 2) = 4.5; the server goes halfway from 1: 2.75.
    contributions, share = {"a": vec(5, 1), "b": vec(-3, 1)}, {"a": 0.5, "b": 0.5}
    assert extrapolation(contributions, share, vec(1, 1)) == pytest.approx(4.5)
    updates = [Update("a", 1, 0, 10, 1, vec(5, 1)), Update("b", 1, 0, 10, 1, vec(-3, 1))]
    result = aggregate(updates, 0, {"a": 10, "b": 10}, max_extrapolation=3.0)
    np.testing.assert_allclose(result.delta["w"], [2.75, 2.75])
    assert result.step == pytest.approx(2.75)
    np.testing.assert_allclose(aggregate(updates, 0, {"a": 10, "b": 10}, max_extrapolation=1.2).delta["w"], [1.2, 1.2])
    np.testing.assert_allclose(aggregate(updates, 0, {"a": 10, "b": 10}).delta["w"], [1.0, 1.0])  # off by default


def test_a_biased_codecs_step_is_read_through_the_norm_it_keeps() -> None:
    # The example above with norms that a codec keeping 0.6 of the squared norm delivered: FedExP's
    # step 4.5 / 0.6 = 7.5, halfway 4.25, capped at 3; devices that agree stay at 1 whatever kept is.
    contributions, share = {"a": vec(5, 1), "b": vec(-3, 1)}, {"a": 0.5, "b": 0.5}
    assert extrapolation(contributions, share, vec(1, 1), kept=0.6) == pytest.approx(7.5)
    assert extrapolation({"a": vec(1, 2), "b": vec(1, 2)}, share, vec(1, 2), kept=0.6) == 1.0  # 0.5 / 0.6 < 1
    updates = [Update("a", 1, 0, 10, 1, vec(5, 1)), Update("b", 1, 0, 10, 1, vec(-3, 1))]
    assert aggregate(updates, 0, {"a": 10, "b": 10}, max_extrapolation=5.0, kept=0.6).step == pytest.approx(4.25)


def test_norm_kept_is_a_biased_codecs_energy_and_one_otherwise() -> None:
    from ps_service.aggregate import norm_kept
    from schemas.codecs import typical_energy

    assert norm_kept("sign") == pytest.approx(2 / np.pi, abs=0.02)  # mean |x| of normal values: sqrt(2/pi)
    assert 0.05 < norm_kept("topk:0.01") < 0.12  # the top 1% of normal values hold about 8% of the energy
    assert norm_kept("fp32") == 1.0 and norm_kept("ternary") == 1.0 and norm_kept("qsgd:16") == 1.0
    assert norm_kept("fp16") == pytest.approx(1.0, abs=1e-4) and norm_kept("int8") == pytest.approx(1.0, abs=1e-2)
    assert typical_energy("ternary") > 2  # an unbiased codec's noise adds to the norm


def test_extrapolation_of_a_zero_mean_is_one() -> None:
    assert extrapolation({"a": vec(1, 1), "b": vec(-1, -1)}, {"a": 0.5, "b": 0.5}, vec(0, 0)) == 1.0


@settings(max_examples=200, deadline=None)
@given(
    deltas=st.lists(arrays(np.float32, 3, elements=st.floats(-10, 10, width=32)), min_size=1, max_size=6),
    cap=st.floats(1.0, 5.0),
)
def test_extrapolation_keeps_the_direction_and_stays_within_its_bounds(deltas: list[np.ndarray], cap: float) -> None:
    updates = [Update(f"d{i}", 1, 0, 10, 1, {"w": d}) for i, d in enumerate(deltas)]
    sizes = {u.device: 10 for u in updates}
    plain = aggregate(updates, 0, sizes).delta["w"]
    stepped = aggregate(updates, 0, sizes, max_extrapolation=cap).delta["w"]
    assert np.all(np.isfinite(stepped))
    length = float(np.linalg.norm(plain))
    if length < 1e-3:
        return
    ratio = float(np.dot(stepped, plain)) / length**2  # stepped = ratio * plain
    np.testing.assert_allclose(stepped, ratio * plain, atol=1e-4 * (1 + float(np.abs(stepped).max())))
    assert 1.0 - 1e-5 <= ratio <= cap + 1e-5


def test_only_acbsp_extrapolates_and_only_after_its_warm_up() -> None:
    acbsp = make_pace("acbsp")
    assert acbsp.max_extrapolation > 1 and acbsp.extrapolation_warmup > 0
    for name in ("bsp", "asp", "ssp:2"):
        assert make_pace(name).max_extrapolation == 1.0


def test_fedexp_trusts_codecs_whose_noise_does_not_swamp_norms() -> None:
    from ps_service.aggregate import norms_hold
    from schemas.codecs import typical_error

    assert typical_error("fp32") == 0.0 and typical_error("int8") < 0.01
    assert typical_error("ternary") > 1.0  # an unbiased codec noisier than the signal
    assert [c for c in ("fp32", "fp16", "int8", "sign", "topk:0.01", "qsgd:16") if not norms_hold(c)] == []
    assert not norms_hold("ternary") and not norms_hold("qsgd:2")


def test_a_new_pace_is_one_registered_class() -> None:
    """The example of docs/PACES.md: a pace that makes a version once half the barrier set committed."""
    from ps_service.paces import Pace, known, register
    from ps_service.paces import base as registry

    @register
    class Quorum(Pace):
        name = "half"
        rounds = False

        def ready(self, barrier: frozenset[str]) -> bool:
            return len(self.committed()) * 2 >= max(1, len(barrier))

    try:
        pace = make_pace("half")
        assert "half" in known() and isinstance(pace, Quorum)
        pace.add(upd("a"))
        assert not pace.ready(frozenset({"a", "b", "c"})) and pace.ready(frozenset({"a", "b"}))
        with pytest.raises(ValueError, match="already registered"):
            register(type("Other", (Quorum,), {"name": "bsp"}))
    finally:
        del registry._PACES["half"]
