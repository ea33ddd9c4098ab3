"""The load generator of ``bench load --capacity`` and the broker's own rate: ``RawPublisher`` writes
MQTT 3.1.1 QoS 1 publishes straight to a socket, a window of them in flight, so that it costs little
CPU next to what it measures; ``broker_rate`` and ``mosquitto_pub_rate`` time a subscriber reading
them from Mosquitto."""

from __future__ import annotations

import os
import select
import shutil
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

from edgeps.bench.load import commit_template, patch

WINDOW = 64  # QoS 1 publishes in flight per generator connection
#: Commits the load keeps sent and not yet received by the server, at least: enough to keep it busy
#: between two of its metrics records, few enough that the broker is not swamped queueing (its CPU is
#: the server's too on a small machine) or dropping (max_queued_bytes) a flood the server cannot take.
BACKLOG = 3000
#: ... and at least this many seconds of the server's receive rate (its metrics come every 0.5 s: at
#: 6,000 commits/s a backlog of 3,000 ran dry between two, and the server waited on an empty inbox).
AHEAD_S = 1.0


class RawPublisher:
    """An MQTT 3.1.1 client that only publishes at QoS 1: CONNECT (clean session), then PUBLISH
    packets written back to back with at most ``WINDOW`` unacknowledged, PUBACKs read as they come."""

    def __init__(self, host: str, port: int, client_id: str) -> None:
        self.sock = socket.create_connection((host, port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cid = client_id.encode()
        body = b"\x00\x04MQTT\x04\x02\x00\x00" + struct.pack(">H", len(cid)) + cid  # clean session, no keepalive
        self.sock.sendall(b"\x10" + mqtt_length(len(body)) + body)
        if self._read(4) != b"\x20\x02\x00\x00":
            raise ConnectionError(f"the broker refused {client_id}")
        self.mid, self.inflight = 0, 0

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the broker closed the connection")
            data += chunk
        return data

    def publish(self, topic: bytes, payload: bytes | bytearray) -> None:
        """Send one QoS 1 PUBLISH, first waiting for acknowledgements while the window is full."""
        while self.inflight >= WINDOW:
            self._take_acks(block=True)
        self.mid = self.mid % 65535 + 1
        head = struct.pack(">H", len(topic)) + topic + struct.pack(">H", self.mid)
        self.sock.sendall(b"\x32" + mqtt_length(len(head) + len(payload)) + head + payload)
        self.inflight += 1
        self._take_acks(block=False)

    def _take_acks(self, block: bool) -> None:
        if not block and not select.select([self.sock], [], [], 0)[0]:
            return
        data = self.sock.recv(4 * self.inflight)  # PUBACKs are 4 bytes; finish a partial one
        if not data:
            raise ConnectionError("the broker closed the connection")
        if len(data) % 4:
            data += self._read(4 - len(data) % 4)
        self.inflight -= len(data) // 4

    def close(self) -> None:
        """Wait for every acknowledgement, then DISCONNECT."""
        while self.inflight:
            self._take_acks(block=True)
        self.sock.sendall(b"\xe0\x00")
        self.sock.close()


def mqtt_length(n: int) -> bytes:
    """MQTT's variable-length integer (a packet's remaining length)."""
    out = bytearray()
    while True:
        n, byte = n >> 7, n & 0x7F
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def generate(
    names: list[str], host: str, port: int, job: str, seconds: float, go: Any, allowed: Any, results: Any
) -> None:
    """One load process: valid commits for ``names`` in turn for ``seconds`` once ``go`` is set, as
    fast as the broker takes them while fewer than ``allowed`` (shared, kept a backlog ahead of the
    server) have been sent; puts the number sent on ``results``."""
    from schemas.topics import Topics

    topics = Topics(job)
    publisher = RawPublisher(host, port, f"capacity-{names[0]}")
    bodies = [commit_template(name) for name in names]
    grads = [topics.grad(name).encode() for name in names]
    go.wait()
    sent, started, seq = 0, time.monotonic(), 1
    while time.monotonic() - started < seconds:
        if sent >= allowed.value:
            time.sleep(0.001)
            continue
        seq += 1
        for body, grad in zip(bodies, grads, strict=True):
            publisher.publish(grad, patch(body, seq))
            sent += 1
    publisher.close()
    results.put(sent)


class _Deliveries:
    """One ``mosquitto_sub`` (QoS 1) on ``topic``, printing a line per message: how many came, and when the
    first and the last did."""

    def __init__(self, host: str, port: int, topic: str) -> None:
        tool = shutil.which("mosquitto_sub")
        if tool is None:
            raise RuntimeError("the broker rate needs mosquitto_sub (Debian's mosquitto-clients)")
        self.sub = subprocess.Popen(
            [tool, "-h", host, "-p", str(port), "-q", "1", "-t", topic, "-F", "."], stdout=subprocess.PIPE
        )
        assert self.sub.stdout is not None
        self.fd = self.sub.stdout.fileno()
        self.seen, self.first, self.last = 0, 0.0, 0.0

    def poll(self, timeout: float = 0.0) -> bool:
        """Count what has arrived, waiting up to ``timeout`` for something; whether anything had."""
        if not select.select([self.fd], [], [], timeout)[0]:
            return False
        got = os.read(self.fd, 1 << 16).count(b"\n")
        if got and not self.seen:
            self.first = time.monotonic()
        self.seen += got
        self.last = time.monotonic()
        return True

    def rate(self, count: int) -> float:
        """Messages a second once ``count`` came (RuntimeError if they stop coming)."""
        while self.seen < count:
            if not self.poll(10):
                raise RuntimeError(f"mosquitto_sub received {self.seen} of {count}")
        return (count - 1) / (self.last - self.first) if self.last > self.first else float("inf")

    def close(self) -> None:
        self.sub.terminate()
        self.sub.wait(timeout=10)


def _subscribed(host: str, port: int, topic: str) -> _Deliveries:
    """A ``_Deliveries`` whose subscription is in place (a probe came through), its count at 0."""
    deliveries = _Deliveries(host, port, topic)
    probe = RawPublisher(host, port, "capacity-probe")
    deadline = time.monotonic() + 30
    while not deliveries.poll(0.1):
        if time.monotonic() > deadline:
            deliveries.close()
            raise RuntimeError("mosquitto_sub received nothing")
        probe.publish(topic.encode(), b"ready")
    probe.close()
    quiet = time.monotonic() + 0.5
    while time.monotonic() < quiet:  # the other probes, out of the way
        deliveries.poll(0.1)
    deliveries.seen = 0
    return deliveries


def broker_rate(host: str, port: int, payload: bytes, count: int) -> float:
    """Messages a second from one ``RawPublisher`` to one ``mosquitto_sub`` at QoS 1, ``payload``
    each: ``count`` over the time from the first delivery to the last."""
    deliveries = _subscribed(host, port, "capacity/raw")
    try:
        publisher = RawPublisher(host, port, "capacity-raw")
        for _ in range(count):
            publisher.publish(b"capacity/raw", payload)
            while deliveries.poll():
                pass
        publisher.close()
        return deliveries.rate(count)
    finally:
        deliveries.close()


def mosquitto_pub_rate(host: str, port: int, payload: bytes, count: int, workdir: Path) -> float:
    """The same with ``mosquitto_pub --repeat`` as the publisher (libmosquitto's pace, its 20 messages in
    flight): the figure issue 18 started from."""
    tool = shutil.which("mosquitto_pub")
    if tool is None:
        raise RuntimeError("the broker rate needs mosquitto_pub (Debian's mosquitto-clients)")
    (workdir / "payload").write_bytes(payload)
    deliveries = _subscribed(host, port, "capacity/pub")
    try:
        pub = subprocess.Popen(
            [
                tool,
                "-h",
                host,
                "-p",
                str(port),
                "-q",
                "1",
                "-t",
                "capacity/pub",
                "-f",
                str(workdir / "payload"),
                "--repeat",
                str(count),
            ]
        )
        rate = deliveries.rate(count)
        pub.wait(timeout=60)
        return rate
    finally:
        deliveries.close()
