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


def test_messages_held_unacknowledged_beside_the_inbox_leave_the_broker_sending(mosquitto) -> None:
    """The MQTT 5 Receive Maximum counts the inbox and what the process holds unacknowledged besides
    it (``in_hand``: the server's turns whose journal record is being written): with it the inbox
    fills again while those are held; without it the broker waits for their acknowledgements."""
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    for in_hand in (0, 100):
        inbox = Inbox(max_messages=50, max_bytes=1 << 20, in_hand=in_hand)
        assert inbox.receive_maximum == 50 + in_hand
        topic = f"held{in_hand}/x"
        sink = MqttTransport(address, f"held-sink-{in_hand}", [topic], mqtt5=True, inbox=inbox)
        sink.wait_connected(10)
        source = MqttTransport(address, f"held-source-{in_hand}", [], persistent=False)
        source.wait_connected(10)
        for i in range(400):
            source.publish(Publish(topic, i.to_bytes(4, "little") + bytes(96), qos=1))
        source.close(timeout=60)
        held = []
        for _ in range(in_hand // 50 or 1):  # take what the inbox holds, acknowledge none of it
            wait_until(lambda inbox=inbox: len(inbox) >= 50, what="the inbox to fill")
            held += sink.receive_many(0, 50)
        if in_hand:
            wait_until(lambda inbox=inbox: len(inbox) >= 50, what="the inbox to fill while 100 are held")
        else:
            time.sleep(0.5)  # a moment in which the broker would send more if it could
            assert len(inbox) == 0
        seen = [int.from_bytes(m.payload[:4], "little") for m in held]
        sink.ack_many(held)
        while (message := sink.receive(timeout=2)) is not None:
            seen.append(int.from_bytes(message.payload[:4], "little"))
            sink.ack(message)
        assert seen == list(range(400))  # all of them, in order, once
        sink.close()
