"""The server core and its operators: commands, their replies and refusals, eviction, rate limits,
and the Prometheus endpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest

from schemas.messages import Command, Control, MessageError, Metrics, Notice, Reply
from tests.helpers import commit_bytes, hello, small_server
from tests.ps_service.test_core import by_topic


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

    from ps_service.io.prometheus import MetricsEndpoint

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
