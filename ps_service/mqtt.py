"""The MQTT driver of the parameter server: broker in, ServerCore, broker out."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from edgeps.transport import BrokerAddress, MqttTransport, Transport
from ps_service.checkpoint import restore, save
from ps_service.core import ServerCore
from ps_service.prometheus import MetricsEndpoint
from schemas.messages import Metrics

log = logging.getLogger("edgeps.ps")


BATCH = 64  # inbound messages processed per checkpoint


def serve(
    core: ServerCore,
    transport: Transport,
    stop: threading.Event | None = None,
    on_metrics: Callable[[Metrics], None] | None = None,
    linger_s: float = 1.0,
    checkpoint: Path | None = None,
    endpoint: MetricsEndpoint | None = None,
) -> None:
    """Drive ``core`` until its job finishes (or ``stop`` is set), then let the final messages out.

    A message is acknowledged to the broker only after the core has processed it and, with
    ``checkpoint``, after the state it led to is on disk (written before its results are
    published). An existing checkpoint is resumed from: the job goes on where it was.
    ``endpoint`` (Prometheus) shows the newest metrics record published.
    """
    clock = time.monotonic
    seen = 0
    if checkpoint is not None and checkpoint.exists():
        restore(core, checkpoint, clock())
        log.info("resumed job %s from %s at version %d", core.config.job, checkpoint, core.store.version)
        outgoing = core.resume(clock())
    else:
        outgoing = core.start(clock())
    if checkpoint is not None:
        save(core, checkpoint, clock())

    def publish(messages: list) -> None:
        for message in messages:
            transport.publish(message)
            if endpoint is not None and message.topic == core.topics.metrics:
                endpoint.update(Metrics.from_bytes(message.payload))

    publish(outgoing)
    while not core.finished and not (stop is not None and stop.is_set()):
        batch = []
        inbound = transport.receive(timeout=0.1)
        while inbound is not None:
            batch.append(inbound)
            inbound = transport.receive(timeout=0.0) if len(batch) < BATCH else None
        outgoing = core.on_tick(clock())
        for message in batch:
            outgoing += core.on_message(
                message.topic, message.payload, clock(), message.response_topic, message.correlation
            )
        if checkpoint is not None and (batch or outgoing):
            save(core, checkpoint, clock())
        publish(outgoing)
        for message in batch:
            transport.ack(message)
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
    """An MQTT transport subscribed to everything the server consumes: MQTT 5 where the broker
    speaks it (commands may then carry response topics and correlation data), else 3.1.1."""
    t = core.topics
    subscriptions = [t.all_status, t.all_grad, t.cmd]
    client_id = f"edgeps-ps-{core.config.job}"
    transport = MqttTransport(broker, client_id=client_id, subscriptions=subscriptions, mqtt5=True)
    try:
        transport.wait_connected(min(timeout, 5.0))
        return transport
    except ConnectionError:
        transport.close()
        log.info("no MQTT 5 connection: using MQTT 3.1.1")
    transport = MqttTransport(broker, client_id=client_id, subscriptions=subscriptions)
    transport.wait_connected(timeout)
    return transport
