"""What a buggy sensor, an fp16 overflow or a compromised gateway sends: well-formed but wrong.
Each test is an attack that worked against protocol 1.0 (figures from the issue), now refused or
bounded. The same attacks over Mosquitto, with a device's own account: tests/integration/test_hostile.py."""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np

from ps_service.evaluator import Evaluator
from ps_service.io.prometheus import MetricsEndpoint
from ps_service.server import versions
from ps_service.update import Update
from schemas.messages import Metrics, Notice
from tests.helpers import Relay, blobs, commit_bytes, hello, small_device, small_server


def honest_job(pace: str = "bsp", rounds: int = 40, **config):
    server = small_server(pace=pace, rounds=10**6, **config)
    relay = Relay(server)
    relay.start()
    for i in range(2):
        relay.connect(small_device(f"h{i}", seed=i))
    return server, relay


def straggling_job():
    """Two honest devices and x, which never commits: three rounds in, it missed a 30 s deadline."""
    server, relay = honest_job(round_deadline_s=30.0)
    hello(server, "x")
    relay.train(rounds=3)
    return server, relay


def accuracy(server) -> float:
    return Evaluator(blobs(seed=99))(server.store.view()).values["accuracy"]


def test_one_huge_commit_does_not_wreck_the_model() -> None:
    """1.0: one valid fp32 commit of 1e30 took accuracy from 0.947 to 0.100 with loss NaN, and the
    honest devices' later commits were refused as non_finite: the job never recovered."""
    clean, clean_relay = honest_job()
    attacked, relay = honest_job()
    clean_relay.train(rounds=30)
    relay.train(rounds=15)
    for value in (1e30, 65504.0):  # a float32 bomb, and an fp16 commit clipped at its maximum
        bomb = commit_bytes(attacked, "x", 1 if value > 1e6 else 2, scale=value)
        hello(attacked, "x", samples=10)
        attacked.on_message(attacked.topics.grad("x"), bomb, relay.now)
        relay.train(rounds=1)
        assert all(np.isfinite(v).all() for v in attacked.store.view().values())
    relay.train(rounds=13)
    assert accuracy(attacked) >= accuracy(clean) - 0.05
    assert not {"non_finite"} & set(attacked.traffic.rejected)  # honest commits still go through
    record = attacked.history[-1]
    assert math.isfinite(record.loss) and Metrics.from_bytes(record.to_bytes()) == record


def test_the_metrics_stay_valid_and_the_endpoint_up_whatever_the_model() -> None:
    """1.0: a NaN loss made the metrics message invalid, and with --metrics-port the server exited
    on every start."""
    server = small_server(pace="asp", rounds=10**6)
    server.start(0.0)
    server.store.apply({n: np.full(s, 3e38, np.float32) for n, s in server.store.shapes.items()})  # a model gone bad
    server.report.evaluation = None
    out = server.on_tick(10.0) + server.broadcast_version(10.0)
    endpoint = MetricsEndpoint(0)
    try:
        for message in out:
            if message.topic == server.topics.metrics:
                record = Metrics.from_bytes(message.payload)  # valid: finite numbers
                endpoint.update(record)
                assert math.isfinite(record.loss) and math.isfinite(record.accuracy)
    finally:
        endpoint.close()


def test_a_device_claiming_a_billion_samples_gets_at_most_its_bounded_share() -> None:
    """1.0: with samples 1e9 one ordinary commit took accuracy from 0.92 to 0.017, and zero-delta
    commits froze the model at 0.089 for the rest of the job (clean: 0.9499)."""
    clean, clean_relay = honest_job()
    clean_relay.train(rounds=30)
    attacked, relay = honest_job()
    hello(attacked, "x", samples=10**9)
    zeros = {n: np.zeros(s, np.float32) for n, s in attacked.store.shapes.items()}
    for seq in range(1, 31):
        attacked.on_message(attacked.topics.grad("x"), commit_bytes(attacked, "x", seq, tensors=zeros), relay.now)
        relay.train(rounds=1)
    assert accuracy(attacked) >= accuracy(clean) - 0.05
    updates = [Update(d, 1, 0, 1, 1, zeros) for d in ("h0", "h1", "x")]
    weights = versions.sizes(attacked, updates)  # x declared 10**9; the others what they hold
    assert weights["x"] <= attacked.config.samples_factor * weights["h0"]


def test_statuses_that_crashed_the_server_are_refused() -> None:
    """1.0: samples of 10^400 (OverflowError in aggregate) and step_s of 5e-324 under --balance steps
    (NaN to int) crashed the server, and again on every restart (retained status)."""
    server = small_server(pace="bsp", rounds=10**6, balance="steps")
    server.start(0.0)
    hello(server, "a")
    for body in (
        b'{"device":"x","state":"online","incarnation":1,"samples":1' + b"0" * 400 + b"}",
        b'{"device":"x","state":"online","incarnation":1,"samples":10,"step_s":5e-324}',
        b'{"device":"x","state":"online","incarnation":1,"samples":10,"busy_s":1e999}',
        b'{"device":"x","state":"online","incarnation":9007199254740993}',
    ):
        out = server.on_message(server.topics.status("x"), body, 1.0, retained=True)
        assert [Notice.from_bytes(p.payload).reason.value for p in out] == ["malformed"], body[:60]
    assert not server.registry.known("x")


