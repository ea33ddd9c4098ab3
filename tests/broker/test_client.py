"""The MQTT transport against a real Mosquitto: a bounded inbox keeps the backlog in the broker."""

from __future__ import annotations

import time

from broker.client import BrokerAddress, MqttTransport
from broker.inbox import CHUNK, Inbox
from schemas.topics import Publish
from tests.helpers import wait_until


def test_a_bounded_inbox_leaves_the_backlog_in_the_broker_and_loses_nothing(mosquitto) -> None:
    """1.0: the inbox was unbounded and the broker pushed everything: the server's RSS grew from
    257 to 540 MiB in 20 s of overload. (An Inbox with __len__ was also falsy: ``inbox or Inbox()``
    silently replaced an empty bounded one with an unbounded one.)"""
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    for mqtt5 in (True, False):
        inbox = Inbox(max_messages=50, max_bytes=1 << 20)
        sink = MqttTransport(address, f"sink-{mqtt5}", ["flood/#"], mqtt5=mqtt5, inbox=inbox)
        sink.wait_connected(10)
        source = MqttTransport(address, f"source-{mqtt5}", [], persistent=False)
        source.wait_connected(10)
        for i in range(2000):
            source.publish(Publish("flood/x", i.to_bytes(4, "little") + bytes(5000), qos=1))
        source.close(timeout=60)  # the broker has them all
        wait_until(lambda inbox=inbox: len(inbox) >= 50, what="the inbox to fill")
        time.sleep(0.5)  # a moment in which an unbounded inbox would take the whole backlog
        bound = 50 + CHUNK // 5004 + 1  # beyond the bound by one read's messages at most
        assert len(inbox) <= bound
        seen = []
        while (message := sink.receive(timeout=2)) is not None:
            seen.append(int.from_bytes(message.payload[:4], "little"))
            sink.ack(message)
            assert len(inbox) <= bound
        assert seen == list(range(2000))  # all of them, in order, once
        sink.close()
