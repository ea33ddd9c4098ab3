"""One driver for every role: a sans-IO core run over a transport on a real clock.

The server, a site aggregator and a device each have a core that never touches a socket or the
clock; ``drive`` is the one loop that feeds it. A turn: sleep until the core's next deadline or
a message (``Transport.receive_many``), let time pass (``on_tick``), hand over each message of the batch
(``receive``), let the core work (``after_batch``), make its subscriptions what it says, publish
what it returned, and acknowledge what it is done with (``acknowledge``). Each role's adapter
(``ps_service.io.mqtt``, ``edge_client.mqtt``) supplies what only it does around a turn: the
server's checkpoint before publishing, a device's emulated step time.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

from broker.transport import Transport
from schemas.events import Events
from schemas.topics import Inbound, Publish

#: Inbound messages handled in one turn (the server checkpoints once per turn).
BATCH = 64
#: Turns with messages whose state is being made durable while the next ones are processed, at
#: most (the server's journal: its thread takes the GIL to start a write and again when the write
#: returns, each time up to a switch interval after asking, while the driver is busy; a snapshot
#: holds the records after it for 5-35 ms). A held turn finishes as soon as its state is durable;
#: the driver waits only when more are held. Their messages are unacknowledged meanwhile: the
#: server's Receive Maximum counts (HELD + 1) * BATCH of them beside its inbox
#: (``broker.inbox.Inbox.in_hand``), so that the broker goes on sending while they are held.
HELD = 8
#: The longest sleep of a turn: how soon a stop request is seen.
IDLE_S = 0.25


class Core(Protocol):
    """What a driver runs: a role's core behind one call shape."""

    events: Events  # what happened, for the driver to log

    @property
    def done(self) -> bool:
        """Whether the role's work is over (its job finished)."""

    def receive(self, message: Inbound, now: float) -> list[Publish]:
        """One inbound message; never raises."""

    def on_tick(self, now: float) -> list[Publish]:
        """Time passes (before a turn's messages): timers, deadlines, resends."""

    def after_batch(self, now: float) -> list[Publish]:
        """After a turn's messages: what is due once they are in (a site commit, a device's step)."""

    def next_deadline(self) -> float | None:
        """When ``on_tick`` or ``after_batch`` next has something to do (None: only a message)."""

    def subscriptions(self) -> list[str]:
        """The topics the core listens to now."""

    def resubscriptions(self) -> list[str]:
        """Topics whose retained message the core needs again (subscribed to afresh)."""

    def acknowledge(self, batch: list[Inbound]) -> list[Inbound]:
        """Of this turn's ``batch`` and earlier ones, the messages the core is done with: to be
        acknowledged to the broker."""


def coalesce(messages: list[Publish]) -> list[Publish]:
    """``messages`` with only the last of each retained topic, where it stands: a retained message
    is state (the barrier, a device's control, the newest snapshot), and a subscriber that sees only
    a turn's last one is where one that subscribes after the turn would be. Under load a batch
    of 64 commits makes one barrier message instead of 64."""
    last = {m.topic: i for i, m in enumerate(messages) if m.retain}
    return [m for i, m in enumerate(messages) if not m.retain or last[m.topic] == i]


class Settle(Protocol):
    """What ``before_publish`` may return: the turn's state being made durable (a
    ``concurrent.futures.Future`` is one). The driver waits for it (``result``) before the turn's
    results leave; a turn that had messages first lets the next turns' work run."""

    def done(self) -> bool:
        """Whether the state is durable (or making it so failed: ``result`` then raises)."""

    def result(self) -> object:
        """Wait until the state is durable; raises what making it so raised."""


def drive(
    core: Core,
    transport: Transport,
    clock: Callable[[], float],
    stop: threading.Event | None = None,
    *,
    until: float | None = None,
    idle_s: float = IDLE_S,
    confirmed: bool = False,
    before_publish: Callable[[list[Inbound], list[Publish]], Settle | None] | None = None,
    after_turn: Callable[[], None] | None = None,
    log: logging.Logger,
) -> None:
    """Run ``core`` until it is ``done`` (or ``stop`` is set, or ``clock()`` reaches ``until``).

    ``confirmed``: a settled message is acknowledged only once the broker acknowledged what was
    published with it (a site aggregator: a device's commit is let go only once the site commit
    holding it is with the broker). ``before_publish(batch, out)``: what the role does before a
    turn's results leave (the server's checkpoint), returning None when that is done or a
    ``Settle``: then a turn that had messages is held while the next turns (what came meanwhile, if
    anything: it does not wait for more) are processed, and publishes and acknowledges once it is
    settled, before the next turn's results (its results never leave, nor are its messages
    acknowledged, before its state is durable): as soon as it is, or, with ``HELD`` turns after it,
    after waiting for it. A turn without messages lets every held turn finish first, or, when it
    has nothing of its own to publish, the first (the next turn looks for messages again).
    ``after_turn``: what it does after."""
    unacked: list[Inbound] = []
    held: deque[tuple[list[Inbound], list[Publish], Settle]] = deque()  # turns whose state is being made durable

    def running() -> bool:
        if stop is not None and stop.is_set():
            return False
        return not core.done if until is None else clock() < until

    def finish(batch: list[Inbound], out: list[Publish], settle: Settle | None = None) -> None:
        """A turn's end: its state durable, the subscriptions, its results out, its messages acknowledged."""
        nonlocal unacked
        if settle is not None:
            settle.result()
        transport.subscribe_only(core.subscriptions())  # before publishing: a control follows its subscription
        again = core.resubscriptions()
        if again:
            transport.resubscribe(again)
        for publish in coalesce(out):
            transport.publish(publish)
        unacked += core.acknowledge(batch)
        if unacked and (not confirmed or transport.wait_acknowledged(idle_s if out and running() else 0.0)):
            transport.ack_many(unacked)
            unacked = []
        if after_turn is not None:
            after_turn()

    while running():
        due = core.next_deadline()
        wait = 0.0 if held else idle_s if due is None else min(idle_s, max(0.0, due - clock()))
        if until is not None:
            wait = min(wait, max(0.0, until - clock()))
        batch = transport.receive_many(wait, BATCH)
        out = core.on_tick(clock())
        for message in batch:
            out += core.receive(message, clock())
        out += core.after_batch(clock())
        for event in core.events.take():  # what the core had to say about the turn
            log.log(event.level, event.message)
        settle = before_publish(batch, out) if before_publish is not None else None
        if settle is not None and batch and running():
            held.append((batch, out, settle))  # the next turns' processing overlaps this turn's sync
            while held and (len(held) > HELD or held[0][2].done()):  # in order: the first held first
                finish(*held.popleft())
        elif held and not batch and not out and settle is None and running():
            finish(*held.popleft())  # the inbox ran dry: wait for the first held turn only, then look again
        else:
            while held:
                finish(*held.popleft())
            finish(batch, out, settle)
    while held:  # the loop ended: a held turn's state is durable once settled, and what it says goes out
        finish(*held.popleft())