def test_a_topk_decompression_bomb_allocates_nothing() -> None:
    """1.0: a 5 KB top-k frame asked for 2 GiB (256 tensors: 256 GiB from 660 KB; live, 62 MB of
    frames grew the server to 4.05 GiB and an uncaught MemoryError)."""
    server = small_server(pace="asp", rounds=10**6, codec="topk:0.01", max_commit_bytes=8 << 20)  # as 1.0's limit
    server.start(0.0)
    hello(server, "x")
    head = struct.pack("<4sBBBBfQQII", b"EPSF", 1, 1, 6, 0, np.float32(0.01), 0, 1, 1, 1) + bytes([1]) + b"x"
    records = b""
    for i in range(256):
        name = f"t{i}".encode()
        payload = struct.pack("<If", 1, 1.0) + bytes([1]) + b"\x00" + b"\x01"
        records += bytes([len(name)]) + name + bytes([1]) + struct.pack("<I", 1 << 28) + struct.pack("<I", len(payload))
        records += payload
    body = head + struct.pack("<H", 256) + records
    bomb = body + struct.pack("<I", zlib.crc32(body))
    assert len(bomb) < 10_000
    out = server.on_message(server.topics.grad("x"), bomb, 1.0)
    assert [Notice.from_bytes(p.payload).reason.value for p in out] == ["malformed"]  # beyond the model's size


def test_a_commit_in_another_codec_is_refused() -> None:
    server = small_server(pace="asp", rounds=10**6, codec="sign")
    server.start(0.0)
    hello(server, "x")
    out = server.on_message(server.topics.grad("x"), commit_bytes(server, "x", 1, codec="topk:0.5"), 1.0)
    assert [Notice.from_bytes(p.payload).reason.value for p in out] == ["wrong_codec"]


def test_a_message_the_server_fails_on_is_a_counted_rejection_not_a_crash_loop(monkeypatch) -> None:
    """A poison message must be acknowledged and dropped, not redelivered to a crashing server."""
    server = small_server(pace="asp", rounds=10**6)
    server.start(0.0)
    hello(server, "x")

    def boom(*args, **kwargs):
        raise MemoryError("simulated")

    monkeypatch.setattr("ps_service.door.validate_commit", boom)
    out = server.on_message(server.topics.grad("x"), commit_bytes(server, "x", 1), 1.0)
    assert [Notice.from_bytes(p.payload).reason.value for p in out] == ["unprocessable"]
    assert server.traffic.rejected == {"unprocessable": 1} and server.store.version == 0


def test_a_device_that_keeps_missing_deadlines_cannot_hold_the_rounds_up() -> None:
    """1.0: a device that rejoined the barrier just after each round deadline cut the job from 4.4
    to 0.03 versions/s: each rejoin made the next round wait a whole deadline again."""
    server, relay = straggling_job()
    started, seq = relay.now, 0
    for _ in range(60):
        if "x" in server.membership.left:  # the flapper rejoins at once: an on-time commit
            seq += 1
            server.on_message(server.topics.grad("x"), commit_bytes(server, "x", seq), relay.now)
        relay.train(rounds=1)
    waited = relay.now - started
    assert waited < 60 * 0.1 + 30, waited  # 1.0: about 30 s per round
    assert server.membership.standing["x"].strikes >= 3


def test_a_flooding_device_is_not_listened_to_for_longer_and_longer() -> None:
    """1.0: a flood (81,841 small commits in 15 s) went through the server's one queue in front of
    the honest devices' commits and cut the job to 0.13 versions/s while the rate limit refused it.
    Now the server unsubscribes from the flooder's commit topic: the broker drops the flood."""
    server = small_server(pace="asp", rounds=10**6, max_commit_rate=10.0, max_commit_burst=5)
    server.start(0.0)
    hello(server, "f")
    hello(server, "h")
    grad = server.topics.grad("f")
    assert grad in server.subscriptions() and server.topics.grad("h") in server.subscriptions()
    notices = []
    for i in range(40):  # 40 commits in 0.04 s: the burst of 5 passes, then the flood is refused
        out = server.on_message(grad, commit_bytes(server, "f", 1 + i, base=server.store.version), 1.0 + i / 1000)
        notices += [Notice.from_bytes(p.payload) for p in out if p.topic == server.topics.notice("f")]
    assert server.traffic.applied == 5 and server.traffic.rejected["rate_limited"] == 35
    assert len(notices) == 1 and "not received for 1 s" in notices[0].detail
    assert grad not in server.subscriptions() and server.topics.grad("h") in server.subscriptions()
    server.on_tick(2.0)  # the barrier of the versions the burst made (it waited a second)
    assert grad not in server.subscriptions() and server.next_deadline() == 1.0 + 5 / 1000 + 1.0
    server.on_tick(2.1)  # the mute is over: listened to again
    assert grad in server.subscriptions()
    out = []
    for i in range(40):  # floods again at once: twice as long
        out += server.on_message(grad, commit_bytes(server, "f", 100 + i, base=server.store.version), 2.2 + i / 1000)
    [notice] = [Notice.from_bytes(p.payload) for p in out if p.topic == server.topics.notice("f")]
    assert "not received for 2 s" in notice.detail and grad not in server.subscriptions()
    server.on_tick(4.3)
    assert grad in server.subscriptions()


