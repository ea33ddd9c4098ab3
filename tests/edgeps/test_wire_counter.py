"""The counting relay's packet reader (edgeps/bench/wire.py): whole packets by topic kind, payload
bytes of frame topics, MQTT 3.1.1 and 5, packets split anywhere across reads."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgeps.bench.rawload import mqtt_length
from edgeps.bench.wire import PacketCounter


def publish(topic: str, payload: bytes, mqtt5: bool) -> bytes:
    name = topic.encode()
    body = len(name).to_bytes(2, "big") + name + b"\x00\x07" + (b"\x03\x23\x00\x01" if mqtt5 else b"") + payload
    return b"\x32" + mqtt_length(len(body)) + body  # QoS 1; MQTT 5: 3 bytes of properties (a topic alias)


CONNECT5 = b"\x10\x0d\x00\x04MQTT\x05\x02\x00\x3c\x00\x00\x00"


@given(cuts=st.lists(st.integers(0, 400), max_size=6), mqtt5=st.booleans())
def test_packets_are_counted_whole_however_the_stream_is_cut(cuts, mqtt5) -> None:
    totals: Counter = Counter()
    frames: Counter = Counter()
    protocol = [4]
    stream = (CONNECT5 if mqtt5 else b"") + publish("edgeps/j/grad/d1", b"F" * 300, mqtt5)
    stream += publish("edgeps/j/barrier", b"{}", mqtt5) + b"\x40\x02\x00\x07" + b"\xc0\x00"
    counter = PacketCounter("up", totals, frames, threading.Lock(), protocol)
    last = 0
    for cut in sorted({c for c in cuts if c < len(stream)}):
        counter.feed(stream[last:cut])
        last = cut
    counter.feed(stream[last:])
    assert sum(totals.values()) == len(stream)
    assert frames["up"] == 300  # the grad payload only, headers and properties left out
    assert totals[("up", "barrier")] > 0 and totals[("up", "PUBACK")] == 4 and totals[("up", "PINGREQ")] == 2
    assert protocol[0] == (5 if mqtt5 else 4)


def test_a_shaped_link_schedules_bytes_at_its_bandwidth_after_its_latency() -> None:
    """What goes in leaves at most bps bits a second, latency seconds after it was serialised; the
    sender thread keeps that schedule (here: into a socket pair, read back whole and in order)."""
    import socket
    import time

    from edgeps.bench.wire import Shaper

    near, far = socket.socketpair()
    shaper = Shaper(near, bps=8e6, latency=0.05)  # 1 MB a second
    started = time.monotonic()
    dues = [shaper.put(b"a" * 100_000), shaper.put(b"b" * 100_000)]
    assert dues[1] - dues[0] == pytest.approx(0.1, abs=0.01)  # the second waits for the first's 0.1 s
    assert dues[0] - started == pytest.approx(0.15, abs=0.02)  # 0.1 s to serialise, then 0.05 s of latency
    shaper.end()
    got = b""
    while chunk := far.recv(1 << 16):
        got += chunk
    assert got == b"a" * 100_000 + b"b" * 100_000
