"""The site aggregator (``edgeps aggregator --site S``): beside a site broker, it sums its devices'
commits into site commits, one upstream message for many commits (docs/SCALING.md).

Sans-IO like the server's core: messages in, messages to publish out, ``now`` given. It checks
each commit as the server would (ps_service.validation: frame, device, sequence number, codec,
shapes, values; ps_service.robust: the norm against the site's other devices), refuses with the
same notices, and holds what it accepts. A site commit goes out when every device of the site in
the round has committed (online, not left past the server's round deadline: the barrier's
``left``), or ``flush_s`` after the first commit it holds: a straggler's commit then goes in a
later one, and the server's round deadline treats it as it would treat the device itself.

Each commit is *settled* (its driver may acknowledge it to the site broker) once it was refused,
or once the site commit holding it was handed out: a driver acknowledges only after the broker
took that site commit, so an aggregator that dies loses nothing, and what the broker delivers
again (``duplicate``) goes up alone, one commit a site commit, so that the server can tell a
copy of what it holds (dropped) from work it never got (taken).

With ``shared`` it is an ingest worker beside the server instead: it reads a share of every
device's commits from an MQTT 5 shared subscription on the core broker and sends a site commit
per batch, one commit a device in each (the server then checks sequence numbers in a window: a
worker's site commit may pass another's), and alone any commit whose device the barrier already
lists as committed for its round (a resend whose first copy another worker had).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ps_service.aggregate import partial
from ps_service.registry import DeviceRegistry
from ps_service.reporting import Report
from ps_service.robust import data_sizes
from ps_service.update import Update
from ps_service.validation import Rejection, validate_commit
from schemas.events import Events
from schemas.frame import FrameError, FrameKind, parse_frame, peek_seq
from schemas.messages import (
    MAX_SAFE_INT,
    MAX_SITE_COMMITS,
    Barrier,
    Control,
    DeviceStatus,
    MessageError,
    Name,
    RejectReason,
    SiteCommit,
    SiteEntry,
)
from schemas.sitecommit import encode_site_commit
from schemas.topics import Publish, Topics

#: How long a commit waits for what it is checked against (the parameters, its device's status and
#: control): after an aggregator's restart the broker may deliver commits before those.
WAIT_S = 10.0


class SiteConfig(BaseModel):
    """A site aggregator's options (``edgeps aggregator``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: Name = Field("job1", description="the job's name")
    site: Name = Field(description="the site's name (its site commits go to edgeps/{job}/part/{site})")
    flush_s: float = Field(
        1.0, gt=0, description="a site commit goes out at the latest this many seconds after its first commit came"
    )
    samples_factor: float = Field(2.0, ge=1, description="as the server's, against the site's median")
    max_device_samples: int | None = Field(None, ge=1, description="as the server's")
    max_commit_rate: float | None = Field(
        1000.0, gt=0, description="as the server's: commits a second a device may send, sustained (0: no limit); "
        "beyond it refused as rate_limited, one notice a second",
    )  # fmt: skip
    max_commit_burst: int = Field(50, ge=1, description="as the server's: commits a device may send at once")
    shared: bool = Field(
        False, description="an ingest worker beside the server: read the job's commits from the shared "
        "subscription $share/edgeps-{job}/edgeps/{job}/grad/+ on the core broker, a site commit per batch",
    )  # fmt: skip


