from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from schemas.frame import Frame, FrameKind, decode_frame, encode_frame
from schemas.messages import Barrier, Command, Control, Metrics, Notice
from tests.helpers import commit_bytes, hello, small_server


def by_topic(publishes, topic):
    return [p for p in publishes if p.topic == topic]


def test_start_publishes_retained_version_zero_and_barrier() -> None:
    server = small_server()
    out = server.start(now=0.0)
    params = by_topic(out, server.topics.params)[0]
    assert params.retain and params.qos == 1
    assert decode_frame(params.payload).base_version == 0
    assert Barrier.from_bytes(by_topic(out, server.topics.barrier)[0].payload).state == "running"
    assert Metrics.from_bytes(by_topic(out, server.topics.metrics)[0].payload).version == 0


def test_hello_gets_a_retained_control_message() -> None:
    server = small_server()
    out = hello(server, "d1")
    ctrl = by_topic(out, server.topics.ctrl("d1"))[0]
    assert ctrl.retain
    control = Control.from_bytes(ctrl.payload)
    assert control.push_every == 2 and control.wait_for_params


def test_bsp_round_aggregates_after_all_commits() -> None:
    server = small_server()
    server.start(0.0)
    hello(server, "a")
    hello(server, "b")
    before = server.store.params()
    out = server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1, scale=0.1), 1.0)
    assert server.store.version == 0 and not by_topic(out, server.topics.params)
    out = server.on_message(server.topics.grad("b"), commit_bytes(server, "b", 1, scale=0.15), 2.0)
    assert server.store.version == 1
    frame = decode_frame(by_topic(out, server.topics.params)[0].payload)
    for name, values in before.items():  # the mean: within the norm bound (2x the smaller), nothing clipped
        np.testing.assert_allclose(frame.tensors[name], values + 0.125, rtol=1e-6)
    assert server.traffic.applied == 2


def test_offline_device_leaves_the_barrier_and_the_round_closes() -> None:
    server = small_server()
    server.start(0.0)
    hello(server, "a")
    hello(server, "b")
    server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1), 1.0)
    assert server.store.version == 0
    hello(server, "b", state="offline")
    assert server.store.version == 1


def test_job_finishes_after_the_configured_rounds() -> None:
    server = small_server(pace="asp", rounds=2)
    server.start(0.0)
    hello(server, "a")
    for seq in (1, 2):
        server.on_message(server.topics.grad("a"), commit_bytes(server, "a", seq), float(seq))
    assert server.finished and server.store.version == 2
    out = server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 3), 3.0)
    assert [Notice.from_bytes(p.payload).reason.value for p in out] == ["finished"]  # refused, counted, noticed
    assert server.store.version == 2 and server.traffic.rejected == {"finished": 1}
    assert server.traffic.commits == server.traffic.applied + sum(server.traffic.rejected.values())


def test_pause_holds_aggregation_until_resume() -> None:
    server = small_server(pace="asp")
    server.start(0.0)
    hello(server, "a")
    server.on_message(server.topics.cmd, Command(cmd="pause").to_bytes(), 0.5)
    server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1), 1.0)
    assert server.store.version == 0
    server.on_message(server.topics.cmd, Command(cmd="resume").to_bytes(), 2.0)
    assert server.store.version == 1


def test_stop_command_finishes_the_job() -> None:
    server = small_server()
    server.start(0.0)
    out = server.on_message(server.topics.cmd, Command(cmd="stop").to_bytes(), 1.0)
    assert server.finished
    assert Barrier.from_bytes(by_topic(out, server.topics.barrier)[0].payload).state == "finished"


def _recrc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def _bad_commits(server):
    """(reason, topic device, payload) for every rejection the server knows."""
    good = commit_bytes(server, "a", 5)
    shapes = server.store.shapes
    wrong_shape = {name: np.zeros((1, *shape), np.float32) for name, shape in shapes.items()}
    nan = {name: np.full(shape, np.nan, np.float32) for name, shape in shapes.items()}
    inf = {name: np.full(shape, np.inf, np.float32) for name, shape in shapes.items()}
    params_kind = encode_frame(Frame(kind=FrameKind.PARAMS, base_version=0, tensors=server.store.params()))
    return [
        ("malformed", "a", b"\x00garbage"),
        ("malformed", "a", good[:-1] + bytes([good[-1] ^ 0xFF])),
        ("wrong_kind", "a", params_kind),
        ("device_mismatch", "a", commit_bytes(server, "b", 6)),
        ("unknown_device", "ghost", commit_bytes(server, "ghost", 1)),
        ("shape_mismatch", "a", commit_bytes(server, "a", 7, tensors=wrong_shape)),
        ("shape_mismatch", "a", commit_bytes(server, "a", 8, tensors={"x": np.zeros(2, np.float32)})),
        ("non_finite", "a", commit_bytes(server, "a", 9, tensors=nan)),
        ("non_finite", "a", commit_bytes(server, "a", 10, tensors=inf)),
        ("future_version", "a", commit_bytes(server, "a", 11, base=99)),
        ("replayed", "a", commit_bytes(server, "a", 11)),
        ("out_of_order", "a", commit_bytes(server, "a", 4)),
        ("malformed", "a", commit_bytes(server, "a", 12, steps=0)),
        ("oversized", "a", b"x" * (server.commit_limit + 1)),
        ("unsupported_codec", "a", _recrc(good[:6] + b"\x09" + good[7:-4])),
        ("malformed", "a", _recrc(good[:8] + b"\x00\x00\x80\x3f" + good[12:-4])),  # fp32 takes no argument
        ("wrong_codec", "a", commit_bytes(server, "a", 13, codec="sign")),  # not the job's codec
    ]


