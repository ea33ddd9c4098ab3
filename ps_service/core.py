"""The sans-IO parameter server: decoded-or-raw messages in, messages to publish out.

It never touches a socket or the clock: every event carries ``now`` (seconds, from any
epoch), and every method returns the ``Publish`` list its driver must send. The core wires
its parts: admission of commits (ps_service.validation, the registry's rate limits), the
round (ps_service.round), the pace, aggregation and broadcast, the operator's commands
(ps_service.commands), reporting (ps_service.reporting) and checkpoint state
(ps_service.state).
"""

from __future__ import annotations

import math
import secrets
import traceback
from typing import Any

from learning.model import Params
from ps_service import admission, commands, reporting, state, versions
from ps_service.broadcast import Broadcaster
from ps_service.config import ServerConfig
from ps_service.door import Checks, Door
from ps_service.evaluator import Evaluator
from ps_service.frequency import Bounds, FrequencyController, make_policy
from ps_service.membership import Membership
from ps_service.paces import make_pace
from ps_service.registry import DeviceRegistry
from ps_service.reporting import Report, Traffic
from ps_service.robust import FleetBounds
from ps_service.round import JobState, Round, drop_late, round_due
from ps_service.stepguard import StepGuard
from ps_service.store import ParameterStore
from ps_service.validation import Rejection
from schemas.events import Events
from schemas.frame import peek_seq
from schemas.messages import (
    MAX_SAFE_INT,
    Barrier,
    Control,
    Metrics,
    RejectReason,
)
from schemas.topics import Publish, Topics

#: How often at most the barrier goes out for changes no device acts on (ServerCore.barrier).
BARRIER_DETAIL_S = 1.0


def new_run() -> int:
    """A random id for a new run of a job (1 .. 2**53 - 1)."""
    return 1 + secrets.randbelow(MAX_SAFE_INT)


