from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest

from schemas.frame import Frame, FrameKind, decode_frame, encode_frame
from schemas.messages import Barrier, Command, Control, MessageError, Metrics, Notice, Reply
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


def test_operators_switch_the_commit_codec_during_a_run() -> None:
    server = small_server()
    server.start(0.0)
    hello(server, "a")
    hello(server, "b")
    out = server.on_message(server.topics.cmd, Command(cmd="set_codec", codec="sign").to_bytes(), 1.0)
    controls = [Control.from_bytes(p.payload) for p in out if "/ctrl/" in p.topic]
    assert [(c.device, c.codec) for c in controls] == [("a", "sign"), ("b", "sign")]
    # A sign-coded commit is then accepted like any other.
    server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1, codec="sign"), 2.0)
    assert server.pace.committed() == ["a"]


@pytest.mark.parametrize(
    "payload", [b'{"cmd": "set_codec"}', b'{"cmd": "set_codec", "codec": "zip"}', b'{"cmd": "pause", "codec": "sign"}']
)
def test_invalid_codec_commands_change_nothing(payload) -> None:
    server = small_server()
    server.start(0.0)
    assert server.on_message(server.topics.cmd, payload, 1.0) == []
    assert server.codec == "fp32" and server.traffic.rejected["invalid_command"] == 1


def test_a_flooding_device_is_rate_limited_and_noticed_once_a_second() -> None:
    server = small_server(pace="asp", rounds=10_000, max_commit_rate=10.0, max_commit_burst=5)
    server.start(0.0)
    hello(server, "flood")
    hello(server, "calm")
    notices = []
    for seq in range(1, 101):  # 100 commits within 0.1 s
        out = server.on_message(server.topics.grad("flood"), commit_bytes(server, "flood", seq, base=0), seq / 1000)
        notices += [p for p in out if p.topic == server.topics.notice("flood")]
    assert server.traffic.applied == 5 and server.traffic.rejected == {"rate_limited": 95}
    assert len(notices) == 1 and Notice.from_bytes(notices[0].payload).reason.value == "rate_limited"
    server.on_message(server.topics.grad("calm"), commit_bytes(server, "calm", 1, base=0), 0.2)
    assert server.traffic.applied == 6  # other devices are not affected
    server.on_message(server.topics.grad("flood"), commit_bytes(server, "flood", 101, base=0), 1.2)
    assert server.traffic.applied == 7  # the bucket refills at the sustained rate


def reply_of(server, out):
    from schemas.messages import Reply

    replies = [Reply.from_bytes(p.payload) for p in out if p.topic == server.topics.reply("op")]
    assert len(replies) == 1
    return replies[0]


def test_commands_are_answered_on_the_reply_topic_and_refusals_change_nothing() -> None:
    server = small_server(pace="bsp")
    server.start(0.0)
    hello(server, "a")
    ask = {"reply_to": server.topics.reply("op"), "correlation": "c-1"}
    out = server.on_message(server.topics.cmd, Command(cmd="status", **ask).to_bytes(), 1.0)
    answer = reply_of(server, out)
    assert answer.ok and answer.correlation == "c-1" and answer.status["pace"] == "bsp"
    assert answer.status["devices_online"] == ["a"]
    out = server.on_message(server.topics.cmd, Command(cmd="set_pace", pace="warp", **ask).to_bytes(), 1.0)
    assert not reply_of(server, out).ok and "unknown pace" in reply_of(server, out).detail
    assert server.pace.name == "bsp" and server.traffic.rejected["invalid_command"] == 1
    bad = b'{"cmd": "launch", "reply_to": "edgeps/t/reply/op", "correlation": "c-2"}'
    refused = reply_of(server, server.on_message(server.topics.cmd, bad, 1.0))
    assert not refused.ok and refused.correlation == "c-2" and refused.cmd == "launch"
    out = server.on_message(server.topics.cmd, Command(cmd="set_pace", pace="acbsp", **ask).to_bytes(), 1.0)
    assert reply_of(server, out).ok and server.pace.name == "acbsp"
    assert Control.from_bytes(by_topic(out, server.topics.ctrl("a"))[0].payload).one_commit_per_version


