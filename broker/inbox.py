"""Flow control between the broker and a process: a bounded inbox of received messages, and paho's
client reading no more than the inbox takes, so that under overload the backlog stays in the broker."""

from __future__ import annotations

import select
import threading
from collections import deque
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTErrorCode

from schemas.topics import Inbound


class Inbox:
    """The messages received and not yet taken, bounded in count and bytes (``0``: no bound).

    The bound holds by not reading: while the inbox is full the network thread reads nothing
    from the socket (``wait_for_room``), so TCP flow control keeps the backlog in the broker,
    bounded by the broker's own limits, instead of in this process's memory. It goes on writing
    meanwhile (acknowledgements, publishes). At least one message always fits.
    """

    def __init__(self, max_messages: int = 0, max_bytes: int = 0) -> None:
        self.max_messages, self.max_bytes = max_messages, max_bytes
        self._items: deque[Inbound] = deque()
        self._bytes = 0
        self._changed = threading.Condition()

    def full(self) -> bool:
        if not self._items:
            return False
        return (0 < self.max_messages <= len(self._items)) or (0 < self.max_bytes <= self._bytes)

    def wait_for_room(self, timeout: float) -> bool:
        """Whether another message may be read, waiting up to ``timeout`` seconds for room."""
        with self._changed:
            return self._changed.wait_for(lambda: not self.full(), timeout=timeout)

    def put(self, message: Inbound) -> None:
        with self._changed:
            self._items.append(message)
            self._bytes += len(message.payload)
            self._changed.notify_all()

    def get(self, timeout: float) -> Inbound | None:
        with self._changed:
            if timeout > 0:
                self._changed.wait_for(lambda: bool(self._items), timeout=timeout)
            if not self._items:
                return None
            message = self._items.popleft()
            self._bytes -= len(message.payload)
            self._changed.notify_all()
            return message

    def __len__(self) -> int:
        return len(self._items)


#: Packets the network thread reads in a row before it writes again.
READ_BURST = 32


class FlowControlledClient(mqtt.Client):
    """paho's client, reading at most ``READ_BURST`` packets at a time and none while ``inbox`` is
    full. (paho reads as many packets in a row as it has messages in flight, and has no way to
    stop reading: a blocked callback would also stop its writes, acknowledgements included.) Only
    paho's public calls: ``loop_read`` reads one packet where nothing of ours is in flight (a few
    more where some is: the inbox may exceed its bound by those), ``socket`` says whether more waits."""

    def __init__(self, *args: Any, inbox: Inbox, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._edgeps_inbox = inbox

    def loop_read(self, max_packets: int = 1) -> MQTTErrorCode:
        for _ in range(READ_BURST):
            if not self._edgeps_inbox.wait_for_room(0.005):
                return MQTTErrorCode.MQTT_ERR_SUCCESS  # full: leave the rest in the socket for now
            rc = super().loop_read()
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or not _readable(self.socket()):
                return rc
        return MQTTErrorCode.MQTT_ERR_SUCCESS


def _readable(sock: Any) -> bool:
    """Whether ``sock`` (a client's socket, None when disconnected) has bytes to read now: bytes TLS
    decrypted already, or bytes in the kernel's buffer."""
    if sock is None:
        return False
    pending = getattr(sock, "pending", None)
    if pending is not None and pending() > 0:
        return True
    return bool(select.select([sock], [], [], 0)[0])