def test_every_bad_commit_is_rejected_counted_noticed_and_never_applied() -> None:
    server = small_server(pace="asp")
    server.start(0.0)
    hello(server, "a")
    hello(server, "b")
    before = server.store.snapshot_frame()
    cases = _bad_commits(server)
    for reason, device, payload in cases:
        out = server.on_message(server.topics.grad(device), payload, 1.0)
        notices = [Notice.from_bytes(p.payload) for p in by_topic(out, server.topics.notice(device))]
        # a number this incarnation already delivered: a redelivered copy, counted but not noticed
        assert [n.reason.value for n in notices] == ([] if reason == "replayed" else [reason]), reason
        assert server.store.version == 0
    assert server.store.snapshot_frame() == before
    expected: dict[str, int] = {}
    for reason, _, _ in cases:
        expected[reason] = expected.get(reason, 0) + 1
    assert dict(server.traffic.rejected) == expected
    # The device can still commit normally afterwards.
    server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 14), 2.0)
    assert server.store.version == 1


def test_duplicate_delivery_of_an_applied_commit_is_not_applied_twice() -> None:
    server = small_server(pace="asp")
    server.start(0.0)
    hello(server, "a")
    payload = commit_bytes(server, "a", 1)
    server.on_message(server.topics.grad("a"), payload, 1.0)
    out = server.on_message(server.topics.grad("a"), payload, 1.1)  # QoS 1 redelivery
    assert server.store.version == 1 and server.traffic.rejected["replayed"] == 1
    assert not by_topic(out, server.topics.notice("a"))  # the device must not send that work again


def test_allowlist_refuses_other_devices() -> None:
    server = small_server(allowed_devices=frozenset({"a"}))
    out = hello(server, "b")
    assert [Notice.from_bytes(p.payload).reason.value for p in out] == ["unknown_device"]
    assert not server.registry.known("b")


@pytest.mark.parametrize("payload", [b"{}", b"\xff", b'{"cmd": "explode"}'])
def test_bad_commands_and_statuses_never_crash(payload) -> None:
    server = small_server()
    server.start(0.0)
    server.on_message(server.topics.cmd, payload, 1.0)
    server.on_message(server.topics.status("a"), payload, 1.0)
    server.on_message("edgeps/t/unknown/x/y", payload, 1.0)
    server.on_message("other/topic", payload, 1.0)
    assert server.store.version == 0 and not server.finished


def test_store_refuses_a_delta_that_would_overflow() -> None:
    server = small_server()
    big = {name: np.full(shape, 3e38, np.float32) for name, shape in server.store.shapes.items()}
    server.store.apply(big)
    after_first = server.store.snapshot_frame()
    with pytest.raises(ValueError, match="non-finite"):
        server.store.apply(big)
    assert server.store.version == 1
    assert server.store.snapshot_frame() == after_first


def test_no_round_closes_before_the_start_quorum() -> None:
    server = small_server(min_devices=2)
    server.start(0.0)
    hello(server, "a")
    server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1), 1.0)
    assert server.store.version == 0  # alone, a is "everybody" but the quorum is 2
    hello(server, "b")
    assert server.store.version == 0  # now b is awaited too
    server.on_message(server.topics.grad("b"), commit_bytes(server, "b", 1), 2.0)
    assert server.store.version == 1