def test_the_server_listens_only_to_devices_it_knows_or_allows() -> None:
    open_job = small_server()
    hello(open_job, "a")
    t = open_job.topics
    # no grad/+: strangers cost nothing
    assert open_job.subscriptions() == [t.all_status, t.cmd, t.cmd_of("+"), t.grad("a")]
    closed = small_server(allowed_devices=frozenset({"x", "y"}))
    assert [s for s in closed.subscriptions() if "/grad/" in s] == [t.grad("x"), t.grad("y")]
    closed.on_message(t.cmd, b'{"cmd": "evict", "device": "y"}', 0.0)  # not known yet: refused
    hello(closed, "y")
    closed.on_message(t.cmd, b'{"cmd": "evict", "device": "y"}', 0.0)
    assert [s for s in closed.subscriptions() if "/grad/" in s] == [t.grad("x")]


def test_a_device_going_offline_and_online_again_stays_out_of_the_barrier_until_it_commits() -> None:
    """The audit: a device alternating offline and online statuses cut a bsp job from 4.5 to 1.18
    versions/s after a first 30 s stall: going offline cleared ``left``, so every round waited the
    probation deadline for it again."""
    server, relay = straggling_job()
    assert "x" in server.membership.left
    started = relay.now
    for _ in range(30):
        hello(server, "x", state="offline", now=relay.now)
        hello(server, "x", now=relay.now)
        relay.train(rounds=1)
    assert relay.now - started < 30 * 0.5, relay.now - started  # no round waited for it
    assert "x" in server.membership.left and "x" not in server.barrier_set()


def test_one_device_claiming_a_microsecond_step_does_not_cut_the_others_push_every() -> None:
    """The audit: under --balance steps one device claiming step_s = 1e-6 set every other device's
    push_every from 10 to 1 (commits 7.4 -> 48.6 a second, bytes up 143 -> 941 kB/s)."""
    from schemas.messages import Control, DeviceStatus

    server = small_server(pace="bsp", rounds=10**6, balance="steps", push_every=10)
    server.start(0.0)
    controls = {}
    for now in (1.0, 2.0):  # hellos, then speed reports: each makes the server balance the fleet again
        for device, step_s in (("a", 0.01), ("b", 0.012), ("c", 0.011), ("x", 1e-6)):
            status = DeviceStatus(device=device, state="online", samples=10, incarnation=1, step_s=step_s)
            for message in server.on_message(server.topics.status(device), status.to_bytes(), now):
                if "/ctrl/" in message.topic:
                    controls[message.topic.rsplit("/", 1)[1]] = Control.from_bytes(message.payload).push_every
    assert server.frequency.push_every("a") == 10 and server.frequency.push_every("c") >= 8
    assert server.frequency.push_every("x") == 10 and controls["a"] == 10


def test_options_and_commands_take_ascii_digits_only() -> None:
    """The audit: ``set_pace ssp:٣`` was accepted as ssp:3 (Python reads any Unicode digit)."""
    import argparse

    from edgeps.options import add_model_options
    from ps_service.config import ServerConfig
    from schemas.messages import Reply

    server = small_server(pace="bsp")
    server.start(0.0)
    for command in (
        b'{"cmd": "set_pace", "pace": "ssp:\\u0663", "reply_to": "edgeps/t/reply/op"}',
        b'{"cmd": "set_codec", "codec": "qsgd:\\u0663", "reply_to": "edgeps/t/reply/op"}',
    ):
        [reply] = [Reply.from_bytes(p.payload) for p in server.on_message(server.topics.cmd, command, 1.0)]
        assert not reply.ok and "ASCII" in reply.detail
    assert server.pace.name == "bsp" and server.codec == "fp32"
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_model_options(parser, ServerConfig)
    for flag in ("--rounds", "--lr", "--max-commit-rate"):
        try:
            parser.parse_args([flag, "\u0663"])
        except (argparse.ArgumentError, SystemExit):
            continue
        raise AssertionError(f"{flag} took a non-ASCII digit")
