"""broker.packets against paho's own decoder and encoder: the same messages out of the same bytes,
however the bytes are cut by the reads that bring them."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt import _packet as paho_packet
from paho.mqtt.client import MQTTv5, MQTTv311
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from broker.packets import PUBACK, PUBLISH, Packet, PacketError, decode_publish, pubacks, split


def remaining(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def properties_bytes(response: str | None, correlation: bytes | None, expiry: int | None, user: bool) -> bytes:
    """paho's own encoding of a PUBLISH's properties (its length first)."""
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    if expiry is not None:
        props.MessageExpiryInterval = expiry
    if response is not None:
        props.ResponseTopic = response
    if user:
        props.UserProperty = ("who", "edge")
    if correlation is not None:
        props.CorrelationData = correlation
    packed: bytes = props.pack()  # type: ignore[no-untyped-call]
    return packed


#: Characters MQTT's UTF-8 strings may hold (paho's encoder refuses surrogates and NUL).
utf8 = st.characters(blacklist_categories=("Cs",), blacklist_characters="\0")
publishes = st.fixed_dictionaries(
    {
        "topic": st.text(
            st.characters(blacklist_categories=("Cs",), blacklist_characters="+#\0"), min_size=1, max_size=40
        ),
        "payload": st.binary(max_size=3000),
        "qos": st.sampled_from([0, 1]),
        "mid": st.integers(1, 65535),
        "retain": st.booleans(),
        "dup": st.booleans(),
        "response": st.none() | st.text(utf8, max_size=20),
        "correlation": st.none() | st.binary(max_size=20),
        "expiry": st.none() | st.integers(0, 2**32 - 1),
        "user": st.booleans(),
    }
)


def encode(p: dict, mqtt5: bool) -> bytes:
    topic = p["topic"].encode()
    body = struct.pack("!H", len(topic)) + topic + (struct.pack("!H", p["mid"]) if p["qos"] else b"")
    if mqtt5:
        body += properties_bytes(p["response"], p["correlation"], p["expiry"], p["user"])
    body += p["payload"]
    first = PUBLISH | p["qos"] << 1 | int(p["retain"]) | (8 if p["dup"] and p["qos"] else 0)
    return bytes([first]) + remaining(len(body)) + body


@settings(max_examples=200, deadline=None)
@given(messages=st.lists(publishes, min_size=1, max_size=6), mqtt5=st.booleans(), cuts=st.lists(st.integers(0, 20000)))
def test_publishes_decode_as_paho_decodes_them_however_the_reads_cut_them(messages, mqtt5, cuts) -> None:
    stream = b"".join(encode(p, mqtt5) for p in messages) + bytes([PUBACK, 2, 0, 7])
    buffer, packets = bytearray(), []
    for lo, hi in zip([0, *sorted(cuts)], [*sorted(cuts), len(stream)], strict=True):  # each read's bytes
        buffer += stream[lo:hi]
        packets += split(buffer)
    assert not buffer and packets[-1] == Packet(PUBACK, bytes([0, 7]))
    for packet, p in zip(packets, messages, strict=False):
        ours = decode_publish(packet.first, packet.body, mqtt5)
        theirs = paho_packet.decode_publish(packet.first, packet.body, MQTTv5 if mqtt5 else MQTTv311)
        assert ours.topic == theirs.topic.decode() == p["topic"]
        assert ours.payload == theirs.payload == p["payload"]
        assert (ours.qos, ours.retain, ours.duplicate) == (theirs.qos, theirs.retain, theirs.dup)
        assert ours.mid == (theirs.mid if p["qos"] else 0)
        assert ours.response_topic == (p["response"] if mqtt5 else None)
        assert ours.correlation == (p["correlation"] if mqtt5 else None)


def test_a_partial_length_or_body_waits_for_more_bytes() -> None:
    whole = encode({**dict.fromkeys(("response", "correlation", "expiry")), "topic": "t", "payload": bytes(300),
                    "qos": 1, "mid": 9, "retain": False, "dup": False, "user": False}, mqtt5=False)  # fmt: skip
    for cut in range(len(whole)):
        buffer = bytearray(whole[:cut])
        assert split(buffer) == [] and bytes(buffer) == whole[:cut]
        buffer += whole[cut:]
        assert [p.body[-300:] for p in split(buffer)] == [bytes(300)] and not buffer


@pytest.mark.parametrize(
    ("first", "body", "mqtt5", "why"),
    [
        (PUBLISH | 2, b"\x00", False, "shorter than its topic length"),
        (PUBLISH | 2, b"\x00\x05ab", False, "topic runs past"),
        (PUBLISH | 2, b"\x00\x01a\x01", False, "packet identifier"),
        (PUBLISH | 4, b"\x00\x01a\x00\x01", False, "QoS 2"),
        (PUBLISH, b"\x00\x01a\x05\x08\x00\x09ab", True, "runs past"),
        (PUBLISH, b"\x00\x01a\x09", True, "properties run past"),
        (PUBLISH, b"\x00\x01a\x02\x7f\x00", True, "unknown MQTT 5 property"),
        (PUBLISH, b"\x00\x01a\x03\x23\x00\x01", True, "topic alias"),
        (PUBLISH, b"\x00\x01a\x02\x0b\xff", True, "variable byte integer"),
    ],
)
def test_a_malformed_publish_is_refused_with_a_reason(first, body, mqtt5, why) -> None:
    with pytest.raises(PacketError, match=why):
        decode_publish(first, body, mqtt5)


def test_a_length_of_five_bytes_is_refused() -> None:
    with pytest.raises(PacketError, match="more than four bytes"):
        split(bytearray([PUBLISH, 0xFF, 0xFF, 0xFF, 0xFF, 0x01]))


def test_pubacks_are_back_to_back_packets() -> None:
    assert pubacks([1, 258]) == bytes([PUBACK, 2, 0, 1, PUBACK, 2, 1, 2])
    assert split(bytearray(pubacks([5, 6]))) == [Packet(PUBACK, b"\x00\x05"), Packet(PUBACK, b"\x00\x06")]
