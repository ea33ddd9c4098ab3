"""The MQTT driver of the parameter server: broker in, ServerCore, broker out."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from edgeps.transport import BrokerAddress, MqttTransport, Transport
from ps_service.core import ServerCore
from schemas.messages import Metrics

log = logging.getLogger("edgeps.ps")


def serve(
    core: ServerCore,
    transport: Transport,
    stop: threading.Event | None = None,
    on_metrics: Callable[[Metrics], None] | None = None,
    linger_s: float = 1.0,
) -> None:
    """Drive ``core`` until its job finishes (or ``stop`` is set), then let the final messages out.

    A message is acknowledged to the broker only after the core has processed it.
    """
    clock = time.monotonic
    seen = 0
    for message in core.start(clock()):
        transport.publish(message)
    while not core.finished and not (stop is not None and stop.is_set()):
        inbound = transport.receive(timeout=0.1)
        outgoing = core.on_tick(clock())
        if inbound is not None:
            outgoing += core.on_message(inbound.topic, inbound.payload, clock())
        for message in outgoing:
            transport.publish(message)
        if inbound is not None:
            transport.ack(inbound)
        if on_metrics is not None:
            for metrics in core.history[seen:]:
                on_metrics(metrics)
            seen = len(core.history)
    # Keep acknowledging late commits for a moment so that devices can leave cleanly.
    deadline = clock() + linger_s
    while clock() < deadline:
        inbound = transport.receive(timeout=0.1)
        if inbound is not None:
            core.on_message(inbound.topic, inbound.payload, clock())
            transport.ack(inbound)


def connect_server(core: ServerCore, broker: BrokerAddress, timeout: float = 10.0) -> MqttTransport:
    """An MQTT transport subscribed to everything the server consumes."""
    t = core.topics
    transport = MqttTransport(
        broker,
        client_id=f"edgeps-ps-{core.config.job}",
        subscriptions=[t.all_status, t.all_grad, t.cmd],
    )
    transport.wait_connected(timeout)
    return transport
