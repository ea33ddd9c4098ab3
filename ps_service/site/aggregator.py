"""The site aggregator (``edgeps aggregator --site S``): beside a site broker, it sums its devices'
commits into site commits, one upstream message for many commits (docs/SCALING.md).

Sans-IO like the server's core: messages in, messages to publish out, ``now`` given. Its commits
come through the server's own door (ps_service.door: the same checks in the same order, the
same notices, the same rate limits and mutes, the same memory budget), so that a commit gets the
same verdict at a site as at the server. What it takes it sums with the server's bounds, read off
the barrier (``max_norm``: each device's update per step clipped to it; ``max_weight``: each
device's data size bounded by it), and sends up with each device's stated weight and norm, which
the server checks against the sums and bounds again (docs/PROTOCOL.md §4, "Site commits"). A
site commit goes out when every device of the site in the round has committed (online, not left
past the server's round deadline: the barrier's ``left``), or ``flush_s`` after the first commit
it holds: a straggler's commit then goes in a later one.

Each commit is *settled* (its driver may acknowledge it to the site broker) once it was refused,
or once the site commit holding it was handed out: a driver acknowledges only after the broker
took that site commit, so an aggregator that dies loses nothing, and what the broker delivers
again (``duplicate``) goes up alone, one commit a site commit, so that the server can tell a
copy of what it holds (dropped) from work it never got (taken). No input makes it fail: a message
it cannot process is refused (``unprocessable``), settled and counted.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any, NamedTuple

from ps_service.door import Checks, Door, Refusal, finished
from ps_service.registry import DeviceRegistry
from ps_service.reporting import Report
from ps_service.site.config import SiteConfig
from ps_service.site.sums import site_commit
from ps_service.site.view import JobView
from ps_service.update import Update
from ps_service.validation import Rejection
from schemas.events import Events
from schemas.frame import peek_base_version, peek_seq
from schemas.messages import Barrier, Control, RejectReason
from schemas.sitecommit import MAX_SITE_COMMITS
from schemas.topics import Inbound, Publish, Topics

#: How long a commit waits for what it is checked against (the parameters of its base version, its
#: device's status and control): after an aggregator's restart the broker may deliver commits first.
WAIT_S = 10.0


class Waiting(NamedTuple):
    """A commit that came before what it is checked against."""

    device: str
    payload: bytes
    seq: int | None  # as peek_seq read it on arrival
    since: float
    duplicate: bool
    token: Any


class SiteAggregator:
    """One site's aggregator as a state machine; ``token``: whatever its driver acknowledges a
    message by (an MQTT message id)."""

    def __init__(self, config: SiteConfig) -> None:
        self.config = config
        self.topics = Topics(config.job)
        self.registry = DeviceRegistry(config.allowed_devices)
        self.door = Door(config.door, self.registry)
        self.events = Events()
        self.job = JobView()  # what it knows of the job, from the server's broadcasts
        self.sent: dict[str, int] = {}  # each device's newest base version sent up
        self.held: list[tuple[Update, Any]] = []  # accepted, not yet sent up
        self.alone: list[tuple[Update, Any]] = []  # delivered again: each goes up in a site commit of its own
        self.waiting: list[Waiting] = []
        self.first_at: float | None = None
        self.seq = 0
        self._settled: list[Any] = []
        self.stats: Counter[str] = Counter()  # commits, bytes_in, forwarded, site_commits, bytes_up
        self.report = Report(self.topics, 0.0, self.events)  # its refusals, counted and noticed as the server's

    def subscriptions(self) -> list[str]:
        """Statuses, the job's broadcasts, controls, and the commit topic of each device of
        ``allowed_devices`` or whose status it saw, but those it mutes (``DeviceRegistry.listening``,
        the server's rule; shared subscriptions for an ingest worker)."""
        t = self.topics
        share = f"$share/edgeps-{self.config.job}/" if self.config.shared else ""
        commits = [share + t.grad(d) for d in self.registry.listening()]
        return [t.all_status, t.params, t.delta, t.barrier, t.ctrl("+"), *commits]

    def all_commit_topics(self) -> list[str]:
        """Every commit subscription an earlier process of this aggregator may have left in its session."""
        share = f"$share/edgeps-{self.config.job}/" if self.config.shared else ""
        t = self.topics
        return [share + t.all_grad, t.all_grad, *(share + t.grad(d) for d in sorted(self.registry.devices()))]

    # ----------------------------------------------------------------- events
    def on_message(
        self,
        topic: str,
        payload: bytes,
        now: float,
        token: Any = None,
        duplicate: bool = False,
        retained: bool = False,
    ) -> list[Publish]:
        """One inbound message; never raises. Its token is settled at once unless it is a commit
        held for a site commit."""
        try:
            kind, device = self.topics.parse(topic)
        except ValueError as exc:
            self.events.warning("ignored message on %s: %s", topic, exc)
            self._settled.append(token)
            return []
        try:
            if kind == "grad" and device is not None:
                return self._on_commit(device, payload, now, duplicate, token, retained)
            if kind == "status" and device is not None:
                self._on_status(device, payload, now)
            elif kind == "ctrl" and device is not None and payload:
                self.job.on_control(device, Control.from_bytes(payload, tolerant=True))
            elif kind == "barrier" and payload:
                self._news(self.job.on_barrier(Barrier.from_bytes(payload, tolerant=True)))
            elif kind in ("params", "delta") and payload:
                self._news(self.job.on_params(payload))
        except Exception as exc:  # a message it cannot read is ignored (a bug: logged), never a crash
            self.events.warning("ignored message on %s: %s: %s", topic, type(exc).__name__, exc)
        self._settled.append(token)
        return self._safely(self._admit, now)

    def on_tick(self, now: float) -> list[Publish]:
        """Time passes: mutes end; commits that waited ``WAIT_S`` for what they are checked against
        are refused."""
        for device in self.registry.unmute_due(now):
            self.events.info("listening to device %s again", device)
        return self._safely(self._admit, now)

    def _safely(self, step: Any, now: float) -> list[Publish]:
        """``step(now)``, which never fails on input; a bug in it is logged, not a crash loop."""
        try:
            out: list[Publish] = step(now)
            return out
        except Exception:
            self.events.error("failed: %s", traceback.format_exc())
            return []

    def _on_commit(
        self, device: str, payload: bytes, now: float, duplicate: bool, token: Any, retained: bool
    ) -> list[Publish]:
        """A commit: screened on arrival (retained, finished, rate limits, room: ps_service.door),
        then checked now or once what it is checked against has come."""
        self.stats["commits"] += 1
        self.stats["bytes_in"] += len(payload)
        seq = peek_seq(payload)
        refusal = self.door.screen(device, payload, now, self._checks(), retained, seq)
        if refusal is not None:
            return self._refused(device, refusal, now, token)
        self.door.hold(device, len(payload))
        self.waiting.append(Waiting(device, payload, seq, now, duplicate, token))
        return self._safely(self._admit, now)

    def _on_status(self, device: str, payload: bytes, now: float) -> None:
        status = self.door.read_status(device, payload, now)  # as the server reads it (which notices a refusal)
        if isinstance(status, Rejection):
            if status.reason is not RejectReason.RATE_LIMITED:
                self.events.warning("ignored status of %s: %s", device, status.detail)
        elif status is None or status.state == "offline":
            self.registry.set_offline(device, None if status is None else status.incarnation)
        else:
            assert status.incarnation is not None
            self.registry.set_online(device, status.samples, status.incarnation)

    def _news(self, new_run: int | None) -> None:
        """A new run of the job began (``JobView``): what was sent up for the last one is forgotten."""
        if new_run is not None:
            self.sent.clear()
            self.events.info("run %d of job %s began: site commits follow it", new_run, self.config.job)

    def _checks(self) -> Checks:
        return Checks(self.job.version, self.job.shapes or {}, frozenset(), self.job.finished)

    def _ready(self, waiting: Waiting) -> bool:
        """Whether what ``waiting`` is checked against has come: the model, its device's status and
        control, and the version it is based on (a commit is never based on a version not yet
        published, so its parameters are on their way to this aggregator too)."""
        base = peek_base_version(waiting.payload)
        return self._known(waiting.device) and (base is None or base <= self.job.version)

    def _known(self, device: str) -> bool:
        """Whether the model, ``device``'s status and its control have come."""
        return self.job.shapes is not None and self.registry.known(device) and device in self.job.codecs

    def _admit(self, now: float) -> list[Publish]:
        """Check the commits that can be checked now; refuse those that waited too long."""
        out: list[Publish] = []
        still = []
        for waiting in self.waiting:
            ready = self._ready(waiting)
            if not ready and now - waiting.since < WAIT_S:
                still.append(waiting)
                continue
            device, payload = waiting.device, waiting.payload
            self.door.release(device, len(payload))
            if self.job.finished:  # as the server would: no bytes up for work no version will take
                out += self._refused(device, Refusal(finished(waiting.seq)), now, waiting.token)
                continue
            if not ready and not self._known(device):
                out += self._refused(device, Refusal(self._never_came(waiting)), now, waiting.token)
                continue
            checks = Checks(self.job.version, self.job.shapes or {}, self.job.codecs[device], self.job.finished)
            update = self.door.check(device, payload, checks, waiting.seq)
            if isinstance(update, Refusal):
                out += self._refused(device, update, now, waiting.token)
                continue
            self.door.hold_updates([update])
            (self.alone if waiting.duplicate or self._again(update) else self.held).append((update, waiting.token))
            if self.first_at is None:
                self.first_at = now
        self.waiting = still
        return out

    def _never_came(self, waiting: Waiting) -> Rejection:
        """Why a commit whose device or model never came here in ``WAIT_S`` is refused. (One whose
        version never came is checked as it stands: ``future_version``, its number used, as the
        server does.)"""
        return Rejection(RejectReason.UNKNOWN_DEVICE, "its status, control or the parameters never came", waiting.seq)

    def _refused(self, device: str, refusal: Refusal, now: float, token: Any) -> list[Publish]:
        """A refused commit: settled, counted, noticed (but a redelivered copy: counted only)."""
        self._settled.append(token)
        return self.report.refused(device, refusal, self.registry.record(device), now)

    def _again(self, update: Update) -> bool:
        """Whether ``update`` may be a device's resend of a commit the server holds (§6 of
        docs/PROTOCOL.md: the same bytes after 30 s without a version), which this ingest worker
        did not see: its device is among the barrier's ``committed`` for its round. It then goes up
        alone: a copy is dropped as such, and takes no other device's commit with it."""
        version, committed = self.job.committed
        return self.config.shared and update.device in committed and update.base_version <= version

    # ----------------------------------------------------------------- flushing
    def due(self, now: float) -> bool:
        """Whether the commits held should go up now: every device the round expects has committed
        (online, not left), ``MAX_SITE_COMMITS`` devices have, or ``flush_s`` has passed."""
        if not self.held:
            return False
        if self.config.shared:  # an ingest worker sees a share of every round: a site commit per batch
            return True
        held = {u.device for u, _ in self.held}
        if len(held) >= MAX_SITE_COMMITS:
            return True
        # who has committed on the newest version: what is held, and what already went up (a site of more
        # than MAX_SITE_COMMITS devices sends a round in several site commits)
        sent = {device for device, version in self.sent.items() if version >= self.job.version}
        expected = self.registry.active() - self.job.left
        late = self.first_at is not None and now >= self.first_at + self.config.flush_s
        return expected <= held | sent or late

    def next_deadline(self) -> float | None:
        """When a site commit, a waiting commit's refusal or a mute's end is next due (None: nothing)."""
        times = [w.since + WAIT_S for w in self.waiting]
        if self.first_at is not None:
            times.append(self.first_at + self.config.flush_s)
        unmute = self.registry.next_unmute()
        return min([*times, *([unmute] if unmute is not None else [])], default=None)

    def flush(self, now: float) -> list[Publish]:
        """The site commits due (each commit delivered again in one of its own; what is held when
        ``due``, up to ``MAX_SITE_COMMITS`` devices' commits); the tokens of the commits in them are
        settled. Never raises: commits it fails to sum are refused (``unprocessable``)."""
        out = [m for held in self.alone for m in self._site_commit([held], now)]
        self.alone = []
        while self.due(now):
            devices = sorted({u.device for u, _ in self.held})[:MAX_SITE_COMMITS]
            if self.config.shared:  # one commit a device, the oldest: the server checks each one's number,
                first: dict[str, int] = {}  # out of order (a worker's site commit may pass another's)
                for i, (update, _) in enumerate(self.held):
                    first.setdefault(update.device, i)
                picked = {first[d] for d in devices}
            else:
                picked = {i for i, (update, _) in enumerate(self.held) if update.device in devices}
            taken = [h for i, h in enumerate(self.held) if i in picked]
            self.held = [h for i, h in enumerate(self.held) if i not in picked]
            out += self._site_commit(taken, now)
            self.first_at = now if self.held else None
            if not self.config.shared:
                break
        return out

    def _site_commit(self, held: list[tuple[Update, Any]], now: float) -> list[Publish]:
        """The site commit of ``held``, or, should summing them fail (a bug), each refused."""
        updates = [u for u, _ in held]
        self.door.release_updates(updates)
        self._settled += [token for _, token in held]
        try:
            max_norm, max_weight = self.job.bounds()
            sizes, refused = self.registry.sizes(), dict(self.report.traffic.rejected)
            at = (self.config.site, self.seq + 1, self.job.version)
            payload = site_commit(*at, updates, sizes, max_norm, max_weight, refused)
        except Exception as exc:
            self.events.error("site commit of %d commits failed: %s", len(updates), traceback.format_exc())
            out: list[Publish] = []
            for u in updates:
                why = Rejection(RejectReason.UNPROCESSABLE, f"the aggregator failed: {type(exc).__name__}", u.seq)
                out += self.report.reject(u.device, why, None, None)
            return out
        self.seq += 1
        self.stats["site_commits"] += 1
        self.stats["forwarded"] += len(updates)
        self.stats["bytes_up"] += len(payload)
        for update in updates:
            self.sent[update.device] = max(update.base_version, self.sent.get(update.device, -1))
        return [Publish(self.topics.part(self.config.site), payload, qos=1)]

    # ------------------------------------------------- the driver's call shape (broker.driver.Core)
    @property
    def done(self) -> bool:
        return False  # an aggregator runs until it is stopped

    def receive(self, message: Inbound, now: float) -> list[Publish]:
        """``on_message`` for a message as a transport received it (the message is its token)."""
        return self.on_message(message.topic, message.payload, now, message, message.duplicate, message.retain)

    def after_batch(self, now: float) -> list[Publish]:
        return self.flush(now)

    def resubscriptions(self) -> list[str]:
        return []

    def acknowledge(self, batch: list[Inbound]) -> list[Inbound]:
        return list(self.settled())  # whatever turn they came in

    def settled(self) -> list[Any]:
        """The tokens settled since the last call (a commit once the site commit holding it went out,
        or it was refused): to acknowledge once the broker took what was published with them."""
        taken, self._settled = self._settled, []
        return taken
