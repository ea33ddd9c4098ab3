"""The push_every controller: policies, hysteresis, bounds, per-device balancing, operator levers."""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_service.balance import ReleaseBalancer, StepsBalancer
from ps_service.frequency import AdaComm, Bounds, Fixed, FrequencyController, Trend, make_policy

BOUNDS = Bounds(1, 160)


def feed(policy, accuracies, start=0.0, dt=1.0):
    """Observe ``accuracies`` one second apart; the value read after each."""
    values = []
    for i, accuracy in enumerate(accuracies):
        policy.observe(start + i * dt, accuracy, 1.0 - accuracy, BOUNDS)
        values.append(policy.value(BOUNDS))
    return values


def test_bounds_clip_and_refuse_nonsense() -> None:
    assert Bounds(2, 8).clip(1) == 2 and Bounds(2, 8).clip(100) == 8 and Bounds(2, 8).clip(4.4) == 4
    with pytest.raises(ValueError):
        Bounds(5, 4)
    with pytest.raises(ValueError):
        Bounds(0, 4)


def test_fixed_never_moves() -> None:
    assert set(feed(Fixed(10), [0.1, 0.5, 0.9, 0.9, 0.9])) == {10}


def test_adacomm_starts_at_the_top_and_shrinks_with_the_square_root_of_the_loss() -> None:
    policy = AdaComm()
    assert policy.value(BOUNDS) == 160
    policy.observe(0, 0.1, 2.0, BOUNDS)
    policy.observe(1, 0.8, 0.5, BOUNDS)  # loss / loss_0 = 1/4: sqrt = 1/2
    assert policy.value(BOUNDS) == 80
    policy.observe(2, 0.99, 0.0, BOUNDS)
    assert policy.value(BOUNDS) == 1  # the lower bound, not 0


def test_trend_holds_the_top_while_accuracy_climbs_then_halves_on_a_plateau() -> None:
    policy = Trend(window=3, steep=0.3, flat=0.1)
    rising = feed(policy, [0.1, 0.4, 0.6, 0.75])
    assert rising == [160] * 4  # steep: it would double, but the bound holds it
    flat = feed(policy, [0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9], start=10)
    assert flat[0] == 160  # the window still holds the climb
    assert 80 in flat and flat[-1] < 80 and min(flat) >= 1


def test_trend_does_not_move_inside_its_dead_band() -> None:
    """Gains between flat and steep change nothing, however long they last."""
    policy = Trend(window=3, steep=0.3, flat=0.1, start=20)
    accuracy, values = 0.5, []
    for i in range(30):
        accuracy += 0.2 * (1 - accuracy) / 2  # closes about 20% of the error per two evaluations
        policy.observe(float(i), accuracy, 0.0, BOUNDS)
        values.append(policy.value(BOUNDS))
    assert set(values) == {20}


def test_trend_waits_for_a_fresh_window_after_each_move() -> None:
    policy = Trend(window=3, steep=0.3, flat=0.1, start=64)
    values = feed(policy, [0.95] * 12)
    moves = [i for i in range(1, len(values)) if values[i] != values[i - 1]]
    assert values[0] == 64 and moves  # it moves on a plateau ...
    assert all(b - a >= 2 for a, b in itertools.pairwise(moves))  # ... but not on every evaluation


@settings(max_examples=200, deadline=None)
@given(
    accuracies=st.lists(st.floats(0, 1), min_size=1, max_size=60),
    low=st.integers(1, 10),
    span=st.integers(0, 200),
)
def test_trend_stays_within_bounds_and_moves_by_at_most_a_factor_of_two(accuracies, low, span) -> None:
    bounds = Bounds(low, low + span)
    policy = Trend()
    previous = None
    for i, accuracy in enumerate(accuracies):
        policy.observe(float(i), accuracy, 0.0, bounds)
        value = policy.value(bounds)
        assert bounds.low <= value <= bounds.high
        if previous is not None:
            assert value * 2 >= previous and value <= previous * 2 + 1
        previous = value


