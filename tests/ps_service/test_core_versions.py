"""The server core making versions: acbsp's extrapolation and its step guard, when the barrier goes
out, and the job's end on a plateau."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.messages import Barrier, Command
from tests.helpers import commit_bytes, hello, small_server


@pytest.mark.parametrize(
    "changes, late_step",
    [
        ({}, 0.175),
        ({"extrapolation": 1.0}, 0.1),
        ({"extrapolation": 1.5}, 0.15),
        ({"frequency": "trend"}, 0.1),
        ({"frequency": "trend", "extrapolation": 1.5}, 0.15),
        ({"pull_codec": "ternary"}, 0.1),
        ({"pull_codec": "int8"}, 0.175),
    ],
)
def test_acbsp_extrapolates_disagreeing_rounds_after_its_warm_up(changes, late_step) -> None:
    # Every round: a moves every parameter by +0.3, b by -0.1 (equal data and steps). Their mean
    # is +0.1; FedExP's step is (0.09 + 0.01) / 2 / (2 * 0.01) = 2.5, the server's halfway there,
    # 1.75, capped by the job's setting.
    # Under an adaptive frequency policy, or with a codec noisier than the signal, the pace's own
    # extrapolation is off; the job's setting applies regardless. (a's norm is 3x b's: within a
    # norm bound of 4x, nothing is clipped.)
    server = small_server(pace="acbsp", rounds=30, clip_factor=4.0, **changes)
    server.step_guard.observe = lambda loss: None  # these made-up commits raise the loss: the guard is tested apart
    server.start(0.0)
    hello(server, "a")
    hello(server, "b")
    warmup = server.pace.extrapolation_warmup
    steps = []
    for seq in range(1, warmup + 3):
        before = server.store.params()
        server.on_message(server.topics.grad("a"), commit_bytes(server, "a", seq, scale=0.3), float(seq))
        server.on_message(server.topics.grad("b"), commit_bytes(server, "b", seq, scale=-0.1), float(seq))
        assert server.store.version == seq
        moved = {name: server.store.params()[name] - values for name, values in before.items()}
        steps.append(float(np.mean([m.mean() for m in moved.values()])))
    np.testing.assert_allclose(steps[:warmup], 0.1, rtol=1e-5)
    np.testing.assert_allclose(steps[warmup:], late_step, rtol=1e-5)
    assert server.history[-1].version == warmup + 2
    assert server.history[-1].server_step == pytest.approx(late_step / 0.1, rel=1e-3)  # in every metrics record


def test_the_step_guard_holds_extrapolation_back_while_the_loss_rises() -> None:
    from ps_service.stepguard import StepGuard

    guard = StepGuard()
    assert guard.limit(3.0) == 3.0 and guard.limit(1.0) == 1.0
    for loss in (1.0, 0.9, 0.8):  # falling: full trust
        guard.observe(loss)
    assert guard.limit(3.0) == 3.0
    guard.observe(0.9)  # up more than 5 %: halved
    assert guard.limit(3.0) == pytest.approx(2.0)
    guard.observe(float("nan"))  # not even finite: a rise
    assert guard.limit(3.0) == pytest.approx(1.5) and guard.last_loss == 0.9
    guard.observe(0.9)  # level: trust comes back a tenth at a time
    assert guard.limit(3.0) == pytest.approx(1.7)
    # In a job: commits that raise the held-out loss bring acbsp's step down to plain averaging.
    server = small_server(pace="acbsp", rounds=40, clip_factor=4.0)
    server.start(0.0)
    hello(server, "a")
    hello(server, "b")
    for seq in range(1, 30):
        server.on_message(server.topics.grad("a"), commit_bytes(server, "a", seq, scale=0.3), float(seq))
        server.on_message(server.topics.grad("b"), commit_bytes(server, "b", seq, scale=-0.1), float(seq))
    steps = [m.server_step for m in server.history[12:]]  # after the warm-up; unguarded, every one 1.75
    assert min(steps) < 1.3 and max(steps) <= 1.75 + 1e-6


def test_the_log_of_an_operator_command_shows_its_arguments() -> None:
    server = small_server()
    server.start(0.0)
    server.events.take()
    server.on_message(server.topics.cmd, Command(cmd="set_codec", codec="sign", reason="save bytes").to_bytes(), 1.0)
    logged = next(e.message for e in server.events.take())
    assert logged == "operator command: set_codec codec=sign (reason: save bytes)"


def barriers(messages, server) -> list[Barrier]:
    return [Barrier.from_bytes(m.payload) for m in messages if m.topic == server.topics.barrier]


def test_the_barrier_goes_out_at_once_only_when_devices_act_on_the_change() -> None:
    """bsp: a commit changes only who has committed (operators' news): one barrier a second at most, saying how
    things stand when it goes; the end of the job (state) at once. ssp: a new slowest clock at once."""
    server = small_server(pace="bsp", rounds=1000)
    server.start(0.0)
    for device in ("a", "b", "c"):
        hello(server, device, now=0.0)
    out = server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1), 2.0)  # a second after the last
    assert [b.committed for b in barriers(out, server)] == [["a"]]
    out = server.on_message(server.topics.grad("b"), commit_bytes(server, "b", 1), 2.1)
    assert barriers(out, server) == [] and server.next_deadline() == 3.0
    assert barriers(server.on_tick(2.99), server) == []
    [late] = barriers(server.on_tick(3.0), server)
    assert late.committed == ["a", "b"] and late.waiting_for == ["c"]  # the newest state, not b's moment
    out = server.on_message(server.topics.cmd, Command(cmd="stop").to_bytes(), 3.1)
    assert [b.state for b in barriers(out, server)] == ["finished"]

    ssp = small_server(pace="ssp:2", rounds=1000)
    ssp.start(0.0)
    for device in ("a", "b"):
        hello(ssp, device, now=0.0)
    clocks = []
    for seq, now in ((1, 0.1), (1, 0.2), (2, 0.3)):  # a then b: the slowest clock moves at b's first commit
        device = "a" if now != 0.2 else "b"
        out = ssp.on_message(ssp.topics.grad(device), commit_bytes(ssp, device, seq), now)
        clocks += [b.slowest_clock for b in barriers(out, ssp)]
    assert 1 in clocks  # went out at once, well inside the second


def test_a_command_on_an_operators_own_topic_is_answered_on_its_own_reply_topic_only() -> None:
    """The audit: an operator's reply_to could name any reply topic (another operator's). On
    cmd/{operator} (writable by that account only, broker init's ACL) the answer goes to
    reply/{operator} whatever the command asks."""
    server = small_server()
    server.start(0.0)
    status = Command(cmd="status", reply_to=server.topics.reply("other")).to_bytes()
    out = server.on_message(server.topics.cmd_of("op"), status, 1.0, server.topics.reply("other"))
    assert [p.topic for p in out if "/reply/" in p.topic] == [server.topics.reply("op")]
    assert server.topics.cmd_of("+") in server.subscriptions()
    out = server.on_message(server.topics.cmd_of("op"), Command(cmd="pause").to_bytes(), 1.0)
    assert server.paused and not [p for p in out if "/reply/" in p.topic]  # no reply asked: none sent


def test_without_rounds_a_job_ends_when_its_metric_stops_improving() -> None:
    """No --rounds: the job ends ``patience`` broadcasts after its best evaluated version (the same
    constant commit keeps moving the model one way: the metric peaks, then falls or stays)."""
    server = small_server(pace="bsp", rounds=None, patience=3)
    server.start(0.0)
    for device in ("a", "b"):
        hello(server, device)
    seq, now = 0, 1.0
    while not server.finished and server.store.version < 500:
        seq += 1
        for device in ("a", "b"):
            server.on_message(server.topics.grad(device), commit_bytes(server, device, seq, scale=0.05), now)
        now += 0.1
    best = server.report.best
    assert server.finished and best is not None and server.store.version == best.version + 3
    assert server.history[-1].finished and server.history[-1].version == server.store.version
    fixed = small_server(pace="bsp", rounds=None, patience=3, duration_s=60.0, max_rounds=8)
    fixed.start(0.0)
    for device in ("a", "b"):
        hello(fixed, device)
    for seq in range(1, 20):  # a job of a set duration does not stop on a plateau; max_rounds still caps it
        for device in ("a", "b"):
            fixed.on_message(fixed.topics.grad(device), commit_bytes(fixed, device, seq, scale=0.05), 1.0 + seq)
    assert fixed.finished and fixed.store.version == 8
