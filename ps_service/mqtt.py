"""The MQTT driver of the parameter server: broker in, ServerCore, broker out."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from broker.client import BrokerAddress, Inbound, Inbox, MqttTransport, Transport, connect
from ps_service.aggregator import SiteAggregator
from ps_service.checkpoint import load_key, restore, save
from ps_service.core import ServerCore
from ps_service.prometheus import MetricsEndpoint
from schemas.messages import MessageError, Metrics
from schemas.topics import Publish

log = logging.getLogger("edgeps.ps")


BATCH = 64  # inbound messages processed per checkpoint
IDLE_S = 0.25  # the longest wait for a message: how soon a stop request is seen
WAIT_NOTE_S = 15.0  # while the job waits for its start quorum, say so this often
#: The server's inbox: at most this many messages (and bytes) received and not yet processed; the
#: rest waits in the broker (MQTT 5 Receive Maximum, and TCP flow control under MQTT 3.1.1).
INBOX_MESSAGES = 256
INBOX_BYTES = 64 << 20


def default_key_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".key")


def coalesce(messages: list[Publish]) -> list[Publish]:
    """``messages`` with only the last of each retained topic, where it stands: a retained message
    is state (the barrier, a device's control, the newest snapshot), and a subscriber that sees only
    a batch's last one is where one that subscribes after the batch would be. Under load a batch
    of 64 commits makes one barrier message instead of 64."""
    last = {m.topic: i for i, m in enumerate(messages) if m.retain}
    return [m for i, m in enumerate(messages) if not m.retain or last[m.topic] == i]


def serve(
    core: ServerCore,
    transport: Transport,
    stop: threading.Event | None = None,
    on_metrics: Callable[[Metrics], None] | None = None,
    linger_s: float = 1.0,
    checkpoint: Path | None = None,
    endpoint: MetricsEndpoint | None = None,
    checkpoint_key: bytes | None = None,
) -> None:
    """Drive ``core`` until its job finishes (or ``stop`` is set), then let the final messages out.

    A message is acknowledged to the broker only after the core has processed it and, with
    ``checkpoint``, after the state it led to is on disk (written before its results are
    published). An existing checkpoint is resumed from: the job goes on where it was. On
    ``stop`` the server leaves at once: what it received and did not process is not
    acknowledged, so the broker delivers it to the next server. After the job's end it goes on
    processing for ``linger_s`` (late commits are refused as ``finished``, and counted), the same
    way. ``endpoint`` (Prometheus) shows the newest metrics record published.
    """
    clock = time.monotonic
    seen = 0
    key = checkpoint_key
    if checkpoint is not None and key is None:
        key = load_key(default_key_path(checkpoint), create=not checkpoint.exists())
    if checkpoint is not None and checkpoint.exists():
        assert key is not None
        restore(core, checkpoint, clock(), key)
        log.info(
            "resumed job %s (run %d) from %s at version %d", core.config.job, core.run, checkpoint, core.store.version
        )
        outgoing = core.resume(clock())
    else:
        outgoing = core.start(clock())
    if checkpoint is not None:
        assert key is not None
        save(core, checkpoint, clock(), key)

    def listen() -> None:  # before publishing: a device's control goes out after its subscription
        transport.subscribe_only(core.subscriptions())

    def publish(messages: list[Publish]) -> None:
        for event in core.events.take():  # what the core had to say about the batch
            log.log(event.level, event.message)
        for message in messages:
            transport.publish(message)
            if endpoint is not None and message.topic == core.topics.metrics:
                try:
                    endpoint.update(Metrics.from_bytes(message.payload))
                except MessageError as exc:  # never: metrics are built finite; but not worth a crash
                    log.error("metrics record not shown on /metrics: %s", exc)

    def process(timeout: float) -> None:
        """One batch: receive, process, checkpoint, publish, acknowledge."""
        nonlocal seen
        batch = []
        inbound = transport.receive(timeout=timeout)
        while inbound is not None:
            batch.append(inbound)
            inbound = transport.receive(timeout=0.0) if len(batch) < BATCH else None
        outgoing = core.on_tick(clock())
        for message in batch:
            outgoing += core.on_message(
                message.topic, message.payload, clock(), message.response_topic, message.correlation, message.retain
            )
        if checkpoint is not None and (batch or outgoing):
            assert key is not None
            save(core, checkpoint, clock(), key)
        listen()
        publish(coalesce(outgoing))
        for message in batch:
            transport.ack(message)
        if on_metrics is not None:
            for metrics in core.history[seen:]:
                on_metrics(metrics)
            seen = len(core.history)

    def stopped() -> bool:
        return stop is not None and stop.is_set()

    # The persistent session may hold an earlier process's subscriptions (a muted device's commit
    # topic, or grad/+): name every commit topic it may hold once, then narrow down to ours.
    known = [core.topics.grad(d) for d in sorted(core.registry.devices())]
    if core.config.sites_only:  # not even for a moment: beside the workers' shared one, it would take copies
        transport.unsubscribe([core.topics.all_grad, *known])
    else:
        transport.subscribe_only([*core.subscriptions(), core.topics.all_grad, *known])
    listen()
    publish(outgoing)
    noted = clock()
    while not core.finished and not stopped():
        due = core.next_deadline()  # sleep until the core has something timed to do, or a message comes
        process(IDLE_S if due is None else min(IDLE_S, max(0.0, due - clock())))
        if not core.round.quorum and clock() - noted >= WAIT_NOTE_S:  # a silent wait looks like a hang
            noted = clock()
            log.info(
                "waiting for %d devices to start job %s (%d online)",
                core.config.min_devices,
                core.config.job,
                len(core.registry.active()),
            )
    if stopped():
        return
    # The job is over: refuse (and count) late commits for a moment so that devices leave cleanly.
    deadline = clock() + linger_s
    while clock() < deadline and not stopped():
        process(min(0.1, max(0.0, deadline - clock())))


def connect_server(core: ServerCore, broker: BrokerAddress, timeout: float = 10.0) -> MqttTransport:
    """An MQTT transport subscribed to what the server consumes (``ServerCore.subscriptions``): MQTT 5
    where the broker speaks it (commands may then carry response topics and correlation data), else 3.1.1. Its
    inbox is bounded (``INBOX_MESSAGES``, ``INBOX_BYTES``): under overload the backlog stays in
    the broker and the server's memory stays flat."""
    inbox = Inbox(INBOX_MESSAGES, INBOX_BYTES)
    return connect(broker, f"edgeps-ps-{core.config.job}", core.subscriptions(), timeout, inbox=inbox)


#: How often a site aggregator logs what it forwarded (its devices are not visible at the core).
SITE_REPORT_S = 30.0


def serve_site(
    aggregator: SiteAggregator, transport: MqttTransport, stop: threading.Event, report_s: float = SITE_REPORT_S
) -> None:
    """Drive a site aggregator until ``stop``. A device's commit is acknowledged to the site broker
    only once the site commit holding it is acknowledged by the broker (or it was refused): an
    aggregator that dies loses nothing, and the broker delivers what it held to the next one. Its
    subscriptions follow ``SiteAggregator.subscriptions`` after every batch (the commit topics of
    its devices, none of a muted one)."""
    clock = time.monotonic
    unacked: list[Inbound] = []  # settled, waiting for the broker to take what was published with them
    reported = clock()
    # the persistent session may hold an earlier process's commit subscriptions (grad/+, a muted device's)
    transport.unsubscribe(aggregator.all_commit_topics())
    transport.subscribe_only(aggregator.subscriptions())
    while not stop.is_set():
        due = aggregator.next_deadline()
        inbound = transport.receive(timeout=IDLE_S if due is None else min(IDLE_S, max(0.0, due - clock())))
        batch = []
        while inbound is not None:
            batch.append(inbound)
            inbound = transport.receive(timeout=0.0) if len(batch) < BATCH else None
        out = aggregator.on_tick(clock())
        for message in batch:
            out += aggregator.on_message(
                message.topic, message.payload, clock(), message, message.duplicate, message.retain
            )
        out += aggregator.flush(clock())
        for event in aggregator.events.take():
            log.log(event.level, event.message)
        transport.subscribe_only(aggregator.subscriptions())
        for publish in out:
            transport.publish(publish)
        unacked += aggregator.settled()
        if unacked and transport.wait_acknowledged(IDLE_S if out and not stop.is_set() else 0.0):
            for message in unacked:
                transport.ack(message)
            unacked = []
        if clock() - reported >= report_s:
            reported = clock()
            log.info("site %s: %s", aggregator.config.site, site_report(aggregator))
    log.info("site %s: %s", aggregator.config.site, site_report(aggregator))


def site_report(aggregator: SiteAggregator) -> str:
    """What a site aggregator did so far, in one line."""
    stats = aggregator.stats
    refused = dict(sorted(aggregator.report.traffic.rejected.items()))
    received = f"{stats['commits']} commits received ({stats['bytes_in']} bytes)"
    sent = f"{stats['forwarded']} forwarded in {stats['site_commits']} site commits ({stats['bytes_up']} bytes up)"
    return f"{received}, {sent}; refused: {refused or 'none'}"
