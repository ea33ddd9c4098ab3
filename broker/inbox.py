"""Flow control between the broker and a process: a bounded inbox of received messages, and paho's
client reading no more than the inbox takes, so that under overload the backlog stays in the broker."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.exception import MalformedPacket

from broker.packets import PUBACK, PUBLISH, Packet, PacketError, decode_publish, pubacks, split
from schemas.topics import Inbound

log = logging.getLogger("edgeps.transport")


class Inbox:
    """The messages received and not yet taken, bounded in count and bytes (``0``: no bound).

    The bound holds by not reading: while the inbox is full the network thread reads nothing
    from the socket (``wait_for_room``), so TCP flow control keeps the backlog in the broker,
    bounded by the broker's own limits, instead of in this process's memory. It goes on writing
    meanwhile (acknowledgements, publishes). At least one message always fits.

    ``in_hand``: messages the process takes from the inbox and holds unacknowledged besides it (the
    server's turns whose state is being made durable); the broker may have that many more in flight
    (``receive_maximum``), so that the inbox fills while they are held.
    """

    def __init__(self, max_messages: int = 0, max_bytes: int = 0, in_hand: int = 0) -> None:
        self.max_messages, self.max_bytes, self.in_hand = max_messages, max_bytes, in_hand
        self._items: deque[Inbound] = deque()
        self._bytes = 0
        self._changed = threading.Condition()

    @property
    def receive_maximum(self) -> int:
        """The QoS 1 messages the broker may send unacknowledged (MQTT 5 Receive Maximum; 0: no bound)."""
        return min(self.max_messages + self.in_hand, 65535) if self.max_messages else 0

    def full(self) -> bool:
        if not self._items:
            return False
        return (0 < self.max_messages <= len(self._items)) or (0 < self.max_bytes <= self._bytes)

    def wait_for_room(self, timeout: float) -> bool:
        """Whether another message may be read, waiting up to ``timeout`` seconds for room."""
        with self._changed:
            return self._changed.wait_for(lambda: not self.full(), timeout=timeout)

    def put(self, message: Inbound) -> None:
        self.put_many((message,))

    def put_many(self, messages: Iterable[Inbound]) -> None:
        with self._changed:
            for message in messages:
                self._items.append(message)
                self._bytes += len(message.payload)
            self._changed.notify_all()

    def take(self, limit: int, timeout: float) -> list[Inbound]:
        """Up to ``limit`` messages, waiting up to ``timeout`` seconds for the first."""
        with self._changed:
            if timeout > 0:
                self._changed.wait_for(lambda: bool(self._items), timeout=timeout)
            taken = [self._items.popleft() for _ in range(min(limit, len(self._items)))]
            self._bytes -= sum(len(m.payload) for m in taken)
            if taken:
                self._changed.notify_all()
            return taken

    def get(self, timeout: float) -> Inbound | None:
        """The next message, waiting up to ``timeout`` seconds for one (None: none came)."""
        taken = self.take(1, timeout)
        return taken[0] if taken else None

    def __len__(self) -> int:
        return len(self._items)


#: Bytes the network thread reads from the socket at once (thirteen of the demo's 19 KB commits: each read
#: is a hand-off of the GIL between the network thread and the driver, so fewer is cheaper).
CHUNK = 256 << 10


class FlowControlledClient(mqtt.Client):
    """paho's client with a receive path of our own: the network thread reads the socket in chunks
    of up to ``CHUNK`` bytes, and none while ``inbox`` is full (the inbox may exceed its bound by
    the messages of one chunk); it decodes every PUBLISH itself (broker.packets) into the inbox and
    hands every other packet to paho, which keeps connecting, subscribing, publishing, keepalive
    and reconnecting. (paho reads each packet with several ``recv`` calls and has no way to stop
    reading: a blocked callback would also stop its writes, acknowledgements included.)
    ``ack_many`` acknowledges many messages with one write. Relies on paho 2.x's ``_sock``,
    ``_sock_recv``, ``_packet_handle`` (with ``_in_packet``), ``_packet_queue`` and
    ``_loop_rc_handle``; tests/broker pins that behaviour."""

    def __init__(self, *args: Any, inbox: Inbox, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._edgeps_inbox = inbox
        self._edgeps_mqtt5 = kwargs.get("protocol") == mqtt.MQTTv5
        self._edgeps_buffer = bytearray()  # bytes read of a packet not whole yet
        self._edgeps_sock: object = None  # the connection those bytes came on

    def loop_read(self, max_packets: int = 1) -> MQTTErrorCode:
        sock = self._sock
        if sock is None:
            return MQTTErrorCode.MQTT_ERR_NO_CONN
        if sock is not self._edgeps_sock:  # a new connection: nothing of the last one's bytes counts
            self._edgeps_sock, self._edgeps_buffer = sock, bytearray()
        if not self._edgeps_inbox.wait_for_room(0.005):
            return MQTTErrorCode.MQTT_ERR_SUCCESS  # full: leave the rest in the socket for now
        try:
            data = self._sock_recv(CHUNK)
        except BlockingIOError:
            return MQTTErrorCode.MQTT_ERR_SUCCESS
        except OSError as err:
            log.warning("failed to receive on the MQTT socket: %s", err)
            return self._loop_rc_handle(MQTTErrorCode.MQTT_ERR_CONN_LOST)
        if not data:
            return self._loop_rc_handle(MQTTErrorCode.MQTT_ERR_CONN_LOST)
        with self._msgtime_mutex:
            self._last_bytes_received = time.monotonic()  # paho's keepalive clock
        self._edgeps_buffer += data
        messages: list[Inbound] = []
        try:
            for packet in split(self._edgeps_buffer):
                if packet.first & 0xF0 == PUBLISH and (packet.first >> 1) & 3 < 2:
                    messages.append(decode_publish(packet.first, packet.body, self._edgeps_mqtt5))
                    continue
                rc = self._paho_handle(packet)
                if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                    return self._loop_rc_handle(rc)
        except PacketError as exc:
            log.error("dropping the MQTT connection: %s", exc)
            return self._loop_rc_handle(MQTTErrorCode.MQTT_ERR_PROTOCOL)
        finally:  # what came before a bad packet is taken: not acknowledged, the broker sends it again
            self._edgeps_inbox.put_many(messages)
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def _paho_handle(self, packet: Packet) -> MQTTErrorCode:
        """Have paho handle ``packet`` as if its own reader had read it."""
        self._in_packet = _in_packet(packet.first, packet.body)
        try:
            return self._packet_handle()
        except MalformedPacket as exc:
            raise PacketError(f"a malformed packet: {exc}") from None
        finally:
            self._in_packet = _in_packet(0, b"")

    def ack_many(self, mids: list[int]) -> None:
        """PUBACKs for the QoS 1 messages ``mids``, queued as one write."""
        if mids:
            self._packet_queue(PUBACK, pubacks(mids), 0, 0)


def _in_packet(first: int, body: bytes) -> Any:
    """paho's record of the packet it is reading, for a whole packet (``first`` 0: none)."""
    return {
        "command": first,
        "have_remaining": 1 if first else 0,
        "remaining_count": [],
        "remaining_mult": 1,
        "remaining_length": len(body),
        "packet": bytearray(body),
        "to_process": 0,
        "pos": 0,
    }