def test_balancer_steps_mode_scales_slow_devices_and_keeps_the_fastest_at_base() -> None:
    balancer = StepsBalancer()
    balancer.on_report("fast", 0.01)
    balancer.on_report("slow", 0.04)
    assigned = balancer.assign(["fast", "slow", "new"], 40, BOUNDS)
    assert assigned == {"fast": 40, "slow": 10, "new": 40}  # unmeasured: treated as fast
    balancer.on_report("slow", 0.045)  # a small drift does not rewrite its control message
    assert balancer.assign(["fast", "slow"], 40, BOUNDS)["slow"] == 10
    balancer.on_report("slow", 0.08)
    assert balancer.assign(["fast", "slow"], 40, BOUNDS)["slow"] == 5


def test_balancer_measures_rates_from_commits_when_devices_do_not_report() -> None:
    balancer = StepsBalancer()
    for device, seconds in (("a", 1.0), ("b", 4.0)):
        balancer.on_ready(device, 0.0)
        balancer.on_commit(device, 20, seconds)
    assert balancer.rate("a") == pytest.approx(20.0) and balancer.rate("b") == pytest.approx(5.0)
    assert balancer.assign(["a", "b"], 20, BOUNDS) == {"a": 20, "b": 5}


def test_balancer_release_mode_lets_only_the_much_slower_devices_go() -> None:
    balancer = ReleaseBalancer()
    for device, step_s in (("a", 0.01), ("b", 0.012), ("c", 0.011), ("slow", 0.04)):
        balancer.on_report(device, step_s)
    push_every = dict.fromkeys(["a", "b", "c", "slow", "unknown"], 10)
    assert balancer.released(push_every) == {"slow"}
    assert balancer.assign(list(push_every), 10, BOUNDS) == push_every  # nobody's push_every changes
    assert StepsBalancer().released(push_every) == set()


def test_controller_operator_levers() -> None:
    controller = FrequencyController(Trend(window=3), Bounds(1, 160), "off")
    assert controller.assign(["a"]) == {"a": 160}
    controller.freeze()
    for i in range(10):  # a plateau would halve it, but it is frozen
        controller.observe(float(i), 0.9, 0.1)
    assert controller.assign(["a"]) == {"a": 160}
    controller.set_bounds(None, 40)  # the frozen value obeys new bounds
    assert controller.assign(["a"]) == {"a": 40}
    controller.unfreeze()
    controller.set_policy(make_policy("fixed", 10))
    assert controller.assign(["a", "b"]) == {"a": 10, "b": 10}
    with pytest.raises(ValueError):
        controller.set_bounds(50, None)  # above the upper bound in force
    with pytest.raises(ValueError):
        make_policy("sometimes", 10)


# ---------------------------------------------------------------- in the server core
from schemas.messages import Command, Control, DeviceStatus, Metrics  # noqa: E402
from tests.helpers import INCARNATION, blobs, commit_bytes, hello, small_server  # noqa: E402


def controls(server, out) -> dict[str, int]:
    """push_every per device, from the control messages in ``out``."""
    parsed = [Control.from_bytes(p.payload) for p in out if p.topic.startswith(server.topics.ctrl(""))]
    return {c.device: c.push_every for c in parsed}


def report_speed(server, device: str, step_s: float, now: float = 0.1) -> list:
    body = DeviceStatus(device=device, state="online", incarnation=INCARNATION, samples=10, step_s=step_s).to_bytes()
    return server.on_message(server.topics.status(device), body, now)


def test_a_slow_devices_speed_report_gets_it_a_smaller_push_every() -> None:
    server = small_server(pace="acbsp", frequency="fixed", push_every=40, balance="steps")
    server.start(0.0)
    hello(server, "fast")
    hello(server, "slow")
    assert report_speed(server, "fast", 0.01) == []  # the fastest keeps the base value: nothing to send
    assert controls(server, report_speed(server, "slow", 0.04)) == {"slow": 10}