class SiteAggregator:
    """One site's aggregator as a state machine; ``token``: whatever its driver acknowledges a
    message by (an MQTT message id)."""

    def __init__(self, config: SiteConfig) -> None:
        self.config = config
        self.topics = Topics(config.job)
        self.registry = DeviceRegistry(None)
        self.events = Events()
        self.version = 0
        self.run: int | None = None  # the job's run the version belongs to (its parameters' and barrier's)
        self.ended_runs: set[int] = set()  # runs a newer one replaced: their retained messages are ignored
        self.shapes: dict[str, tuple[int, ...]] | None = None
        self.commit_limit = 64 << 20
        self.codecs: dict[str, frozenset[str]] = {}  # each device's accepted codecs, from its control
        self.left: frozenset[str] = frozenset()
        self.finished = False  # the barrier said the job has finished: commits are refused here
        self.committed: tuple[int, frozenset[str]] = (-1, frozenset())  # the barrier's version and committed
        self.sent: dict[str, int] = {}  # each device's newest base version sent up
        self.held: list[tuple[Update, Any]] = []  # accepted, not yet sent up
        self.alone: list[tuple[Update, Any]] = []  # delivered again: each goes up in a site commit of its own
        self.waiting: list[tuple[str, bytes, float, bool, Any]] = []  # (device, payload, since, duplicate, token)
        self.first_at: float | None = None
        self.seq = 0
        self._settled: list[Any] = []
        self.stats: Counter[str] = Counter()  # commits, bytes_in, forwarded, site_commits, bytes_up
        self.report = Report(self.topics, 0.0, self.events)  # its refusals, counted and noticed as the server's

    def subscriptions(self) -> list[str]:
        t = self.topics
        grads = f"$share/edgeps-{self.config.job}/{t.all_grad}" if self.config.shared else t.all_grad
        return [t.all_status, grads, t.params, t.delta, t.barrier, t.ctrl("+")]

    # ----------------------------------------------------------------- events
    def on_message(
        self, topic: str, payload: bytes, now: float, token: Any = None, duplicate: bool = False
    ) -> list[Publish]:
        """One inbound message; never raises. Its token is settled at once unless it is a commit
        held for a site commit."""
        try:
            kind, device = self.topics.parse(topic)
        except ValueError as exc:
            self.events.warning("ignored message on %s: %s", topic, exc)
            self._settled.append(token)
            return []
        if kind == "grad" and device is not None:
            self.stats["commits"] += 1
            self.stats["bytes_in"] += len(payload)
            self.waiting.append((device, payload, now, duplicate, token))
            return self._admit(now)
        try:
            if kind == "status" and device is not None:
                self._on_status(device, payload)
            elif kind == "ctrl" and device is not None and payload:
                control = Control.from_bytes(payload, tolerant=True)
                self.codecs[device] = frozenset({control.codec, *self.codecs.get(device, ())})
            elif kind == "barrier" and payload:
                barrier = Barrier.from_bytes(payload, tolerant=True)
                if self._follow(barrier.run, barrier.version):
                    self.left, self.finished = frozenset(barrier.left), barrier.state == "finished"
                    self.committed = (barrier.version, frozenset(barrier.committed))
            elif kind in ("params", "delta") and payload:
                self._on_params(payload)
        except (MessageError, FrameError) as exc:
            self.events.warning("ignored message on %s: %s", topic, exc)
        self._settled.append(token)
        return self._admit(now)

    def on_tick(self, now: float) -> list[Publish]:
        """Time passes: commits that waited ``WAIT_S`` for what they are checked against are refused."""
        return self._admit(now)

    def _on_status(self, device: str, payload: bytes) -> None:
        if not payload:
            self.registry.set_offline(device)
            return
        status = DeviceStatus.from_bytes(payload)
        if status.device != device:
            raise MessageError(f"status on {device!r} names {status.device!r}")
        if status.state == "offline":
            self.registry.set_offline(device, status.incarnation)
            return
        assert status.incarnation is not None
        self.registry.set_online(device, status.samples, status.incarnation)

    def _on_params(self, payload: bytes) -> None:
        raw = parse_frame(payload)
        if raw.kind == FrameKind.PARAMS and self._follow(raw.seq, raw.base_version):  # a snapshot's seq: its run
            self.shapes = raw.shapes
            self.commit_limit = len(payload) + 64  # the model's fp32 commit with the longest device id
        elif raw.kind == FrameKind.DELTA and self.run is not None:  # deltas follow the run's snapshot
            self.version = max(self.version, raw.base_version)

    def _follow(self, run: int, version: int) -> bool:
        """Take ``version`` of ``run`` as known; False for a run that ended (a retained message a site
        broker kept from an earlier run of the job). A new run starts again from its own version."""
        if run in self.ended_runs:
            return False
        if run != self.run:
            if self.run is not None:
                self.ended_runs.add(self.run)
                self.sent.clear()
                self.events.info("run %d of job %s began: site commits follow it", run, self.config.job)
            self.run, self.version = run, version
        self.version = max(self.version, version)
        return True

    def _admit(self, now: float) -> list[Publish]:
        """Check the commits that can be checked now; refuse those that waited too long."""
        out: list[Publish] = []
        still = []
        for device, payload, since, duplicate, token in self.waiting:
            ready = self.shapes is not None and self.registry.known(device) and device in self.codecs
            if not ready and now - since < WAIT_S:
                still.append((device, payload, since, duplicate, token))
                continue
            try:
                if self.finished:  # as the server would: no bytes up for work no version will take
                    raise Rejection(RejectReason.FINISHED, "the job has finished", peek_seq(payload))
                rate, burst = self.config.max_commit_rate, self.config.max_commit_burst
                if rate is not None and not self.registry.limits(device).commits.take(1, since, rate, burst):
                    raise Rejection(RejectReason.RATE_LIMITED, f"more than {rate:g} commits/s", peek_seq(payload))
                if not ready:
                    raise Rejection(RejectReason.UNKNOWN_DEVICE, "its status, control or the parameters never came",
                                    peek_seq(payload))  # fmt: skip
                assert self.shapes is not None
                update = validate_commit(payload, device, self.registry, MAX_SAFE_INT, self.shapes,
                                         self.commit_limit, self.codecs[device])  # fmt: skip
            except Rejection as rejection:
                if rejection.reason is RejectReason.REPLAYED and self.registry.redelivered(device, rejection.seq):
                    self.report.count(rejection)  # a copy of one it holds or sent: the server's rule
                else:
                    out += self.report.reject(device, rejection, self.registry.record(device), now)
                self._settled.append(token)
                continue
            if update.base_version > self.version:  # it saw the parameters before we did
                self.version = update.base_version
            (self.alone if duplicate or self._again(update) else self.held).append((update, token))
            if self.first_at is None:
                self.first_at = now
        self.waiting = still
        return out

    def _again(self, update: Update) -> bool:
        """Whether ``update`` may be a device's resend of a commit the server holds (§6 of
        docs/PROTOCOL.md: the same bytes after 30 s without a version), which this ingest worker
        did not see: its device is among the barrier's ``committed`` for its round. It then goes up
        alone: a copy is dropped as such, and takes no other device's commit with it."""
        version, committed = self.committed
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
        sent = {device for device, version in self.sent.items() if version >= self.version}
        expected = self.registry.active() - self.left
        late = self.first_at is not None and now >= self.first_at + self.config.flush_s
        return expected <= held | sent or late

    def next_deadline(self) -> float | None:
        """When a site commit or a waiting commit's refusal is next due (None: nothing held)."""
        times = [since + WAIT_S for _, _, since, _, _ in self.waiting]
        if self.first_at is not None:
            times.append(self.first_at + self.config.flush_s)
        return min(times, default=None)

    def flush(self, now: float) -> list[Publish]:
        """The site commits due (each commit delivered again in one of its own; what is held when
        ``due``, up to ``MAX_SITE_COMMITS`` devices' commits) and the notices of outliers; the
        tokens of the commits in them are settled."""
        out = [m for held in self.alone for m in self._site_commit([held])]
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
            out += self._site_commit(taken)
            self.first_at = now if self.held else None
            if not self.config.shared:
                break
        return out

    def _site_commit(self, held: list[tuple[Update, Any]]) -> list[Publish]:
        """The site commit of ``held`` (and a notice to each outlier refused from it)."""
        updates = [u for u, _ in held]
        self._settled += [token for _, token in held]
        refused: set[str] = set()
        detail = "its update is far from the site's other devices' (ps_service.robust): not applied"
        out = [notice for u in updates if u.device in refused
               for notice in self.report.reject(u.device, Rejection(RejectReason.OUTLIER, detail, u.seq), None,
                                                None)]  # fmt: skip
        updates = [u for u in updates if u.device not in refused]
        if not updates:
            return out
        c = self.config
        sizes = data_sizes(updates, self.registry.sizes(), c.samples_factor, c.max_device_samples)
        part = partial(updates, self.version, sizes)
        entries = []
        for device in dict.fromkeys(u.device for u in updates):
            mine = [u for u in updates if u.device == device]
            entries.append(SiteEntry(device=device, seq=max(u.seq for u in mine),
                                     base_version=min(u.base_version for u in mine),
                                     samples=sum(u.samples for u in mine),
                                     steps=sum(u.steps for u in mine)))  # fmt: skip
        self.seq += 1
        header = SiteCommit(site=c.site, seq=self.seq, version=self.version, data=part.data,
                            spread=part.spread, commits=entries)  # fmt: skip
        weighted = {name: np.asarray(values, np.float32) for name, values in part.weighted.items()}
        payload = encode_site_commit(header, weighted)
        self.stats["site_commits"] += 1
        self.stats["forwarded"] += len(updates)
        for update in updates:
            self.sent[update.device] = max(update.base_version, self.sent.get(update.device, -1))
        self.stats["bytes_up"] += len(payload)
        return [*out, Publish(self.topics.part(c.site), payload, qos=1)]

    def settled(self) -> list[Any]:
        """The tokens settled since the last call (to acknowledge, once what was published with
        them is acknowledged by the broker)."""
        taken, self._settled = self._settled, []
        return taken
