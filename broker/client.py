"""Transports: how a driver exchanges messages with the broker.

The cores never see a transport; a driver pulls inbound messages from one, feeds the
core, and publishes what the core returns.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.client import ConnectFlags, DisconnectFlags
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from broker.inbox import FlowControlledClient, Inbox
from broker.transport import Transport
from schemas.topics import Inbound, Publish

log = logging.getLogger("edgeps.transport")


@dataclass(frozen=True)
class BrokerAddress:
    """Where the broker is and how to log in."""

    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = None
    password: str | None = None
    tls_ca: str | None = None  # CA certificate: connect over TLS and verify the broker with it
    tls_cert: str | None = None  # this client's certificate and key, where the broker asks for one
    tls_key: str | None = None

    @staticmethod
    def parse(text: str, username: str | None = None, password: str | None = None, **tls: str | None) -> BrokerAddress:
        """``HOST:PORT`` or ``HOST`` (port 1883)."""
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "1883")
        if not host or not port.isdigit():
            raise ValueError(f"broker address must be HOST:PORT, got {text!r}")
        return BrokerAddress(host, int(port), username, password, **tls)


class MqttTransport(Transport):
    """paho-mqtt 2.x over TCP, MQTT 3.1.1 (Mosquitto and the embedded broker both speak it), or
    MQTT 5 with ``mqtt5`` (Mosquitto: response topics and correlation data on commands).

    A persistent session (clean_session False and a stable client id) keeps QoS 1
    messages for us across reconnects; acknowledgements are manual, sent only after the
    driver has processed a message, so a crash before processing means redelivery.
    paho reconnects by itself with exponential backoff (1 s to 30 s); subscriptions are
    renewed on every connect.
    """

    def __init__(
        self,
        broker: BrokerAddress,
        client_id: str,
        subscriptions: list[str],
        will: Publish | None = None,
        hello: Publish | None = None,
        persistent: bool = True,
        mqtt5: bool = False,
        inbox: Inbox | None = None,
    ) -> None:
        self._inbox = inbox if inbox is not None else Inbox()
        self._broker, self._client_id = broker, client_id
        self._subscriptions = subscriptions
        self._hello = hello
        # QoS 1 publishes not yet acknowledged by the broker. paho keeps them across a
        # disconnection and sends them after reconnecting; on_publish tells us when each lands.
        self._unacked: set[int] = set()
        self._acked_early: set[int] = set()  # PUBACKs that beat publish() to recording their mid
        self._unacked_changed = threading.Condition()
        self.connected = threading.Event()
        self.mqtt5 = mqtt5
        if mqtt5:  # a persistent session is clean_start False plus a session that does not expire
            client = FlowControlledClient(
                CallbackAPIVersion.VERSION2,
                client_id=client_id,
                protocol=mqtt.MQTTv5,
                manual_ack=True,
                inbox=self._inbox,
            )
            connect_properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            connect_properties.SessionExpiryInterval = 0xFFFFFFFF if persistent else 0
            if self._inbox.receive_maximum:  # ask the broker to hold back what the inbox cannot take
                connect_properties.ReceiveMaximum = self._inbox.receive_maximum
            connect_options: dict[str, Any] = {"clean_start": not persistent, "properties": connect_properties}
        else:
            client = FlowControlledClient(
                CallbackAPIVersion.VERSION2,
                client_id=client_id,
                clean_session=not persistent,
                manual_ack=True,
                inbox=self._inbox,
            )
            connect_options = {}
        if broker.username:
            client.username_pw_set(broker.username, broker.password)
        if broker.tls_ca:
            client.tls_set(ca_certs=broker.tls_ca, certfile=broker.tls_cert, keyfile=broker.tls_key)
        if will is not None:
            client.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain)
        client.reconnect_delay_set(min_delay=1, max_delay=30)
        client.max_queued_messages_set(0)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        self._subscribing: int | None = None  # the mid of the SUBSCRIBE sent on connecting
        self.refused: str | None = None  # why the broker refused the last CONNECT (its reason code)
        self.where = f"{broker.host}:{broker.port}"
        self._client = client
        client.connect_async(broker.host, broker.port, keepalive=10, **connect_options)
        client.loop_start()

    def wait_connected(self, timeout: float) -> None:
        """Block until the first connection is up and its subscriptions confirmed; ConnectionError after
        ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.connected.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if self.refused is not None or time.monotonic() >= deadline:
                self._client.loop_stop()
                if self.refused is not None:
                    raise ConnectionError(f"the MQTT broker at {self.where} refused the connection: {self.refused}")
                raise ConnectionError(f"no MQTT connection to {self.where} within {timeout:.0f} s")

    def _on_connect(
        self,
        client: mqtt.Client,
        userdata: object,
        flags: ConnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        if reason_code.is_failure:
            self.refused = str(reason_code)
            log.error("broker refused the connection: %s", reason_code)
            return
        no_delay(client.socket())
        if self._subscriptions:  # connected, for wait_connected, once the broker confirmed them
            result, mid = client.subscribe([(topic, 1) for topic in self._subscriptions])
            self._subscribing = mid if result == mqtt.MQTT_ERR_SUCCESS else None
        if self._hello is not None:
            self.publish(self._hello)
        if not self._subscriptions or self._subscribing is None:
            self.connected.set()

    def _on_subscribe(
        self,
        client: mqtt.Client,
        userdata: object,
        mid: int,
        reason_codes: list[ReasonCode],
        properties: Properties | None,
    ) -> None:
        if mid == self._subscribing:
            self._subscribing = None
            self.connected.set()

    def _on_disconnect(
        self,
        client: mqtt.Client,
        userdata: object,
        flags: DisconnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        self.connected.clear()
        if reason_code.is_failure:
            log.warning("disconnected from broker (%s); reconnecting", reason_code)

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        props = message.properties if self.mqtt5 else None
        response = getattr(props, "ResponseTopic", None) if props is not None else None
        correlation = getattr(props, "CorrelationData", None) if props is not None else None
        inbound = Inbound(
            message.topic,
            bytes(message.payload),
            message.mid,
            message.qos,
            response,
            correlation,
            bool(message.retain),
            bool(message.dup),
        )
        self._inbox.put(inbound)

    def publish(self, message: Publish) -> None:
        properties = None
        if self.mqtt5 and (message.response_topic or message.correlation):
            properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            if message.response_topic:
                properties.ResponseTopic = message.response_topic
            if message.correlation:
                properties.CorrelationData = message.correlation
        # Not under our lock: paho may hold its own while it calls on_publish.
        info = self._client.publish(
            message.topic, message.payload, qos=message.qos, retain=message.retain, properties=properties
        )
        with self._unacked_changed:
            if info.mid in self._acked_early or message.qos == 0:  # QoS 0 is never acknowledged
                self._acked_early.discard(info.mid)
            else:
                self._unacked.add(info.mid)

    def _on_publish(
        self, client: mqtt.Client, userdata: object, mid: int, reason_code: ReasonCode, properties: Properties | None
    ) -> None:
        with self._unacked_changed:
            if mid in self._unacked:
                self._unacked.discard(mid)
            else:
                self._acked_early.add(mid)
            self._unacked_changed.notify_all()

    def subscribe_only(self, topics: list[str]) -> None:
        wanted, held = set(topics), set(self._subscriptions)  # a server calls this after every batch
        added = [t for t in topics if t not in held]
        removed = [t for t in self._subscriptions if t not in wanted]
        if not added and not removed:
            return
        self._subscriptions = list(topics)
        if added:
            self._client.subscribe([(t, 1) for t in added])
        if removed:
            self._client.unsubscribe(removed)

    def unsubscribe(self, topics: list[str]) -> None:
        self._subscriptions = [t for t in self._subscriptions if t not in topics]
        self._client.unsubscribe(topics)

    def resubscribe(self, topics: list[str]) -> None:
        for topic in topics:
            if topic not in self._subscriptions:
                self._subscriptions.append(topic)
        self._client.subscribe([(t, 1) for t in topics])

    def receive(self, timeout: float) -> Inbound | None:
        return self._inbox.get(timeout)

    def receive_many(self, timeout: float, limit: int) -> list[Inbound]:
        return self._inbox.take(limit, timeout)

    def ack(self, message: Inbound) -> None:
        if message.qos > 0:
            self._client.ack(message.mid, message.qos)

    def ack_many(self, messages: list[Inbound]) -> None:
        self._client.ack_many([m.mid for m in messages if m.qos == 1])
        for message in messages:
            if message.qos > 1:  # never subscribed to: paho's own acknowledgement of QoS 2
                self.ack(message)

    def wait_acknowledged(self, timeout: float) -> bool:
        """Wait until the broker acknowledged every QoS 1 message published so far."""
        with self._unacked_changed:
            return self._unacked_changed.wait_for(lambda: not self._unacked, timeout=timeout)

    def close(self, last: Publish | None = None, end_session: bool = False, timeout: float = 5.0) -> None:
        """Deliver ``last`` and what is queued, then disconnect. ``end_session``: the client is done with
        this client id for good (its job finished), so the broker drops its session (subscriptions
        and the messages queued for it) instead of keeping it until ``persistent_client_expiration``."""
        try:
            if last is not None:
                self.publish(last)
            self.wait_acknowledged(timeout)  # deliver what is queued before leaving
            if end_session and self.mqtt5:  # MQTT 5: the DISCONNECT says the session expires now
                properties = Properties(PacketTypes.DISCONNECT)  # type: ignore[no-untyped-call]
                properties.SessionExpiryInterval = 0
                self._client.disconnect(properties=properties)
            else:
                self._client.disconnect()
        finally:
            self._client.loop_stop()
        if end_session and not self.mqtt5:  # MQTT 3.1.1: a clean session under the same id replaces it
            self._clean_session(timeout)

    def _clean_session(self, timeout: float) -> None:
        """Connect once with a clean session under this client's id, and leave: the broker discards
        the session the id had (best effort: a broker gone by now keeps it until it expires)."""
        broker = self._broker
        cleaner = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self._client_id, clean_session=True)
        if broker.username:
            cleaner.username_pw_set(broker.username, broker.password)
        if broker.tls_ca:
            cleaner.tls_set(ca_certs=broker.tls_ca, certfile=broker.tls_cert, keyfile=broker.tls_key)
        with contextlib.suppress(OSError, ValueError):
            if cleaner.connect(broker.host, broker.port, keepalive=10) == mqtt.MQTT_ERR_SUCCESS:
                deadline = time.monotonic() + timeout
                while not cleaner.is_connected() and time.monotonic() < deadline:
                    cleaner.loop(timeout=0.05)
                cleaner.disconnect()
                cleaner.loop(timeout=0.05)


def no_delay(sock: Any) -> None:
    """Turn Nagle's algorithm off on a client's TCP socket. paho leaves it on, and against the
    broker's delayed ACKs a QoS 1 round trip then takes about 34 ms on loopback instead of 1.4 ms.
    Not a TCP socket (websockets, a closed one): nothing to do."""
    with contextlib.suppress(AttributeError, OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def reachable(broker: BrokerAddress, timeout: float = 5.0) -> None:
    """ConnectionError saying why, at once, if nothing listens at the broker's address (refused, no
    route, no such host), rather than after a connection timeout."""
    try:
        socket.create_connection((broker.host, broker.port), timeout=timeout).close()
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        raise ConnectionError(f"cannot reach the MQTT broker at {broker.host}:{broker.port}: {why}") from None


def connect(
    broker: BrokerAddress, client_id: str, subscriptions: list[str], timeout: float = 10.0, **options: Any
) -> MqttTransport:
    """A connected ``MqttTransport`` (``options``: its other arguments): MQTT 5 where the broker
    speaks it, else MQTT 3.1.1. ConnectionError when neither connects within ``timeout``, or at once,
    saying why, when nothing listens at the address or the broker refuses the account."""
    reachable(broker, min(timeout, 5.0))
    transport = MqttTransport(broker, client_id, subscriptions, mqtt5=True, **options)
    try:
        transport.wait_connected(min(timeout, 5.0))
        return transport
    except ConnectionError:
        transport.close()
        if transport.refused is not None and "protocol" not in transport.refused.lower():
            raise  # the account, not the protocol version: 3.1.1 would be refused the same way
        log.info("no MQTT 5 connection: using MQTT 3.1.1")
    transport = MqttTransport(broker, client_id, subscriptions, **options)
    transport.wait_connected(timeout)
    return transport
