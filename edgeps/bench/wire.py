"""``edgeps bench wire``: the bytes on the devices' links, by topic and direction, against the
frame bytes they carry.

A counting relay sits between the devices and the broker (the server and the operator's tools
connect to the broker directly): it forwards every byte both ways and reads the MQTT packets
going by, counting each packet whole (fixed header, variable header, payload: the TCP payload)
under the kind of its topic for PUBLISH (``grad``, ``delta``, ``params``, ``ctrl``, ``barrier``,
``status``, ...) or its packet type otherwise (``PUBACK``, ``CONNECT``, ``SUBSCRIBE``,
``PINGREQ``, ...). Frame bytes are the payloads of ``grad``, ``delta`` and ``params``
publishes: the model's tensors in their frames. The ratio of all bytes to frame bytes is the
protocol's overhead on the link.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from edgeps.tables import Table

PACKET_TYPES = {
    1: "CONNECT",
    2: "CONNACK",
    3: "PUBLISH",
    4: "PUBACK",
    5: "PUBREC",
    6: "PUBREL",
    7: "PUBCOMP",
    8: "SUBSCRIBE",
    9: "SUBACK",
    10: "UNSUBSCRIBE",
    11: "UNSUBACK",
    12: "PINGREQ",
    13: "PINGRESP",
    14: "DISCONNECT",
    15: "AUTH",
}
FRAME_KINDS = ("grad", "delta", "params")


class PacketCounter:
    """Reads one direction of an MQTT connection as it goes by and counts its packets' bytes."""

    def __init__(
        self,
        direction: str,
        totals: Counter[tuple[str, str]],
        frames: Counter[str],
        lock: threading.Lock,
        protocol: list[int],
    ) -> None:
        self.direction, self.totals, self.frames, self.lock = direction, totals, frames, lock
        self.protocol = protocol  # [MQTT protocol level], shared by both directions; set by CONNECT
        self.buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self.buffer += data
        while (packet := self._next()) is not None:
            self._count(*packet)

    def _next(self) -> tuple[int, bytes, int] | None:
        """(first byte, variable header and payload, whole size) of the next complete packet."""
        length, multiplier, i = 0, 1, 1
        while True:
            if i >= len(self.buffer):
                return None
            byte = self.buffer[i]
            length += (byte & 0x7F) * multiplier
            multiplier *= 128
            i += 1
            if not byte & 0x80:
                break
        if len(self.buffer) < i + length:
            return None
        first, body, size = self.buffer[0], bytes(self.buffer[i : i + length]), i + length
        del self.buffer[:size]
        return first, body, size

    def _count(self, first: int, body: bytes, size: int) -> None:
        kind = PACKET_TYPES.get(first >> 4, "?")
        payload = 0
        if kind == "CONNECT" and len(body) > 6:
            self.protocol[0] = body[6]  # 4: MQTT 3.1.1, 5: MQTT 5
        if kind == "PUBLISH":
            qos = (first >> 1) & 3
            topic_len = int.from_bytes(body[:2], "big")
            topic = body[2 : 2 + topic_len].decode("utf-8", "replace")
            at = 2 + topic_len + (2 if qos else 0)
            if self.protocol[0] == 5:  # properties: a variable-length integer, then that many bytes
                props, multiplier = 0, 1
                while at < len(body):
                    byte = body[at]
                    at += 1
                    props += (byte & 0x7F) * multiplier
                    multiplier *= 128
                    if not byte & 0x80:
                        break
                at += props
            parts = topic.split("/")
            kind = parts[2] if len(parts) > 2 and parts[0] == "edgeps" else "other"
            payload = len(body) - at
        with self.lock:
            self.totals[(self.direction, kind)] += size
            if kind in FRAME_KINDS:
                self.frames[self.direction] += payload


class Shaper:
    """One direction of one link: what goes in leaves at most ``bps`` bits a second, each byte
    ``latency`` seconds after its last bit was serialised (a link as the simulator models one). A
    thread sends on the schedule; reading stops while more than ``MAX_QUEUED_S`` is queued."""

    MAX_QUEUED_S = 2.0

    def __init__(self, dst: socket.socket, bps: float, latency: float) -> None:
        self.dst, self.bps, self.latency = dst, bps, latency
        self.free = 0.0  # when the link has sent all that was queued
        self.queue: queue.Queue[tuple[float, bytes | None]] = queue.Queue()
        threading.Thread(target=self._send, daemon=True).start()

    def put(self, data: bytes) -> float:
        """Queue ``data``; return when it will be sent."""
        now = time.monotonic()
        if self.free - now > self.MAX_QUEUED_S:  # back-pressure: the sender's TCP window fills instead
            time.sleep(self.free - now - self.MAX_QUEUED_S)
        self.free = max(time.monotonic(), self.free) + len(data) * 8 / self.bps
        self.queue.put((self.free + self.latency, data))
        return self.free + self.latency

    def end(self) -> None:
        self.queue.put((0.0, None))

    def _send(self) -> None:
        while True:
            due, data = self.queue.get()
            if data is None:
                with contextlib.suppress(OSError):
                    self.dst.shutdown(socket.SHUT_RDWR)
                return
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                self.dst.sendall(data)
            except OSError:
                return


