"""The ``Transport`` interface: what a driver (broker.driver) needs of a connection to the broker.
``broker.client.MqttTransport`` is the one over paho-mqtt."""

from __future__ import annotations

from abc import ABC, abstractmethod

from schemas.topics import Inbound, Publish


class Transport(ABC):
    """Publish, receive (with acknowledgement after processing), close."""

    @abstractmethod
    def publish(self, message: Publish) -> None:
        """Queue ``message`` for delivery (QoS and retain as it says)."""

    @abstractmethod
    def subscribe_only(self, topics: list[str]) -> None:
        """Make ``topics`` the subscriptions (QoS 1), now and after every reconnect."""

    @abstractmethod
    def unsubscribe(self, topics: list[str]) -> None:
        """Drop ``topics`` (also one a persistent session holds from an earlier process) without subscribing."""

    @abstractmethod
    def resubscribe(self, topics: list[str]) -> None:
        """Subscribe to ``topics`` again, so that the broker sends their retained messages again."""

    @abstractmethod
    def receive(self, timeout: float) -> Inbound | None:
        """The next inbound message, or None after ``timeout`` seconds."""

    def receive_many(self, timeout: float, limit: int) -> list[Inbound]:
        """The messages that came within ``timeout`` (waiting only for the first), at most ``limit``."""
        batch: list[Inbound] = []
        inbound = self.receive(timeout=timeout)
        while inbound is not None:
            batch.append(inbound)
            inbound = self.receive(timeout=0.0) if len(batch) < limit else None
        return batch

    @abstractmethod
    def ack(self, message: Inbound) -> None:
        """Acknowledge ``message`` to the broker: call once it has been processed."""

    def ack_many(self, messages: list[Inbound]) -> None:
        """Acknowledge each of ``messages``, as ``ack`` (a transport may send them in one write)."""
        for message in messages:
            self.ack(message)

    @abstractmethod
    def wait_acknowledged(self, timeout: float) -> bool:
        """Wait until the broker acknowledged every QoS 1 message published so far (False: not within ``timeout``)."""

    @abstractmethod
    def close(self, last: Publish | None = None, end_session: bool = False) -> None:
        """Publish ``last`` (if any), wait for it, and disconnect; ``end_session``: for good, the
        broker keeps nothing of this client (its job finished)."""
