"""The fleet's bounds (ps_service.robust): norm-bounded FedAvg against the fleet's history, the
steps a device may claim, and what is still refused. Unit and property tests of the pure logic;
whole jobs under attack: tests/ps_service/test_hostile.py and tests/integration/test_hostile.py."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_service.robust import FleetBounds, Limits, Seen, per_device
from ps_service.update import Update
from tests.helpers import commit_bytes, hello, small_server


def updates(norms: dict[str, float], steps: int = 2, base: int = 0) -> list[Update]:
    """One commit a device, based on ``base``, whose per-step update has the given norm (every value equal)."""
    size = 4
    return [
        Update(d, 1, base, 10, steps, {"w": np.full(size, n * steps / math.sqrt(size), np.float32)})
        for d, n in norms.items()
    ]


def test_a_device_far_above_the_fleet_is_clipped_to_twice_its_median_not_refused() -> None:
    bounds = FleetBounds()
    current = per_device(updates({"a": 1.0, "b": 1.2, "c": 9.0}), 0)
    limits = bounds.limits(0, 100.0, current)
    assert math.isclose(limits.norm, 2.0 * 1.2, rel_tol=1e-6)  # twice the lower median of this aggregate's norms
    verdict = limits.judge(*current["c"])
    assert not verdict.refused and math.isclose(verdict.scale * current["c"][0], limits.norm, rel_tol=1e-9)
    assert limits.judge(*current["a"]).scale == 1.0


def test_an_honest_device_back_after_an_absence_is_taken_clipped() -> None:
    """The audit: an honest device back after 90 s had 426 of 426 commits refused as outlier (its
    norm ~9x the other's, and the bound was 8x the smaller of two)."""
    bounds = FleetBounds()
    for version in range(60):  # the other device alone for 60 versions: the returning one is forgotten
        bounds.remember("steady", 0.1, 10, version)
    bounds.remember("back", 0.9, 10, 0)
    current = per_device(updates({"back": 0.9, "steady": 0.1}, base=60), 60)
    limits = bounds.limits(60, 50.0, current)
    verdict = limits.judge(*current["back"])
    assert not verdict.refused and verdict.scale < 1  # taken, at the bound: twice the other's
    assert math.isclose(verdict.scale * current["back"][0], limits.norm, rel_tol=1e-9)
    assert math.isclose(limits.norm, 0.2, rel_tol=1e-6)


@settings(max_examples=200, deadline=None)
@given(honest=st.lists(st.floats(0.01, 10), min_size=2, max_size=9), rounds=st.integers(1, 30))
def test_a_device_at_the_bound_every_round_never_raises_the_bound(honest: list[float], rounds: int) -> None:
    """A hostile device sends as much as it may every round: recorded after clipping, it cannot
    raise the bound past twice what the honest devices send, however long it goes on."""
    bounds = FleetBounds()
    fleet = {f"h{i}": n for i, n in enumerate(honest)}
    for version in range(rounds):
        current = {d: (n, 10.0) for d, n in fleet.items()} | {"x": (1e30, 10.0)}
        limits = bounds.limits(version, 1.0, current)
        assert limits.norm <= 2.0 * max(honest) * (1 + 1e-12)
        for device, (norm, steps) in current.items():
            verdict = limits.judge(norm, steps)
            if not verdict.refused:
                bounds.remember(device, norm * verdict.scale, verdict.steps, version)
    assert bounds.limits(rounds, 1.0).norm <= 2.0 * max(honest) * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(
    taken=st.lists(
        st.tuples(st.integers(0, 30), st.floats(0.0, 10.0), st.sampled_from([0.0, 1.0, 5.0, 10.0]), st.integers(0, 3)),
        min_size=1,
        max_size=80,
    ),
    memory=st.integers(1, 8),
)
def test_forgetting_what_is_too_old_leaves_every_bound_as_it_was(
    taken: list[tuple[int, float, float, int]], memory: int
) -> None:
    """``recent`` forgets entries older than ``memory`` versions (so that limits costs O(recent
    devices), not O(fleet)); the limits are those of a record that never forgets, at every version."""
    bounds, record = FleetBounds(memory=memory), OrderedDict[str, Seen]()
    version = 0
    for device, norm, steps, gap in taken:
        version += gap  # versions only grow, some steps several versions at once
        bounds.remember(f"d{device}", norm, steps, version)
        record[f"d{device}"] = Seen(norm, steps, version)  # no pruning: the record as it was
        record.move_to_end(f"d{device}")
        everything = FleetBounds(memory=memory, recent=record.copy())  # its norms and steps ranked afresh
        for current in (None, {f"d{device}": (1.0, 4.0)}, {"new": (2.0, 3.0), f"d{device}": (0.5, 4.0)}):
            for at in (version, version + 1):
                limits = bounds.limits(at, 3.0, current, 40.0)
                assert limits == everything.limits(at, 3.0, current, 40.0)
                latest = {d: (s.norm, s.steps) for d, s in record.items() if at - s.version <= memory}
                plain = bounds._limits(FleetBounds._reference(latest, current or {}), 3.0, current or {}, 40.0)
                assert limits == plain  # the ranked lists kept by remember give what sorting the record gives
        assert all(version - seen.version <= memory for seen in bounds.recent.values())


def test_claimed_steps_count_at_most_twice_the_fleets_median() -> None:
    """The audit: two site entries claiming 2^32 - 1 steps (zero sums) stretched the aggregate's step
    length (the median of the steps) and amplified the honest updates: 0.9025 -> 0.1003 in a round."""
    bounds = FleetBounds()
    for version in range(3):
        for device in "abc":
            bounds.remember(device, 1.0, 10, version)
    limits = bounds.limits(3, 1.0, {"x": (1.0, 2**32 - 1), "y": (1.0, 2**32 - 1), "a": (1.0, 10)})
    assert limits.judge(1.0, 2**32 - 1).steps == 20


def test_a_commit_of_zeros_is_refused_and_infinity_too() -> None:
    limits = FleetBounds().limits(0, 1.0, {"a": (1.0, 10), "b": (1.2, 10), "z": (0.0, 10)})
    assert limits.judge(0.0, 10).refused and not limits.judge(1.0, 10).refused
    assert Limits(norm=1.0).judge(math.inf, 10).refused and Limits(norm=1.0).judge(math.nan, 10).refused


def test_alone_a_device_is_held_to_its_own_last_update_or_to_half_the_model() -> None:
    bounds = FleetBounds()
    # nothing yet: its whole update (10 steps) within half the model's norm, and its steps within the ceiling
    assert bounds.limits(0, 8.0, {"a": (100.0, 10)}).norm == 0.4
    assert bounds.limits(0, 8.0, {"a": (100.0, 2**32 - 1)}, steps_ceiling=80).norm == 0.05
    assert bounds.limits(0, lambda: 8.0, {"a": (100.0, 10)}).norm == 0.4  # the norm asked for where needed
    bounds.remember("a", 0.5, 10, 0)
    assert bounds.limits(1, 8.0, {"a": (100.0, 10)}).norm == 1.0  # twice its own last one

    def unasked() -> float:
        raise AssertionError("the model's norm taken though the device's last update sets the bound")

    assert bounds.limits(1, unasked, {"a": (100.0, 10)}).norm == 1.0


def test_checkpoints_before_1_6_load_without_steps() -> None:
    bounds = FleetBounds()
    bounds.load_state({"recent": {"a": [0.5, 3]}})
    assert bounds.recent["a"].norm == 0.5 and bounds.recent["a"].steps == 0 and bounds.recent["a"].version == 3
    again = FleetBounds()
    bounds.remember("b", 1.0, 10, 4)
    again.load_state(bounds.to_state())
    assert again.recent == bounds.recent


def test_a_huge_commit_moves_the_model_by_at_most_its_share_of_the_bound() -> None:
    """One of three devices sends 1e30 (1.0: the model went to chance): it is clipped to twice the
    median per-step norm, so the version moves by at most its share of that."""
    server = small_server(pace="bsp", rounds=10**6)
    server.start(0.0)
    for device in "abx":
        hello(server, device)
    before = server.store.params()
    server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1, scale=0.01), 1.0)
    server.on_message(server.topics.grad("b"), commit_bytes(server, "b", 1, scale=0.012), 1.0)
    server.on_message(server.topics.grad("x"), commit_bytes(server, "x", 1, scale=1e30), 1.0)
    assert server.store.version == 1 and not server.traffic.rejected
    moved = max(float(np.abs(server.store.params()[n] - v).max()) for n, v in before.items())
    # per value: the honest mean (0.011) plus x's share (1/3) of the bound (2 x 0.012 per value)
    assert moved <= (0.01 + 0.012) / 3 + 2 * 0.012 / 3 + 1e-6
