"""The SDK's own MQTT 3.1.1 client (edge_client/embedded/src/mqtt.c, built with ASan/UBSan) against
the project's Mosquitto, through `epsm` (the client over a POSIX socket): a QoS 1 commit-sized
publish arrives byte for byte, a persistent session keeps what came while the device was away, the
will fires on a cut, a publish cut half-way goes again after the reconnect (DUP) and arrives
once, a message larger than the receive buffer is handed over piece by piece (a parameter frame
straight into the arena) or read past and said. And its reader and writer under a packet-level
fuzzer, on 64- and 32-bit builds."""

from __future__ import annotations

import queue
import re
import subprocess
import zlib
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

SIZE = 19_345  # about the demo model's fp32 commit


class Epsm:
    """An `epsm` process: one command a line, one answer a line (messages before it)."""

    def __init__(self, binary: Path, host: str, port: int, client_id: str, rx: int = 65536) -> None:
        self.process = subprocess.Popen(
            [str(binary), host, str(port), client_id, str(rx)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.messages: list[tuple[str, int, int]] = []
        self.past: list[tuple[str, int]] = []  # too large for rx: read past

    def __call__(self, command: str) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        while (line := self.process.stdout.readline().strip()).startswith(("msg ", "past ")):
            if line.startswith("past "):
                _, topic, length = line.split()
                self.past.append((topic, int(length)))
                continue
            _, topic, length, crc = line.split()
            self.messages.append((topic, int(length), int(crc)))
        assert line, f"epsm exited ({self.process.wait()})"
        return line

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        assert self.process.wait(timeout=30) == 0  # a sanitizer's finding exits non-zero


def pattern(size: int) -> bytes:
    return bytes(i % 251 for i in range(size))


@pytest.fixture
def watcher(mosquitto):
    """A paho client subscribed to everything; its messages in a queue."""
    inbox: queue.Queue = queue.Queue()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="watcher")
    client.on_message = lambda c, u, m: inbox.put((m.topic, bytes(m.payload), m.retain))
    client.connect(mosquitto.host, mosquitto.port)
    client.subscribe("#", qos=1)
    client.loop_start()
    client.inbox = inbox  # type: ignore[attr-defined]
    yield client
    client.loop_stop()
    client.disconnect()


def next_message(client, timeout: float = 10.0) -> tuple[str, bytes, bool]:
    return client.inbox.get(timeout=timeout)


@pytest.fixture
def epsm(sdk) -> Path:
    return sdk / "epsm"


def test_a_commit_sized_qos1_publish_arrives_byte_for_byte_and_messages_come_in(epsm, mosquitto, watcher) -> None:
    device = Epsm(epsm, mosquitto.host, mosquitto.port, "gw-1")
    try:
        assert device("connect").startswith("ok connected session_present=0")
        assert device("sub edgeps/j/params").startswith("ok")
        assert device(f"pub edgeps/j/grad/gw-1 {SIZE} 1") == "ok pub 0 acked=1"
        topic, payload, _ = next_message(watcher)
        assert topic == "edgeps/j/grad/gw-1" and payload == pattern(SIZE)
        watcher.publish("edgeps/j/params", pattern(40_000), qos=1).wait_for_publish(10)
        assert device("recv 1 10") == "ok recv 1"
        assert device.messages == [("edgeps/j/params", 40_000, zlib.crc32(pattern(40_000)))]
    finally:
        device.close()


def test_a_frame_larger_than_the_receive_buffer_streams_and_another_is_read_past_and_said(
    epsm, mosquitto, watcher
) -> None:
    device = Epsm(epsm, mosquitto.host, mosquitto.port, "gw-4", rx=1024)
    try:
        assert device("connect").startswith("ok connected")
        assert device("stream edgeps/j/params") == "ok stream"  # as a device's snapshots: into its arena
        for topic in ("edgeps/j/params", "edgeps/j/delta", "edgeps/j/ctrl/gw-4"):
            assert device(f"sub {topic}").startswith("ok")
        watcher.publish("edgeps/j/params", pattern(40_000), qos=1).wait_for_publish(10)
        watcher.publish("edgeps/j/delta", pattern(4_000), qos=1).wait_for_publish(10)
        watcher.publish("edgeps/j/ctrl/gw-4", pattern(1_000), qos=1).wait_for_publish(10)
        assert device("recv 3 10") == "ok recv 3"  # the one read past is said too
        assert device.messages == [
            ("edgeps/j/params", 40_000, zlib.crc32(pattern(40_000))),  # through 512 bytes
            ("edgeps/j/ctrl/gw-4", 1_000, zlib.crc32(pattern(1_000))),
        ]
        assert device.past == [("edgeps/j/delta", 4_000)]  # said, so a device reads the snapshot instead
        assert device("disconnect") == "ok disconnected"
        assert device("connect").startswith("ok connected session_present=1")
        assert device("wait 1").startswith("ok") and len(device.messages) == 2  # all acknowledged: none again
    finally:
        device.close()


def test_the_session_persists_and_the_will_fires_when_the_link_is_cut(epsm, mosquitto, watcher) -> None:
    device = Epsm(epsm, mosquitto.host, mosquitto.port, "gw-2")
    try:
        assert device("connect edgeps/j/status/gw-2 offline").startswith("ok connected")
        assert device("sub edgeps/j/ctrl/gw-2").startswith("ok")
        assert device("close") == "ok closed"  # no DISCONNECT: the broker fires the will
        assert next_message(watcher)[:2] == ("edgeps/j/status/gw-2", b"offline")
        watcher.publish("edgeps/j/ctrl/gw-2", b'{"run":1}', qos=1).wait_for_publish(10)  # while it is away
        assert device("connect edgeps/j/status/gw-2 offline").startswith("ok connected session_present=1")
        assert device("recv 1 10") == "ok recv 1"  # the session kept it
        assert device.messages == [("edgeps/j/ctrl/gw-2", 9, zlib.crc32(b'{"run":1}'))]
    finally:
        device.close()


def test_a_publish_cut_half_way_goes_again_after_the_reconnect_and_arrives_once(epsm, mosquitto, watcher) -> None:
    device = Epsm(epsm, mosquitto.host, mosquitto.port, "gw-3")
    try:
        assert device("connect").startswith("ok connected")
        assert device(f"pub edgeps/j/grad/gw-3 {SIZE} 1 5000") == "ok cut in_flight=1"
        assert device("connect").startswith("ok connected session_present=1 resent=1")
        assert device("wait 0.5").startswith("ok")
        topic, payload, _ = next_message(watcher)
        assert topic == "edgeps/j/grad/gw-3" and payload == pattern(SIZE)
        with pytest.raises(queue.Empty):
            next_message(watcher, timeout=1.0)  # once
        assert device(f"pub edgeps/j/grad/gw-3 {SIZE} 1") == "ok pub 0 acked=1"  # and the next goes as ever
    finally:
        device.close()


@pytest.mark.parametrize("bits", [64, 32])
def test_the_client_survives_a_hundred_thousand_mutated_packet_streams(request, bits) -> None:
    build = request.getfixturevalue("sdk" if bits == 64 else "sdk32")
    result = subprocess.run([str(build / "epsm"), "fuzz", "1", "100000"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]  # a sanitizer's finding exits non-zero
    streams, delivered, dropped, resent, _, streamed, cut = (int(n) for n in re.findall(r"\d+", result.stdout))
    assert streams == 100_000
    assert delivered > 100_000 and dropped > 1_000 and resent > 1_000  # every path taken many times
    assert streamed > 10_000 and cut > 1_000  # messages handed over piece by piece, and links broken half way