class CountingRelay:
    """A TCP relay on loopback to ``broker``, counting the MQTT packets of every connection; with
    ``link`` (up bits/s, down bits/s, latency s), each connection's two directions shaped to it."""

    def __init__(self, broker: tuple[str, int], link: tuple[float, float, float] | None = None) -> None:
        self.broker, self.link = broker, link
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.totals: Counter[tuple[str, str]] = Counter()
        self.frames: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                device, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.broker)
            for sock in (device, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.connections += 1
            protocol = [4]
            for src, dst, direction in ((device, upstream, "up"), (upstream, device, "down")):
                counter = PacketCounter(direction, self.totals, self.frames, self.lock, protocol)
                shaper = None
                if self.link is not None:
                    up, down, latency = self.link
                    shaper = Shaper(dst, up if direction == "up" else down, latency)
                threading.Thread(target=self._pump, args=(src, dst, counter, shaper), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, counter: PacketCounter, shaper: Shaper | None) -> None:
        try:
            while data := src.recv(1 << 16):
                counter.feed(data)
                if shaper is not None:
                    shaper.put(data)
                else:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            if shaper is not None:  # its thread closes the other side once what is queued has gone
                shaper.end()
            else:
                for sock in (src, dst):
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.server.close()


def bench_wire(codec: str = "sign", pull_codec: str = "ternary", rounds: int = 100, say: Any = print) -> dict[str, Any]:
    """The demo's job with its devices behind a ``CountingRelay``; the bytes by topic and direction."""
    from broker.launcher import start_broker
    from edgeps.demo import run_demo
    from edgeps.localjob import DemoSettings

    with tempfile.TemporaryDirectory(prefix="edgeps-wire-") as tmp, start_broker(workdir=Path(tmp) / "b") as broker:
        relay = CountingRelay((broker.host, broker.port))
        fields = {"rounds": rounds, "codec": codec, "pull_codec": pull_codec}  # the job's, nested by the model
        settings = DemoSettings.model_validate(
            {"out": Path(tmp) / "demo", "broker": f"{broker.host}:{broker.port}", **fields}
        )
        say(
            f"the demo's job ({settings.devices} devices, {codec} commits, {pull_codec} pulls, {rounds} rounds), "
            "its devices behind a counting relay ..."
        )
        try:
            report = run_demo(settings, quiet=True, device_broker=f"127.0.0.1:{relay.port}")
        finally:
            relay.close()
        totals, frames = dict(relay.totals), dict(relay.frames)
    total = sum(totals.values())
    frame_bytes = sum(frames.values())
    rows = [{"direction": d, "kind": k, "bytes": b} for (d, k), b in sorted(totals.items(), key=lambda kv: -kv[1])]
    return {
        "codec": codec,
        "pull_codec": pull_codec,
        "rounds": rounds,
        "devices": settings.devices,
        "connections": relay.connections,
        "link_bytes": total,
        "frame_bytes": frame_bytes,
        "overhead": round(total / frame_bytes, 3) if frame_bytes else None,
        "up": {"link": sum(b for (d, _), b in totals.items() if d == "up"), "frames": frames.get("up", 0)},
        "down": {"link": sum(b for (d, _), b in totals.items() if d == "down"), "frames": frames.get("down", 0)},
        "by_kind": rows,
        "best": report["best"],
    }


def format_wire(report: dict[str, Any]) -> Table:
    table = Table(
        ["direction", "topic or packet", "bytes", "share"],
        before=[
            f"{report['devices']} devices, {report['codec']} up, {report['pull_codec']} down, "
            f"{report['rounds']} rounds (best {report['best']:.4f})"
        ],
    )
    for row in report["by_kind"]:
        table.add(row["direction"], row["kind"], f"{row['bytes']:,}", f"{row['bytes'] / report['link_bytes']:.1%}")
    for direction in ("up", "down"):
        side = report[direction]
        ratio = side["link"] / side["frames"] if side["frames"] else float("nan")
        table.after.append(
            f"{direction}: {side['link']:,} bytes on the links for {side['frames']:,} frame bytes ({ratio:.2f}x)"
        )
    table.after.append(
        f"both ways: {report['link_bytes']:,} bytes for {report['frame_bytes']:,} frame bytes "
        f"({report['overhead']:.2f}x)"
    )
    return table
