"""One training job's state, owned in one place: the ``Job`` record.

The server's concern modules (admission, commands, versions, metrics, state) read and change a
``Job``; they never import the server core. What a concern needs done beyond its own part (a
version made, a device gone, the job finished, slow devices released) it asks of the job's
follow-ups, which ``ps_service.server.core.ServerCore`` carries out. The record's own methods only
read it or build a message from it (a device's Control, the barrier, the bounds in force).
"""

from __future__ import annotations

import math
import secrets
from abc import ABC, abstractmethod
from typing import Any

from learning.model import Params
from ps_service.broadcast import Broadcaster
from ps_service.config import ServerConfig
from ps_service.door import Checks, Door
from ps_service.evaluator import Evaluator
from ps_service.frequency import Bounds, FrequencyController, make_policy
from ps_service.membership import Membership
from ps_service.paces import make_pace
from ps_service.registry import DeviceRegistry
from ps_service.reporting import Report, Traffic
from ps_service.robust import FleetBounds, size_cap
from ps_service.round import JobState, Round
from ps_service.stepguard import StepGuard
from ps_service.store import ParameterStore
from ps_service.validation import Rejection
from schemas.events import Events
from schemas.messages import MAX_SAFE_INT, Barrier, Control, Metrics
from schemas.topics import Publish, Topics

#: How often at most the barrier goes out for changes no device acts on (Job.barrier).
BARRIER_DETAIL_S = 1.0


def new_run() -> int:
    """A random id for a new run of a job (1 .. 2**53 - 1)."""
    return 1 + secrets.randbelow(MAX_SAFE_INT)


class Job(ABC):
    """A job's state: the model, every device's record, the round, the pace, who rounds wait for,
    each device's push_every, the report. ``run`` names this run of the job (a fresh server starts
    a new one; a server restored from its checkpoint keeps the saved one)."""

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
        self.weight_cap_cache: tuple[int, float] = (-1, math.inf)  # (registry generation, cap): weight_cap
        self.ceiling_cache: tuple[tuple[int, int, int], float] = ((-1, -1, -1), 0.0)  # steps_ceiling's
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

    # ------------------------------------------------------- follow-ups (ServerCore)
    @abstractmethod
    def advance(self, now: float) -> list[Publish]:
        """Make versions while the pace is ready."""

    @abstractmethod
    def broadcast_version(self, now: float) -> list[Publish]:
        """Publish the newest version."""

    @abstractmethod
    def device_left(self, device: str, now: float, incarnation: int | None = None) -> list[Publish]:
        """A device went offline (its will, or an earlier boot's): it leaves the barrier."""

    @abstractmethod
    def release_slow(self, now: float) -> list[Publish]:
        """Release balancing: the round stops waiting for devices much slower than the rest."""

    @abstractmethod
    def finish(self, now: float) -> list[Publish]:
        """End the job: the last version is broadcast and the barrier says ``finished``."""

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
        codecs = frozenset({self.codec, self.previous_codec})
        return Checks(self.store.version, self.store.shapes, codecs, self.finished, self.store.layout)

    @property
    def traffic(self) -> Traffic:
        return self.report.traffic

    @property
    def history(self) -> list[Metrics]:
        return self.report.history

    @property
    def history_json(self) -> list[bytes]:
        return self.report.history_json

    def barrier_set(self) -> frozenset[str]:
        """Devices the next aggregate waits for: online, not left (past a deadline, or released)."""
        return self.membership.barrier(self.registry.active())

    def waiting_for(self) -> list[str]:
        """Devices of the barrier set the open round still waits for (none under a pace without rounds)."""
        return self.pace.waiting_for(self.barrier_set())

    def deadline_in_force(self) -> float | None:
        """The round deadline in force now, seconds (None: the pace has no rounds, or none is open)."""
        if not self.pace.rounds or not self.round.aggregating:
            return None
        return self.config.round_deadline_s

    def round_due(self) -> float | None:
        """When the first device the open round waits for becomes late (None: no deadline in force)."""
        deadline = self.deadline_in_force()
        return None if deadline is None else self.round.due(self.waiting_for(), self.membership, deadline)

    def steps_ceiling(self) -> float:
        """The most local steps a device's update counts as: what the server lets any device hold
        uncommitted (``max_uncommitted_factor`` x the largest push_every in force)."""
        config, frequency = self.config, self.frequency
        key = (self.registry.generation, frequency.changes, frequency.base)  # asked at every aggregate
        if key != self.ceiling_cache[0]:
            push_every = max([frequency.push_every(d) for d in self.registry.active()], default=config.push_every)
            self.ceiling_cache = (key, float(config.max_uncommitted_factor * max(push_every, config.push_every)))
        return self.ceiling_cache[1]

    def weight_cap(self) -> float:
        """The most data size a device is weighted by now (ps_service.robust ``size_cap``), computed again
        only when a device came, went or declared another size (it is asked at every commit)."""
        generation, cap = self.weight_cap_cache
        if generation != self.registry.generation:
            cap = size_cap(self.registry.sizes(), self.config.samples_factor, self.config.max_device_samples)
            self.weight_cap_cache = (self.registry.generation, cap)
        return cap

    # ------------------------------------------------------------- messages
    def count(self, rejection: Rejection) -> list[Publish]:
        return self.report.count(rejection)

    def reject(self, device: str, rejection: Rejection, now: float | None = None) -> list[Publish]:
        return self.report.reject(device, rejection, self.registry.record(device), now)

    def reassign(self) -> list[Publish]:
        """Control messages for the devices whose push_every changed."""
        devices = sorted(self.registry.active())
        before = {device: self.frequency.push_every(device) for device in devices}  # what each was told
        after = self.frequency.assign(devices)
        return [self.control(device) for device, value in after.items() if before[device] != value]

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
        acted_on = (self.run, self.round.state, self.pace.name, left, clock, self.weight_cap())
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
        limits = self.bounds.limits(self.store.version, self.store.norm, steps_ceiling=self.steps_ceiling())
        cap = self.weight_cap()
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
