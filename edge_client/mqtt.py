"""The MQTT driver of a device: broker in, DeviceCore, broker out."""

from __future__ import annotations

import logging
import threading
import time

from edge_client.core import DeviceCore
from edgeps.transport import BrokerAddress, MqttTransport, Transport

log = logging.getLogger("edgeps.device")


def connect_device(core: DeviceCore, broker: BrokerAddress, timeout: float = 10.0) -> MqttTransport:
    """An MQTT transport with the device's subscriptions, hello on every connect and its last will."""
    transport = MqttTransport(
        broker,
        client_id=f"edgeps-dev-{core.topics.job}-{core.device}",
        subscriptions=core.subscriptions(),
        will=core.status("offline"),
        hello=core.status("online"),
    )
    transport.wait_connected(timeout)
    return transport


def run_device(
    core: DeviceCore,
    transport: Transport,
    slowdown: float = 1.0,
    stop: threading.Event | None = None,
) -> None:
    """Train until the server says the job is finished (or ``stop`` is set), then leave cleanly.

    ``slowdown`` > 1 emulates a slower device: each local step is followed by a pause of
    (slowdown - 1) times its own compute time.
    """
    while not core.finished and not (stop is not None and stop.is_set()):
        inbound = transport.receive(timeout=0.0 if core.ready else 0.2)
        if inbound is not None:
            core.on_message(inbound.topic, inbound.payload)
            transport.ack(inbound)
            continue
        if core.ready:
            started = time.perf_counter()
            for message in core.step():
                transport.publish(message)
            if slowdown > 1:
                time.sleep((slowdown - 1) * (time.perf_counter() - started))
    transport.close(last=core.status("offline"))