def test_round_deadline_drops_a_straggler_whose_late_commit_joins_a_later_round() -> None:
    server = small_server(pace="acbsp", round_deadline_s=5.0)
    server.start(0.0)
    hello(server, "a")
    hello(server, "b")
    server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1), 1.0)
    assert server.on_tick(4.9) == [] and server.store.version == 0
    out = server.on_tick(5.1)
    assert server.store.version == 1 and server.membership.left == {"b"}
    barrier = Barrier.from_bytes(by_topic(out, server.topics.barrier)[-1].payload)
    assert barrier.left == ["b"] and barrier.waiting_for == ["a"]  # the new round waits for a alone
    # Round 2 now waits for a only; b's late commit (based on version 0, one behind: keeping up) rejoins it.
    server.on_message(server.topics.grad("b"), commit_bytes(server, "b", 1, base=0), 6.0)
    assert server.membership.left == set() and server.store.version == 1
    assert server.pace.waiting_for(server.barrier_set()) == ["a"]
    server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 2), 7.0)
    assert server.store.version == 2 and server.traffic.applied == 3


def test_next_deadline_names_when_the_core_has_something_timed_to_do() -> None:
    server = small_server(pace="bsp", round_deadline_s=5.0, metrics_interval_s=3.0, duration_s=100.0)
    server.start(0.0)
    assert server.next_deadline() == 3.0  # no quorum yet: only the metrics interval
    hello(server, "a", now=1.0)
    hello(server, "b", now=1.0)  # quorum at 1.0: the round's deadline and the duration count from there
    assert server.next_deadline() == 2.0  # b joining changed who the round waits for: the barrier says so by 2.0
    [barrier] = server.on_tick(2.0)
    assert barrier.topic == server.topics.barrier and Barrier.from_bytes(barrier.payload).waiting_for == ["a", "b"]
    assert server.next_deadline() == 3.0
    assert server.on_tick(2.9) == []
    server.on_tick(3.0)  # metrics go out, next due at 6.0; the round deadline is 1.0 + 5.0
    assert server.next_deadline() == 6.0
    server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1), 5.5)
    assert server.on_tick(5.99) == [] and server.store.version == 0
    server.on_tick(6.0)  # b let the deadline pass: the round closes without it
    assert server.store.version == 1 and server.membership.left == {"b"}
    server.on_message(server.topics.cmd, Command(cmd="stop").to_bytes(), 7.0)
    assert server.finished and server.next_deadline() is None  # nothing timed after the end


def test_a_silent_fleet_cannot_deadlock_a_round() -> None:
    server = small_server(pace="bsp", round_deadline_s=1.0)
    server.start(0.0)
    for device in ("a", "b", "c"):
        hello(server, device)
    server.on_tick(2.0)
    assert server.membership.left == {"a", "b", "c"} and server.store.version == 0
    server.on_message(server.topics.grad("c"), commit_bytes(server, "c", 1), 3.0)
    assert server.store.version == 1  # the first device back closes the round on its own


def test_ssp_barrier_reports_the_slowest_clock() -> None:
    server = small_server(pace="ssp:1")
    server.start(0.0)
    ctrl = hello(server, "a")
    assert Control.from_bytes(by_topic(ctrl, server.topics.ctrl("a"))[0].payload).staleness_bound == 1
    hello(server, "b")
    for seq in (1, 2, 3):
        out = server.on_message(server.topics.grad("a"), commit_bytes(server, "a", seq), float(seq))
    assert Barrier.from_bytes(by_topic(out, server.topics.barrier)[-1].payload).slowest_clock == 0
    out = server.on_message(server.topics.grad("b"), commit_bytes(server, "b", 1), 4.0)
    assert Barrier.from_bytes(by_topic(out, server.topics.barrier)[-1].payload).slowest_clock == 1


def test_asp_broadcasts_once_per_fleet_of_versions_and_finishes_exactly_at_rounds() -> None:
    server = small_server(pace="asp", rounds=5)
    server.start(0.0)
    hello(server, "a")
    hello(server, "b")
    broadcasts = []
    for seq in range(1, 4):
        for device in ("a", "b"):
            out = server.on_message(server.topics.grad(device), commit_bytes(server, device, seq), float(seq))
            broadcasts += [decode_frame(p.payload).base_version for p in by_topic(out, server.topics.params)]
    assert broadcasts == [2, 4, 5]  # every 2 versions (2 devices), and the last one whatever
    assert server.finished and server.store.version == 5


def test_stopping_publishes_the_final_model_even_between_broadcasts() -> None:
    server = small_server(pace="asp", rounds=100)
    server.start(0.0)
    hello(server, "a")
    hello(server, "b")
    server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1), 1.0)  # version 1, not broadcast
    out = server.on_message(server.topics.cmd, Command(cmd="stop").to_bytes(), 2.0)
    assert decode_frame(by_topic(out, server.topics.params)[0].payload).base_version == 1
    assert Barrier.from_bytes(by_topic(out, server.topics.barrier)[0].payload).state == "finished"