def test_release_mode_closes_the_round_without_the_slow_device_and_applies_its_commit_later() -> None:
    server = small_server(pace="bsp", balance="release")
    server.start(0.0)
    for device in ("a", "b", "c"):
        hello(server, device)
        report_speed(server, device, 0.01)
    server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1), 1.0)
    server.on_message(server.topics.grad("b"), commit_bytes(server, "b", 1), 1.0)
    assert server.store.version == 0  # still waiting for c
    report_speed(server, "c", 0.05)  # c turns out five times slower: the round stops waiting
    assert server.store.version == 1 and "c" in server.membership.left
    server.on_message(server.topics.grad("c"), commit_bytes(server, "c", 1, base=0), 2.0)  # late, stale
    for device in ("a", "b"):
        server.on_message(server.topics.grad(device), commit_bytes(server, device, 2), 2.0)
    assert server.store.version == 2 and server.traffic.applied == 5  # c's commit counted once


def test_operator_sets_freezes_and_bounds_the_frequency() -> None:
    server = small_server(pace="acbsp", frequency="trend", push_every_max=64)
    server.start(0.0)
    assert controls(server, hello(server, "a")) == {"a": 64}
    out = server.on_message(server.topics.cmd, Command(cmd="set_frequency", policy="fixed").to_bytes(), 1.0)
    assert controls(server, out) == {"a": 2}  # fixed at the job's push_every
    out = server.on_message(server.topics.cmd, Command(cmd="set_frequency", low=4).to_bytes(), 1.0)
    assert controls(server, out) == {"a": 4}
    server.on_message(server.topics.cmd, Command(cmd="freeze_frequency").to_bytes(), 1.0)
    server.on_message(server.topics.cmd, Command(cmd="set_frequency", policy="trend").to_bytes(), 1.0)
    assert server.frequency.base == 4  # frozen: the policy changed, the value did not
    out = server.on_message(server.topics.cmd, Command(cmd="unfreeze_frequency").to_bytes(), 1.0)
    assert controls(server, out) == {"a": 64}


def test_an_invalid_frequency_command_is_refused_and_changes_nothing() -> None:
    server = small_server(pace="acbsp", frequency="fixed")
    server.start(0.0)
    hello(server, "a")
    for body in (
        b'{"cmd": "set_frequency", "low": 9, "high": 3}',
        b'{"cmd": "set_frequency"}',
        b'{"cmd": "set_frequency", "policy": "often"}',
        b'{"cmd": "pause", "low": 3}',
        b'{"cmd": "set_frequency", "low": 500}',  # valid JSON, but above the bound in force
    ):
        assert server.on_message(server.topics.cmd, body, 1.0) == []
    assert server.traffic.rejected["invalid_command"] == 5
    assert server.frequency.base == 2 and server.frequency.bounds == Bounds(1, 160)


def test_evaluation_every_k_versions_on_a_fixed_sample_and_its_cost_is_reported() -> None:
    server = small_server(pace="asp", rounds=7, eval_every=3)
    server.evaluator.__init__(blobs(), sample=50, clock=time.perf_counter)  # the driver times evaluation
    assert len(server.evaluator.holdout) == 50
    server.start(0.0)
    hello(server, "a")
    evaluated = []
    for seq in range(1, 8):
        out = server.on_message(server.topics.grad("a"), commit_bytes(server, "a", seq), float(seq))
        evaluated += [Metrics.from_bytes(p.payload) for p in out if p.topic == server.topics.metrics]
    assert [m.evaluated_version for m in evaluated] == [0, 0, 3, 3, 3, 6, 7]  # the last version always
    assert server.evaluator.calls == 4 and evaluated[-1].eval_s > 0
    assert evaluated[-1].push_every == {"a": 2} and evaluated[-1].frequency == "fixed"


def test_reading_push_every_changes_nothing_only_an_evaluation_moves_it() -> None:
    controller = FrequencyController(Trend(window=3, steep=0.3, flat=0.1), BOUNDS, "off")
    for i in range(3):  # a plateau: the third evaluation halves the level
        controller.observe(float(i), 0.9, 0.1)
    state = controller.to_state(now=3.0)
    reads = [controller.base, controller.push_every("a"), controller.policy.value(BOUNDS), controller.base]
    assert reads == [80] * 4 and controller.to_state(now=3.0) == state
    assert controller.tell("a") == 80 and controller.assigned == {"a": 80}  # telling is what records