def test_an_operator_can_ask_for_the_best_or_the_last_model() -> None:
    import base64
    import io

    server = small_server(pace="bsp", rounds=50)
    server.start(0.0)
    hello(server, "a")
    ask = {"reply_to": server.topics.reply("op"), "correlation": "c-1"}

    def model(which: str | None) -> tuple[Reply, dict[str, np.ndarray]]:
        command = Command(cmd="model", which=which, **ask).to_bytes()
        answer = reply_of(server, server.on_message(server.topics.cmd, command, 20.0))
        with np.load(io.BytesIO(base64.b64decode(answer.model or ""))) as archive:
            return answer, {name: archive[name] for name in archive.files}

    for seq in range(1, 6):  # the same commit again and again: the model moves one way, past its best
        server.on_message(server.topics.grad("a"), commit_bytes(server, "a", seq, scale=0.3), 1.0 + seq)
    best = server.report.best
    assert best is not None and server.store.version > 0
    answer, params = model("best")
    assert answer.ok and answer.model_version == best.version and answer.detail == f"best model: version {best.version}"
    for name, values in best.params.items():
        np.testing.assert_array_equal(params[name], values)
    answer, params = model(None)  # the last, by default
    assert answer.model_version == server.store.version
    for name, values in server.store.params().items():
        np.testing.assert_array_equal(params[name], values)
    with pytest.raises(MessageError, match="only model takes which"):
        Command.from_bytes(b'{"cmd": "status", "which": "best"}')


def test_replies_go_only_to_reply_topics() -> None:
    """A command cannot make the server publish on another topic (parameters, say)."""
    server = small_server()
    server.start(0.0)
    for target in ("edgeps/t/params", "edgeps/other/reply/op", "edgeps/t/reply/a/b", 42):
        payload = json.dumps({"cmd": "status", "reply_to": target}).encode()
        assert server.on_message(server.topics.cmd, payload, 1.0) == []


def test_an_evicted_device_leaves_and_is_refused_from_then_on() -> None:
    server = small_server(pace="bsp")
    server.start(0.0)
    hello(server, "a")
    hello(server, "b")
    server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1), 1.0)
    out = server.on_message(server.topics.cmd, Command(cmd="evict", device="b").to_bytes(), 1.0)
    assert server.store.version == 1  # the round no longer waits for b
    assert Notice.from_bytes(by_topic(out, server.topics.notice("b"))[0].payload).reason.value == "evicted"
    hello(server, "b")
    server.on_message(server.topics.grad("b"), commit_bytes(server, "b", 1, base=1), 2.0)
    assert server.traffic.rejected["unknown_device"] == 2 and "b" not in server.registry.active()
    out = server.on_message(server.topics.cmd, Command(cmd="evict", device="zed").to_bytes(), 2.0)
    assert server.traffic.rejected["invalid_command"] == 1


def test_the_prometheus_endpoint_serves_the_newest_metrics() -> None:
    import urllib.error
    import urllib.request

    from ps_service.prometheus import MetricsEndpoint

    server = small_server(pace="asp", rounds=100)
    endpoint = MetricsEndpoint(0)
    try:
        url = f"http://127.0.0.1:{endpoint.port}/metrics"
        assert "process_resident_memory_bytes" in urllib.request.urlopen(url).read().decode()  # before any record
        metrics = [Metrics.from_bytes(p.payload) for p in server.start(0.0) if p.topic == server.topics.metrics]
        hello(server, "a")
        server.on_message(server.topics.cmd, b"not json", 0.5)
        rejected = {"invalid_command": 1, "malformed": 3}
        endpoint.update(metrics[-1].model_copy(update={"rejected": rejected, "push_every": {"a": 2}}))
        text = urllib.request.urlopen(url).read().decode()
        assert "edgeps_version 0.0" in text and 'job="' not in text  # no label to clash with Prometheus's job
        assert 'edgeps_job_info{frequency="fixed",job_name="t",metric="accuracy",pace="asp"} 1.0' in text
        assert 'edgeps_rejected_total{reason="malformed"} 3.0' in text and "invalid_command" not in text
        assert "edgeps_rejected_commands_total 1.0" in text  # operator commands apart from commits
        assert 'edgeps_push_every{device="a"} 2.0' in text and 'edgeps_metric{metric="accuracy"}' in text
        assert "process_cpu_seconds_total" in text and "process_open_fds" in text
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(url.replace("/metrics", "/other"))
    finally:
        endpoint.close()


def test_mqtt5_response_topic_and_correlation_data_address_the_reply() -> None:
    server = small_server()
    server.start(0.0)
    command = Command(cmd="pause").to_bytes()  # no reply_to in the body: MQTT 5 properties only
    out = server.on_message(server.topics.cmd, command, 1.0, server.topics.reply("op"), b"\x01corr")
    [reply] = [p for p in out if p.topic == server.topics.reply("op")]
    assert reply.correlation == b"\x01corr" and server.paused
    assert server.on_message(server.topics.cmd, command, 1.0, server.topics.params, b"x") == [
        p for p in server.on_message(server.topics.cmd, command, 1.0) if p.topic != server.topics.params
    ]  # a response topic outside reply/ is ignored


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