class ServerCore:
    """One training job's parameter server as a state machine.

    ``run`` names this run of the job (a fresh server starts a new one; a server restored from
    its checkpoint keeps the saved one): devices that hold another run's parameters start again
    from this one's."""

    def __init__(
        self,
        config: ServerConfig,
        params: Params,
        evaluator: Evaluator,
        now: float = 0.0,
        artifact: bytes | None = None,
        run: int | None = None,
        columns: str | None = None,
    ) -> None:
        self.config = config
        self.artifact = artifact  # the devices' TFLite trainer (schemas/artifact.py), published retained
        self.columns = columns  # the fingerprint of the data's columns and scaling, told devices (Control)
        self.topics = Topics(config.job)
        self.run = run if run is not None else new_run()
        self.store = ParameterStore(params)
        self.broadcaster = Broadcaster(self.topics, config.pull_codec, run=self.run)
        self.codec = config.codec  # the commit codec; operators may change it during a run
        self.previous_codec = config.codec  # still accepted: commits in flight when it changed
        self.pace = make_pace(config.pace)
        self.registry = DeviceRegistry(config.allowed_devices)
        # every commit comes through it; with ingest workers, whose site commits may pass one another,
        # sequence numbers are checked against an anti-replay window
        self.door = Door(config.door, self.registry, ordered=not config.sites_only)
        self.weight_cap_cache: tuple[int, float] = (-1, math.inf)  # (registry generation, cap): versions.weight_cap
        self.membership = Membership()  # who rounds wait for
        self.bounds = FleetBounds(config.clip_factor)  # each device's update against the fleet's
        self.evaluator = evaluator
        self.frequency = FrequencyController(
            make_policy(config.frequency, config.push_every),
            Bounds(config.push_every_min, max(config.push_every_min, config.push_every_max)),
            config.balance,
        )
        self.round = Round(started=now, opened=now)
        self.events = Events()  # what happened, for the driver to log
        self.report = Report(self.topics, now, self.events)
        self.unbroadcast = 0  # versions applied since the last parameter broadcast
        self.server_step = 1.0  # the last aggregate's step: 1 plain averaging, more extrapolated
        self.step_guard = StepGuard()  # extrapolation held back while the held-out loss rises
        self.last_broadcast: list[Publish] = []  # the newest version's parameter messages
        self._barrier_sent: tuple[Any, ...] | None = None  # what the last barrier said that devices act on
        self._barrier_at = -math.inf  # when the last barrier went out
        self._barrier_bytes = b""  # and what it said
        self._barrier_due: float | None = None  # when a barrier with changes no device acts on goes out

    # ----------------------------------------------------------------- views
    @property
    def finished(self) -> bool:
        return self.round.finished

    @property
    def paused(self) -> bool:
        return self.round.state is JobState.PAUSED

    @property
    def commit_limit(self) -> int:
        """The largest commit accepted (ps_service.door)."""
        return self.door.commit_limit(self.store.shapes)

    def checks(self) -> Checks:
        """What a commit is checked against: the version, the model, the codecs in force."""
        return Checks(
            self.store.version, self.store.shapes, frozenset({self.codec, self.previous_codec}), self.finished
        )

    @property
    def traffic(self) -> Traffic:
        return self.report.traffic

    @property
    def history(self) -> list[Metrics]:
        return self.report.history

    def barrier_set(self) -> frozenset[str]:
        """Devices the next aggregate waits for: online, not left (past a deadline, or released)."""
        return self.membership.barrier(self.registry.active())

    def waiting_for(self) -> list[str]:
        """Devices of the barrier set the open round still waits for (none under a pace without rounds)."""
        return self.pace.waiting_for(self.barrier_set())

    def status(self, now: float) -> dict[str, Any]:
        """The job's state, for operators."""
        return reporting.status(self, now)

    # ----------------------------------------------------------------- start
    def start(self, now: float) -> list[Publish]:
        """Publish the model artifact if any, version 0 (retained), its metrics and the barrier."""
        self.round.started = self.round.opened = now
        # without an artifact, an empty retained message clears one an earlier run of this job left
        model = Publish(self.topics.model, self.artifact or b"", qos=1, retain=True)
        return [model, *self.broadcast_version(now)]

    def resume(self, now: float) -> list[Publish]:
        """After a restore from a checkpoint: publish again what devices need to go on (the
        artifact, the newest version's parameter messages, the barrier, the metrics), in case
        the crash came between the checkpoint and those messages leaving."""
        model = [Publish(self.topics.model, self.artifact or b"", qos=1, retain=True)]
        return [*model, *self.last_broadcast, *self.barrier(now, force=True), reporting.metrics(self, now)]

    def to_state(self, now: float) -> dict[str, Any]:
        """What a checkpoint holds (ps_service.state)."""
        return state.to_state(self, now)

    def load_state(self, saved: dict[str, Any], history: list[Metrics], now: float) -> None:
        """Become the server ``to_state`` described (built with the same configuration)."""
        state.load_state(self, saved, history, now)

    @property
    def history_json(self) -> list[bytes]:
        return self.report.history_json

    # ----------------------------------------------------------------- events
    def on_message(
        self,
        topic: str,
        payload: bytes,
        now: float,
        response_topic: str | None = None,
        correlation: bytes | None = None,
        retained: bool = False,
    ) -> list[Publish]:
        """Dispatch one inbound MQTT message; never raises. ``response_topic`` and ``correlation``: a
        command's MQTT 5 properties, where its sender spoke MQTT 5; ``retained``: the broker
        delivered a retained message (one left on the topic, not sent live). A message the server
        fails on is a counted ``unprocessable`` rejection, so that it is acknowledged and dropped
        rather than redelivered to a crashing server again and again."""
        try:
            kind, device = self.topics.parse(topic)
        except ValueError as exc:
            self.events.warning("ignored message on %s: %s", topic, exc)
            return []
        try:
            if kind == "grad" and device is not None:
                return admission.on_commit(self, device, payload, now, retained)
            if kind == "part" and device is not None:  # a site's name where a device's stands
                if device not in self.config.site_names:
                    return self.count(Rejection(RejectReason.UNKNOWN_DEVICE, f"site {device!r} is not the job's"))
                return admission.on_site_commit(self, device, payload, now, retained)
            if kind == "status" and device is not None:
                return admission.on_status(self, device, payload, now)
            if kind == "cmd":
                return commands.on_command(self, payload, now, response_topic, correlation, device)
        except Exception as exc:  # a bug: never let one message stop the job
            self.events.error("failed on a message on %s: %s", topic, traceback.format_exc())
            rejection = Rejection(RejectReason.UNPROCESSABLE, f"{type(exc).__name__}: {exc}", peek_seq(payload))
            sender = device if kind in ("grad", "status") else None
            return self.count(rejection) if sender is None else self.reject(sender, rejection)
        return []

    def subscriptions(self) -> list[str]:
        """The topics the server listens to now: statuses, commands, the site commits of its
        ``sites``, and the commit topic of each device in ``DeviceRegistry.listening`` (none with
        ``sites_only``: ingest workers read them). The driver makes them its subscriptions after
        every batch, before publishing the batch's results (a device's control goes out after the
        subscription to its commits)."""
        t = self.topics
        sites = [t.part(site) for site in sorted(self.config.site_names) if not self.door.sites.muted(site)]
        direct = [] if self.config.sites_only else [t.grad(device) for device in self.registry.listening()]
        return [t.all_status, t.cmd, t.cmd_of("+"), *sites, *direct]

    def on_tick(self, now: float) -> list[Publish]:
        """Time passes: drop devices that let the round's deadline pass; publish metrics when
        none went out for ``metrics_interval_s`` (so that traffic shows between versions), and a
        barrier that waited (``barrier``)."""
        for device in self.registry.unmute_due(now):
            self.events.info("listening to device %s again", device)
        for site in self.door.sites.unmute_due(now):
            self.events.info("listening to site %s again", site)
        duration = self.config.duration_s
        if duration is not None and self.round.quorum and not self.finished and now - self.round.started >= duration:
            self.events.info("job %s reached its duration of %.1f s", self.config.job, duration)
            return self.finish(now)
        out = self.barrier(now) if self._barrier_due is not None and now >= self._barrier_due else []
        interval = self.config.metrics_interval_s
        if interval is not None and not self.finished and now - self.report.metrics_at >= interval:
            return [*out, reporting.metrics(self, now), *drop_late(self, now)]
        return [*out, *drop_late(self, now)]

    def next_deadline(self) -> float | None:
        """When ``on_tick`` next has something to do, on the core's clock (None: nothing timed in
        force): the open round's deadline, a mute that ends, metrics due on their interval, the
        job's duration, a barrier that waited. A driver sleeps until then unless a message comes first."""
        times = [self.registry.next_unmute(), self.door.sites.next_unmute(), round_due(self), self._barrier_due]
        if not self.finished:
            interval, duration = self.config.metrics_interval_s, self.config.duration_s
            times.append(None if interval is None else self.report.metrics_at + interval)
            times.append(None if duration is None or not self.round.quorum else self.round.started + duration)
        return min((t for t in times if t is not None), default=None)

    # ------------------------------------------------------ operations (commands)
    def finish(self, now: float) -> list[Publish]:
        """End the job: the last version is broadcast and the barrier says ``finished``."""
        if self.finished:
            return []
        self.round.state = JobState.FINISHED
        if self.unbroadcast:  # the retained snapshot must be the final model
            return self.broadcast_version(now)
        return [*self.barrier(now), reporting.metrics(self, now)]

    # -------------------------------------------------------------- internals
    def reassign(self) -> list[Publish]:
        """Control messages for the devices whose push_every changed."""
        devices = sorted(self.registry.active())
        before = {device: self.frequency.push_every(device) for device in devices}  # what each was told
        after = self.frequency.assign(devices)
        return [self.control(device) for device, value in after.items() if before[device] != value]

    # -------------------------------------------------------------- internals
    def device_left(self, device: str, now: float, incarnation: int | None = None) -> list[Publish]:
        if not self.registry.set_offline(device, incarnation):  # not online, or an earlier boot's will
            return []
        self.membership.forget(device)
        self.frequency.forget(device)
        self.events.info("device %s offline: it leaves the barrier", device)
        return self.advance(now) or self.barrier(now)

    def advance(self, now: float) -> list[Publish]:
        """Make versions while the pace is ready (ps_service.versions)."""
        return versions.advance(self, now)

    def broadcast_version(self, now: float) -> list[Publish]:
        """Publish the newest version (ps_service.versions)."""
        return versions.broadcast(self, now)

    def count(self, rejection: Rejection) -> list[Publish]:
        return self.report.count(rejection)

    def reject(self, device: str, rejection: Rejection, now: float | None = None) -> list[Publish]:
        return self.report.reject(device, rejection, self.registry.record(device), now)

    def control(self, device: str) -> Publish:
        record = self.registry.record(device)
        assert record is not None and record.incarnation is not None, "a control answers a device's hello"
        push_every, rules = self.frequency.tell(device), self.pace.configure(device)
        control = Control(
            device=device,
            run=self.run,
            incarnation=record.incarnation,
            seq_base=record.seq_base,
            max_uncommitted_steps=self.config.max_uncommitted_factor * push_every,
            push_every=push_every,
            lr=self.config.lr,
            batch_size=self.config.batch_size,
            loss=self.config.loss,
            codec=self.codec,
            pull_codec=self.config.pull_codec,
            wait_for_params=rules.wait_for_params,
            staleness_bound=rules.staleness_bound,
            one_commit_per_version=rules.one_commit_per_version,
            columns=self.columns,
        )
        return Publish(self.topics.ctrl(device), control.to_bytes(), qos=1, retain=True)

    def barrier(self, now: float, force: bool = False) -> list[Publish]:
        """The barrier (retained), when it has news: at once when it changes what a device does or may
        act on (the run, the state, the pace, who left, under ssp the slowest clock, and the weight cap
        site aggregators weigh by), else at most
        every ``BARRIER_DETAIL_S`` (its version, who is waiting or committed: news for operators;
        ``on_tick`` sends what waited). It always says how things stand now, and never the same twice.
        Under load this makes a barrier message a second instead of one per commit (docs/PROTOCOL.md
        §3), and the full message (lists of the fleet's devices) is built only when it goes out."""
        clock = self.registry.slowest_clock(self.barrier_set()) if self.pace.name.startswith("ssp") else None
        left = frozenset(self.membership.left & self.registry.active())
        # the weight cap too (it changes as devices come): a site aggregator weighs by it
        acted_on = (self.run, self.round.state, self.pace.name, left, clock, versions.weight_cap(self))
        if force or acted_on != self._barrier_sent or now >= self._barrier_at + BARRIER_DETAIL_S:
            payload = self._barrier_message().to_bytes()
            self._barrier_due = None
            if payload == self._barrier_bytes and not force:
                return []
            self._barrier_sent, self._barrier_at, self._barrier_bytes = acted_on, now, payload
            return [Publish(self.topics.barrier, payload, qos=1, retain=True)]
        if self._barrier_due is None:
            self._barrier_due = self._barrier_at + BARRIER_DETAIL_S
        return []

    def _barrier_message(self) -> Barrier:
        barrier_set = self.barrier_set()
        # what site aggregators clip to
        limits = self.bounds.limits(self.store.version, self.store.norm(), steps_ceiling=versions.steps_ceiling(self))
        cap = versions.weight_cap(self)
        return Barrier(
            run=self.run,
            round=self.store.version,
            version=self.store.version,
            pace=self.pace.name,
            state=self.round.state.value,
            waiting_for=self.waiting_for(),
            committed=self.pace.committed(),
            left=sorted(self.membership.left & self.registry.active()),
            slowest_clock=self.registry.slowest_clock(barrier_set),
            max_norm=limits.published if self.bounds.recent else None,  # none before the fleet's first update
            max_weight=cap if math.isfinite(cap) else None,
        )
