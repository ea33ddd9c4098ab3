"""The MQTT driver of the parameter server: broker in, ServerCore, broker out."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from broker.client import BrokerAddress, MqttTransport, connect
from broker.driver import BATCH, HELD, Core, Settle, drive
from broker.inbox import Inbox
from broker.transport import Transport
from ps_service.io.checkpoint import History, history_path, load_key, snapshot
from ps_service.io.journal import IDLE_BYTES, SNAPSHOT_BYTES, Journal, Recorded, journal_path, recover
from ps_service.io.prometheus import MetricsEndpoint
from ps_service.server.core import ServerCore
from ps_service.site.aggregator import SiteAggregator
from schemas.messages import MessageError, Metrics
from schemas.topics import Inbound, Publish

log = logging.getLogger("edgeps.ps")


LINGER_IDLE_S = 0.1  # after the job's end, the longest wait for a late message
WAIT_NOTE_S = 15.0  # while the job waits for its start quorum, say so this often
#: The server's inbox: at most this many messages (and bytes) received and not yet processed; the
#: rest waits in the broker (MQTT 5 Receive Maximum, and TCP flow control under MQTT 3.1.1).
INBOX_MESSAGES = 256
INBOX_BYTES = 64 << 20


def default_key_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".key")


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
    key = checkpoint_key
    if checkpoint is not None and key is None:
        key = load_key(default_key_path(checkpoint), create=not checkpoint.exists())
    turns = _Turns(core, clock, checkpoint, key, endpoint, on_metrics)
    try:
        outgoing = turns.begin()
        # The persistent session may hold an earlier process's subscriptions (a muted device's commit
        # topic, or grad/+): name every commit topic it may hold once, then narrow down to ours.
        known = [core.topics.grad(d) for d in sorted(core.registry.devices())]
        if core.config.sites_only:  # not even for a moment: beside the workers' shared one, it would take copies
            transport.unsubscribe([core.topics.all_grad, *known])
        else:
            transport.subscribe_only([*core.subscriptions(), core.topics.all_grad, *known])
        transport.subscribe_only(core.subscriptions())  # before publishing: a control follows its subscription
        for event in core.events.take():
            log.log(event.level, event.message)
        for message in outgoing:
            transport.publish(message)
        turns.show(outgoing)

        def run(**limits: Any) -> None:  # the driver, with what the server does around its turns
            before, after = turns.before_publish, turns.after_turn
            drive(
                turns.driven,
                transport,
                clock,
                stop,
                before_publish=before,
                after_turn=after,
                log=log,
                **limits,
            )

        run()
        if stop is not None and stop.is_set():
            return
        # The job is over: refuse (and count) late commits for a moment so that devices leave cleanly.
        until, idle = clock() + linger_s, LINGER_IDLE_S
        run(until=until, idle_s=idle)
    finally:
        turns.close()


class _Turns:
    """What the server does around ``drive``'s turns: its checkpoint before a turn's results leave
    (the turn's record in the journal; a snapshot now and then: ps_service.io.journal), the newest
    metrics on ``/metrics``, each new metrics record to ``on_metrics``, and a note while the job
    waits for its start quorum."""

    def __init__(
        self,
        core: ServerCore,
        clock: Callable[[], float],
        checkpoint: Path | None,
        key: bytes | None,
        endpoint: MetricsEndpoint | None,
        on_metrics: Callable[[Metrics], None] | None,
    ) -> None:
        self.core, self.clock, self.checkpoint, self.key = core, clock, checkpoint, key
        self.endpoint, self.on_metrics = endpoint, on_metrics
        self.seen, self.noted = 0, clock()
        self.recorded = Recorded(core) if checkpoint is not None else None
        self.driven: Core = self.recorded or core  # what the driver runs
        self.journal = Journal(journal_path(checkpoint), key) if checkpoint is not None and key is not None else None
        self.history = History(history_path(checkpoint)) if checkpoint is not None else None
        self.number = 0  # the journal's id: the snapshot on disk names it

    def begin(self) -> list[Publish]:
        """Start the job, or resume it from its checkpoint and journal; what goes out first."""
        core, checkpoint, clock = self.core, self.checkpoint, self.clock
        if checkpoint is not None and checkpoint.exists():
            assert self.key is not None
            self.number, replayed = recover(core, checkpoint, clock(), self.key, self.history)
            job, run, version = core.config.job, core.run, core.store.version
            again = f", {replayed} messages of its journal made again" if replayed else ""
            log.info("resumed job %s (run %d) from %s at version %d%s", job, run, checkpoint, version, again)
            outgoing = core.resume(clock())
        else:
            outgoing = core.start(clock())
        if self.journal is not None:
            self.save().result()
        return outgoing

    def save(self) -> Future[None]:
        """A snapshot of the whole state (its metrics history's new records appended beside it), and a
        fresh journal after it: the state encoded now, both written on the journal's thread (after the
        records before them); done once both are on disk."""
        assert self.checkpoint is not None and self.key is not None and self.journal is not None
        assert self.recorded is not None and self.history is not None
        self.number += 1
        state = snapshot(self.core, self.checkpoint, self.clock(), self.key, self.number, self.history)
        self.recorded.take()  # in the snapshot
        return self.journal.restart(self.number, state.write)

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None

    def show(self, messages: list[Publish]) -> None:
        """The newest metrics record on /metrics."""
        for message in messages:
            if self.endpoint is not None and message.topic == self.core.topics.metrics:
                try:
                    self.endpoint.update(Metrics.from_bytes(message.payload))
                except MessageError as exc:  # never: metrics are built finite; but not worth a crash
                    log.error("metrics record not shown on /metrics: %s", exc)

    def before_publish(self, batch: list[Inbound], out: list[Publish]) -> Settle | None:
        """The state a turn led to is on disk before its results leave and its messages are acknowledged:
        the turn in the journal (an idle turn's ticks kept for the next record), or a new snapshot.
        The record is synced on the journal's thread: the driver waits for it (``Settle``) before the
        turn's results leave, and may process the next turn's messages meanwhile."""
        settle: Settle | None = None
        if self.journal is not None and self.recorded is not None:
            if self.journal.size >= SNAPSHOT_BYTES:
                settle = self.save()
            elif batch or out or len(self.recorded.calls) >= IDLE_BYTES:
                settle = self.journal.write(batch, self.recorded.take())
        self.show(out)
        return settle

    def after_turn(self) -> None:
        core = self.core
        if self.on_metrics is not None:
            for metrics in core.history[self.seen :]:
                self.on_metrics(metrics)
            self.seen = len(core.history)
        if not core.round.quorum and self.clock() - self.noted >= WAIT_NOTE_S:  # a silent wait looks like a hang
            self.noted = self.clock()
            online, job = len(core.registry.active()), core.config
            log.info("waiting for %d devices to start job %s (%d online)", job.min_devices, job.job, online)


def connect_server(core: ServerCore, broker: BrokerAddress, timeout: float = 10.0) -> MqttTransport:
    """An MQTT transport subscribed to what the server consumes (``ServerCore.subscriptions``): MQTT 5
    where the broker speaks it (commands may then carry response topics and correlation data), else 3.1.1. Its
    inbox is bounded (``INBOX_MESSAGES``, ``INBOX_BYTES``): under overload the backlog stays in
    the broker and the server's memory stays flat."""
    inbox = Inbox(INBOX_MESSAGES, INBOX_BYTES, in_hand=(HELD + 1) * BATCH)  # held turns and the turn in hand
    return connect(broker, f"edgeps-ps-{core.config.job}", core.subscriptions(), timeout, inbox=inbox)


#: How often a site aggregator logs what it forwarded (its devices are not visible at the core).
SITE_REPORT_S = 30.0


def serve_site(
    aggregator: SiteAggregator, transport: Transport, stop: threading.Event, report_s: float = SITE_REPORT_S
) -> None:
    """Drive a site aggregator until ``stop``. A device's commit is acknowledged to the site broker
    only once the site commit holding it is acknowledged by the broker (or it was refused): an
    aggregator that dies loses nothing, and the broker delivers what it held to the next one. Its
    subscriptions follow ``SiteAggregator.subscriptions`` after every turn (the commit topics of
    its devices, none of a muted one)."""
    clock = time.monotonic
    reported = clock()

    def after_turn() -> None:
        nonlocal reported
        if clock() - reported >= report_s:
            reported = clock()
            log.info("site %s: %s", aggregator.config.site, site_report(aggregator))

    # the persistent session may hold an earlier process's commit subscriptions (grad/+, a muted device's)
    transport.unsubscribe(aggregator.all_commit_topics())
    transport.subscribe_only(aggregator.subscriptions())
    drive(aggregator, transport, clock, stop, confirmed=True, after_turn=after_turn, log=log)
    log.info("site %s: %s", aggregator.config.site, site_report(aggregator))


def site_report(aggregator: SiteAggregator) -> str:
    """What a site aggregator did so far, in one line."""
    stats = aggregator.stats
    refused = dict(sorted(aggregator.report.traffic.rejected.items()))
    received = f"{stats['commits']} commits received ({stats['bytes_in']} bytes)"
    sent = f"{stats['forwarded']} forwarded in {stats['site_commits']} site commits ({stats['bytes_up']} bytes up)"
    return f"{received}, {sent}; refused: {refused or 'none'}"
