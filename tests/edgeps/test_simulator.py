"""The virtual-time driver: deterministic, faithful to the paces' semantics."""

from __future__ import annotations

import pytest

from edgeps.scenario import Scenario
from edgeps.simulator import Simulation, scenario_data

SMALL = Scenario(devices=6, slow_fraction=1 / 3, duration_s=4.0, hidden=(16,), sample_s=0.5)


@pytest.fixture(scope="module")
def data():
    return scenario_data(SMALL)


def test_same_seed_same_run(data) -> None:
    first = Simulation(SMALL, "acbsp", data).run()
    second = Simulation(SMALL, "acbsp", data).run()
    assert first.curve == second.curve
    wall = {"eval_s"}  # the server's real seconds spent evaluating: the one thing not simulated
    assert [m.model_dump(exclude=wall) for m in first.history] == [m.model_dump(exclude=wall) for m in second.history]
    assert (first.commits, first.bytes_up, first.idle_fraction) == (
        second.commits,
        second.bytes_up,
        second.idle_fraction,
    )


def test_another_seed_another_run() -> None:
    other = Scenario(**{**SMALL.model_dump(), "seed": 1})
    a = Simulation(SMALL, "bsp").run()
    b = Simulation(other, "bsp").run()
    assert a.curve != b.curve


def test_bsp_idles_and_acbsp_does_not(data) -> None:
    bsp = Simulation(SMALL, "bsp", data).run()
    acbsp = Simulation(SMALL, "acbsp", data).run()
    # 2 of 6 devices are 4x slower: under bsp the 4 fast ones wait about 3/4 of each round.
    assert bsp.idle_fraction > 0.3
    assert acbsp.idle_fraction < 0.05
    # Every bsp round folds in exactly one commit per device.
    last = bsp.history[-1]
    assert last.applied == 6 * last.version
    # acbsp rounds take several commits from the fast devices.
    assert acbsp.commits > bsp.commits


def test_every_pace_learns_and_respects_the_clock(data) -> None:
    for pace in ("bsp", "acbsp", "asp", "ssp:1"):
        result = Simulation(SMALL, pace, data).run()
        assert result.best_accuracy > 0.6, pace
        assert result.run_s == pytest.approx(SMALL.duration_s, abs=0.2), pace
        assert [t for t, _ in result.curve] == sorted(t for t, _ in result.curve)
        assert result.history[-1].rejected == {}, pace


def test_ssp_keeps_devices_within_the_bound(data) -> None:
    sim = Simulation(SMALL, "ssp:1", data)
    sim.run()
    clocks = [d.seq for d in sim.devices]
    # A device may be at most bound + 1 commits past the slowest (one commit in flight).
    assert max(clocks) - min(clocks) <= 2


def test_slow_devices_are_a_seeded_quarter() -> None:
    scenario = Scenario()
    assert len(scenario.slow_devices()) == 4
    assert scenario.slow_devices() == Scenario().slow_devices()
    profiles = scenario.profiles()
    assert sorted(p.slowdown for p in profiles) == [1.0] * 12 + [4.0] * 4


@pytest.mark.parametrize(
    ("pace", "codec", "frequency"),
    [("acbsp", "sign", "trend"), ("ssp:2", "topk:0.1", "adacomm"), ("bsp", "ternary", "fixed")],
)
def test_paces_codecs_and_policies_train_a_regression_unchanged(pace, codec, frequency) -> None:
    """The same machinery on a task whose loss is mse and whose metric (mae) is lower-is-better."""
    import numpy as np

    from learning.data import Dataset

    rng = np.random.default_rng(3)
    x = rng.random((1200, 5)).astype(np.float32)
    y = x @ np.array([2.0, -1.0, 0.5, 3.0, 0.0]) + np.abs(x[:, 0] - 0.5) + rng.normal(0, 0.05, 1200)
    y = y.astype(np.float32)
    holdout = Dataset(x[:200], y[:200])
    shards = [Dataset(x[200 + i * 200 : 400 + i * 200], y[200 + i * 200 : 400 + i * 200]) for i in range(5)]
    scenario = Scenario(
        devices=5,
        duration_s=10.0,
        hidden=(16,),
        sample_s=1.0,
        loss="mse",
        metrics="mae",
        codec=codec,
        frequency=frequency,
        lr=0.05,
        push_every=10,
        push_every_max=20,
    )
    result = Simulation(scenario, pace, (holdout, shards)).run()
    maes = [value for _, value in result.curve]
    assert result.history[-1].metric == "mae" and result.history[-1].accuracy is None
    assert maes[-1] < maes[0] / 4, maes  # the error falls: lower is better
    assert result.history[-1].rejected == {}
    assert result.history[-1].frequency == frequency and result.history[-1].values.keys() == {"mae"}
