from __future__ import annotations

import pytest

from schemas import topics
from schemas.messages import Command, Control, DeviceStatus, MessageError, Metrics, Notice, RejectReason
from schemas.topics import Topics


def test_topic_tree_and_parse_round_trip() -> None:
    t = Topics("job1")
    assert t.grad("dev-01") == "edgeps/job1/grad/dev-01"
    assert t.parse(t.grad("dev-01")) == ("grad", "dev-01")
    assert t.parse(t.status("a")) == ("status", "a")
    assert t.parse(t.params) == ("params", None)
    assert t.parse(t.cmd) == ("cmd", None)


@pytest.mark.parametrize(
    "topic",
    ["edgeps/other/grad/a", "edgeps/job1/grad", "edgeps/job1/grad/a/b", "edgeps/job1/nope", "edgeps/job1/grad/+"],
)
def test_foreign_or_malformed_topics_are_refused(topic) -> None:
    with pytest.raises(ValueError):
        Topics("job1").parse(topic)


def test_parsed_topics_are_kept_within_a_bound_and_refused_ones_never(monkeypatch) -> None:
    """A server parses every message's topic: kept once parsed, at most ``PARSED`` of them."""
    monkeypatch.setattr(topics, "PARSED", 3)
    t = Topics("job1")
    for device in ("a", "b", "c", "d", "a"):
        assert t.parse(t.grad(device)) == ("grad", device)
    for _ in range(2):  # refused every time, never kept
        with pytest.raises(ValueError):
            t.parse("edgeps/job1/grad/+")
    assert sorted(t._parsed) == [t.grad("a"), t.grad("b"), t.grad("c")]
    assert t == Topics("job1") and hash(t) == hash(Topics("job1"))  # what it keeps is not what it is


@pytest.mark.parametrize("name", ["", "a/b", "+", "#", "-lead", "x" * 65, "sp ace"])
def test_invalid_job_names(name) -> None:
    with pytest.raises(ValueError):
        Topics(name)


def test_messages_round_trip() -> None:
    messages = [
        DeviceStatus(device="d1", state="online", incarnation=3, samples=10),
        Control(
            device="d1",
            run=1,
            incarnation=3,
            push_every=5,
            lr=0.1,
            batch_size=8,
            wait_for_params=True,
            max_uncommitted_steps=40,
        ),
        Notice(device="d1", seq=3, reason=RejectReason.NON_FINITE, detail="x"),
        Command(cmd="pause"),
        Metrics(
            job="j",
            version=1,
            round=1,
            pace="bsp",
            accuracy=0.5,
            loss=1.0,
            commits=1,
            applied=1,
            rejected={},
            bytes_up=1,
            bytes_down=1,
            devices_online=1,
            elapsed_s=0.1,
        ),
    ]
    for message in messages:
        assert type(message).from_bytes(message.to_bytes()) == message


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        b'{"device": "d1"}',
        b'{"device": "d1", "state": "maybe"}',
        b'{"device": "a/b", "state": "online"}',
        b'{"device": "d1", "state": "online", "extra": 1}',
        b'{"device": "d1", "state": "online", "samples": -1}',
    ],
)
def test_invalid_status_is_refused_with_a_reason(payload) -> None:
    with pytest.raises(MessageError, match="DeviceStatus"):
        DeviceStatus.from_bytes(payload)


def test_oversized_json_is_refused() -> None:
    with pytest.raises(MessageError, match="exceeds"):
        Command.from_bytes(b" " * 70_000)
