"""MQTT packets as the broker sends them to us, read in bulk: framing (``split``), the PUBLISH
packet (``decode_publish``) and PUBACKs for many messages in one write (``pubacks``).

paho reads a packet with three or more ``recv`` calls (its type, each byte of its length, its
body) and builds a message object, a property object and a log line for each: at thousands of
commits a second that was most of a server's CPU. The network thread (broker.inbox) reads the
socket in large chunks instead, cuts out every whole packet with ``split``, decodes each PUBLISH
here and hands any other packet (CONNACK, SUBACK, PUBACK of our publishes, PINGRESP, ...) to
paho. Pure: bytes in, packets out (MQTT 3.1.1 and 5, OASIS standard §2 and §3.3).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from schemas.topics import Inbound

PUBLISH, PUBACK = 0x30, 0x40


class PacketError(ValueError):
    """A packet that breaks MQTT's framing or the PUBLISH layout: the connection must be dropped."""


class Packet(NamedTuple):
    """One whole packet: its first byte (type and flags) and its body (the bytes after the length)."""

    first: int
    body: bytes


def _varint(data: bytes | bytearray, at: int, end: int) -> tuple[int, int] | None:
    """A variable byte integer (the remaining length, a property's id or value) at ``at``: (value,
    where it ends), or None where ``end`` cuts it short. PacketError past four bytes."""
    value = 0
    for shift in (0, 7, 14, 21):
        if at >= end:
            return None
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
    raise PacketError("an MQTT variable byte integer of more than four bytes")


def split(buffer: bytearray) -> list[Packet]:
    """The whole packets at the start of ``buffer``, removed from it; an incomplete last packet
    stays for the next read. PacketError on a length of more than four bytes."""
    packets: list[Packet] = []
    pos, end = 0, len(buffer)
    with memoryview(buffer) as view:
        while pos < end:
            header = _varint(buffer, pos + 1, end)
            if header is None or header[0] + header[1] > end:
                break  # the rest of this packet is still on its way
            length, at = header
            packets.append(Packet(buffer[pos], bytes(view[at : at + length])))
            pos = at + length
    del buffer[:pos]
    return packets


#: MQTT 5 property identifiers and the size of their value: 1, 2 or 4 bytes, ``v`` a variable
#: byte integer, ``s`` a length-prefixed string or binary, ``p`` a string pair.
PROPERTY_KINDS: dict[int, int | str] = {
    0x01: 1, 0x02: 4, 0x03: "s", 0x08: "s", 0x09: "s", 0x0B: "v", 0x11: 4, 0x12: "s",
    0x13: 2, 0x15: "s", 0x16: "s", 0x17: 1, 0x18: 4, 0x19: 1, 0x1A: "s", 0x1C: "s",
    0x1F: "s", 0x21: 2, 0x22: 2, 0x23: 2, 0x24: 1, 0x25: 1, 0x26: "p", 0x27: 4,
    0x28: 1, 0x29: 1, 0x2A: 1,
}  # fmt: skip
RESPONSE_TOPIC, CORRELATION_DATA, TOPIC_ALIAS = 0x08, 0x09, 0x23


def _whole_varint(body: bytes, at: int) -> tuple[int, int]:
    """A variable byte integer inside a whole packet: one it cuts short is malformed."""
    read = _varint(body, at, len(body))
    if read is None:
        raise PacketError("a malformed variable byte integer: the packet ends inside it")
    return read


def _sized(body: bytes, at: int, end: int) -> tuple[bytes, int]:
    """A two-byte-length string or binary value at ``at``: (its bytes, where it ends)."""
    if at + 2 > end:
        raise PacketError("a property value runs past the properties")
    size = (body[at] << 8) | body[at + 1]
    if at + 2 + size > end:
        raise PacketError("a property value runs past the properties")
    return body[at + 2 : at + 2 + size], at + 2 + size


def _properties(body: bytes, at: int) -> tuple[str | None, bytes | None, int]:
    """A PUBLISH's MQTT 5 properties at ``at``: (response topic, correlation data, where they end)."""
    length, at = _whole_varint(body, at)
    end = at + length
    if end > len(body):
        raise PacketError("the properties run past the packet")
    response: str | None = None
    correlation: bytes | None = None
    while at < end:
        ident, at = _whole_varint(body, at)
        kind = PROPERTY_KINDS.get(ident)
        if kind is None:
            raise PacketError(f"an unknown MQTT 5 property 0x{ident:02x}")
        if ident == TOPIC_ALIAS:  # never asked for (no Topic Alias Maximum in our CONNECT)
            raise PacketError("a topic alias the client never allowed")
        if isinstance(kind, int):
            at += kind
            if at > end:
                raise PacketError("a property value runs past the properties")
        elif kind == "v":
            _, at = _whole_varint(body, at)
        elif kind == "p":
            _, at = _sized(body, at, end)
            _, at = _sized(body, at, end)
        else:
            value, at = _sized(body, at, end)
            if ident == RESPONSE_TOPIC:
                response = value.decode("utf-8", "replace")
            elif ident == CORRELATION_DATA:
                correlation = value
    return response, correlation, end


def decode_publish(first: int, body: bytes, mqtt5: bool) -> Inbound:
    """The message a PUBLISH packet carries (``first``: its first byte; QoS 0 or 1 only).
    PacketError where the packet's own sizes do not add up."""
    qos = (first >> 1) & 3
    if qos > 1:
        raise PacketError(f"a PUBLISH at QoS {qos}: this client subscribes at QoS 1 at most")
    if len(body) < 2:
        raise PacketError("a PUBLISH shorter than its topic length")
    size = (body[0] << 8) | body[1]
    at = 2 + size
    if at > len(body):
        raise PacketError("a PUBLISH whose topic runs past the packet")
    topic = body[2:at].decode("utf-8", "replace")
    mid = 0
    if qos:
        if at + 2 > len(body):
            raise PacketError("a PUBLISH without its packet identifier")
        mid = (body[at] << 8) | body[at + 1]
        at += 2
    response: str | None = None
    correlation: bytes | None = None
    if mqtt5:
        response, correlation, at = _properties(body, at)
    return Inbound(topic, body[at:], mid, qos, response, correlation, bool(first & 1), bool(first & 8))


_PUBACK = struct.Struct("!BBH")


def pubacks(mids: list[int]) -> bytes:
    """PUBACK packets for ``mids``, back to back (success, no properties: valid in 3.1.1 and 5)."""
    return b"".join([_PUBACK.pack(PUBACK, 2, mid) for mid in mids])
