"""The sans-IO parameter server: decoded-or-raw messages in, messages to publish out.

It never touches a socket or the clock: every event carries ``now`` (seconds, from any
epoch), and every method returns the ``Publish`` list its driver must send.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from learning.model import Params
from ps_service.aggregate import aggregate, norms_hold
from ps_service.broadcast import Broadcaster
from ps_service.config import ServerConfig
from ps_service.evaluator import Evaluator
from ps_service.frequency import Bounds, FrequencyController, make_policy
from ps_service.membership import Membership
from ps_service.pace import make_pace
from ps_service.registry import DeviceRegistry
from ps_service.robust import NormBound, bounded_sizes
from ps_service.store import ParameterStore
from ps_service.update import Update
from ps_service.validation import Rejection, validate_commit
from schemas.frame import peek_seq
from schemas.messages import (
    MAX_SAFE_INT,
    Barrier,
    Command,
    Control,
    DeviceStatus,
    MessageError,
    Metrics,
    Notice,
    RejectReason,
    Reply,
)
from schemas.topics import Publish, Topics

log = logging.getLogger("edgeps.ps")


def _command_name(payload: bytes) -> str:
    """The ``cmd`` field of a command that may not validate, for its error reply."""
    try:
        name = json.loads(payload).get("cmd")
    except (ValueError, AttributeError):
        return "invalid"
    return name[:32] if isinstance(name, str) else "invalid"


#: Statuses a device may send at once, and per second sustained (a hello per connection, a speed
#: report a second at most): a flood of statuses is refused as ``rate_limited``.
STATUS_BURST, STATUS_RATE = 10, 2.0


def new_run() -> int:
    """A random id for a new run of a job (1 .. 2**53 - 1)."""
    return 1 + secrets.randbelow(MAX_SAFE_INT)


def commit_size_limit(store: ParameterStore) -> int:
    """The largest valid commit of the model: its fp32 frame with the longest device id."""
    return len(store.snapshot_frame()) + 64


@dataclass
class Traffic:
    commits: int = 0
    applied: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    rejected: Counter[str] = field(default_factory=Counter)


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
    ) -> None:
        self.config = config
        self.artifact = artifact  # the devices' TFLite trainer (schemas/artifact.py), published retained
        self.topics = Topics(config.job)
        self.run = run if run is not None else new_run()
        self.store = ParameterStore(params)
        self.commit_limit = config.max_commit_bytes or commit_size_limit(self.store)
        self.broadcaster = Broadcaster(self.topics, config.pull_codec, run=self.run)
        self.codec = config.codec  # the commit codec; operators may change it during a run
        self.previous_codec = config.codec  # still accepted: commits in flight when it changed
        self.pace = make_pace(config.pace)
        self.registry = DeviceRegistry(config.allowed_devices)
        self.membership = Membership()  # who rounds wait for
        self.bound = NormBound(config.outlier_factor)  # each device's update against the others'
        self.evaluator = evaluator
        self.frequency = FrequencyController(
            make_policy(config.frequency, config.push_every),
            Bounds(config.push_every_min, max(config.push_every_min, config.push_every_max)),
            config.balance,
        )
        self._evaluation: tuple[int, float, float] | None = None  # (version, accuracy, loss)
        self.traffic = Traffic()
        self.history: list[Metrics] = []
        self.history_json: list[bytes] = []  # the same records, serialised once (for checkpoints)
        self.paused = False
        self.finished = False
        self.quorum = False
        self.round_started = now
        self._unbroadcast = 0  # versions applied since the last parameter broadcast
        self.server_step = 1.0  # the last aggregate's step: 1 plain averaging, more extrapolated
        self._last_broadcast: list[Publish] = []  # the newest version's parameter messages
        self._metrics_at = now  # when metrics last went out
        self._started = now

    # ----------------------------------------------------------------- start
    def start(self, now: float) -> list[Publish]:
        """Publish the model artifact if any, version 0 (retained), its metrics and the barrier."""
        self._started = self.round_started = now
        # without an artifact, an empty retained message clears one an earlier run of this job left
        model = Publish(self.topics.model, self.artifact or b"", qos=1, retain=True)
        return [model, *self._broadcast_version(now)]

    def resume(self, now: float) -> list[Publish]:
        """After a restore from a checkpoint: publish again what devices need to go on (the
        artifact, the newest version's parameter messages, the barrier, the metrics), in case
        the crash came between the checkpoint and those messages leaving."""
        model = [Publish(self.topics.model, self.artifact or b"", qos=1, retain=True)]
        return [*model, *self._last_broadcast, self._barrier(), self._metrics(now)]

    # ----------------------------------------------------------------- state
    def to_state(self, now: float) -> dict[str, Any]:
        """Everything the server knows, by name, in JSON values and numpy arrays (tensors) and
        bytes (payloads); times are ages in seconds, so that a restored server runs on any clock.
        The metrics history is apart (``history_json``). ps_service/checkpoint.py writes it."""
        traffic = self.traffic
        return {
            "run": self.run,
            "store": self.store.to_state(),
            "broadcaster": self.broadcaster.to_state(),
            "codec": self.codec,
            "previous_codec": self.previous_codec,
            "pace": {"spec": self.pace.name, "buffer": [u.to_state() for u in self.pace.buffered()]},
            "registry": self.registry.to_state(now),
            "membership": self.membership.to_state(),
            "bound": self.bound.to_state(),
            "frequency": self.frequency.to_state(now),
            "evaluation": None if self._evaluation is None else list(self._evaluation),
            "traffic": {
                "commits": traffic.commits,
                "applied": traffic.applied,
                "bytes_up": traffic.bytes_up,
                "bytes_down": traffic.bytes_down,
                "rejected": dict(sorted(traffic.rejected.items())),
            },
            "paused": self.paused,
            "finished": self.finished,
            "quorum": self.quorum,
            "unbroadcast": self._unbroadcast,
            "server_step": self.server_step,
            "last_broadcast": [
                {"topic": m.topic, "payload": m.payload, "qos": m.qos, "retain": m.retain} for m in self._last_broadcast
            ],
            "started_age_s": now - self._started,
            "round_age_s": now - self.round_started,
            "metrics_age_s": now - self._metrics_at,
        }

    def load_state(self, state: dict[str, Any], history: list[Metrics], now: float) -> None:
        """Become the server ``to_state`` described (built with the same configuration)."""
        self.run = int(state["run"])
        self.store = ParameterStore.from_state(state["store"])
        self.broadcaster = Broadcaster(self.topics, self.config.pull_codec, run=self.run)
        self.broadcaster.load_state(state["broadcaster"], self.store)
        self.codec, self.previous_codec = str(state["codec"]), str(state["previous_codec"])
        self.pace = make_pace(str(state["pace"]["spec"]))
        for update in state["pace"]["buffer"]:
            self.pace.add(Update.from_state(update))
        self.registry.load_state(state["registry"], now)
        self.membership.load_state(state["membership"])
        self.bound.load_state(state["bound"])
        self.frequency.load_state(state["frequency"], now, self.config.push_every)
        evaluation = state["evaluation"]
        self._evaluation = (
            None if evaluation is None else (int(evaluation[0]), float(evaluation[1]), float(evaluation[2]))
        )
        t = state["traffic"]
        self.traffic = Traffic(int(t["commits"]), int(t["applied"]), int(t["bytes_up"]), int(t["bytes_down"]),
                               Counter({str(k): int(v) for k, v in t["rejected"].items()}))  # fmt: skip
        self.paused, self.finished, self.quorum = bool(state["paused"]), bool(state["finished"]), bool(state["quorum"])
        self._unbroadcast, self.server_step = int(state["unbroadcast"]), float(state["server_step"])
        self._last_broadcast = [
            Publish(str(m["topic"]), bytes(m["payload"]), int(m["qos"]), bool(m["retain"]))
            for m in state["last_broadcast"]
        ]
        self._started = now - float(state["started_age_s"])
        self.round_started = now - float(state["round_age_s"])
        self._metrics_at = now - float(state["metrics_age_s"])
        self.history = list(history)
        self.history_json = [m.to_bytes() for m in history]

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
            log.warning("ignored message on %s: %s", topic, exc)
            return []
        try:
            if kind == "grad" and device is not None:
                return self.on_commit(device, payload, now, retained)
            if kind == "status" and device is not None:
                return self.on_status(device, payload, now)
            if kind == "cmd":
                return self.on_command(payload, now, response_topic, correlation)
        except Exception as exc:  # a bug: never let one message stop the job
            log.exception("failed on a message on %s", topic)
            rejection = Rejection(RejectReason.UNPROCESSABLE, f"{type(exc).__name__}: {exc}", peek_seq(payload))
            return self._reject(device, rejection) if device is not None and kind != "reply" else self._count(rejection)
        return []

    def on_status(self, device: str, payload: bytes, now: float) -> list[Publish]:
        """A device's hello (online) or last will (offline); an empty (cleared) status is offline."""
        record = self.registry.record(device)
        if record is not None and not record.statuses.take(1, now, STATUS_RATE, STATUS_BURST):
            return self._reject(device, Rejection(RejectReason.RATE_LIMITED, "statuses too often"), now)
        if not payload:
            return self._device_left(device, now)
        try:
            status = DeviceStatus.from_bytes(payload)
        except MessageError as exc:
            return self._reject(device, Rejection(RejectReason.MALFORMED, str(exc)))
        if status.device != device:
            return self._reject(device, Rejection(RejectReason.DEVICE_MISMATCH, f"status body names {status.device!r}"))
        if status.state == "offline":
            return self._device_left(device, now, status.incarnation)
        if not self.registry.permits(device):
            return self._reject(device, Rejection(RejectReason.UNKNOWN_DEVICE, f"{device!r} is not in this job"))
        assert status.incarnation is not None  # DeviceStatus requires it online
        if status.step_s is not None:
            self.frequency.balancer.on_report(device, status.step_s)
        first, rebooted = self.registry.set_online(device, status.samples, status.incarnation)
        if not first and not rebooted:  # already online: a speed report
            if status.step_s is None:
                return []
            return self._reassign() + self._release(now)
        if rebooted and not first:
            log.info("device %s restarted (incarnation %d): its sequence resumes above %d", device,
                     status.incarnation, self.registry.record(device).seq_base)  # type: ignore[union-attr]  # fmt: skip
        log.info("device %s online (%d samples)", device, status.samples)
        if self.broadcaster.deltas:  # a joining device first reads the retained snapshot
            self.traffic.bytes_down += len(self.broadcaster.snapshot)
        out = [self._control(device)]
        if not self.quorum and len(self.registry.active()) >= self.config.min_devices:
            self.quorum = True
            self._started = self.round_started = now  # the job's clock starts with its quorum
            log.info("start quorum of %d devices reached", self.config.min_devices)
            out += self._maybe_aggregate(now)
        return [*out, self._barrier()]

    def on_commit(self, device: str, payload: bytes, now: float, retained: bool = False) -> list[Publish]:
        """A commit frame on ``grad/{device}``: validate, buffer, maybe aggregate."""
        self.traffic.commits += 1
        self.traffic.bytes_up += len(payload)
        R = RejectReason
        if retained:  # left on the broker by someone: never a device's live work
            return self._reject(device, Rejection(R.RETAINED, "commits must not be retained", peek_seq(payload)))
        if self.finished:
            return self._reject(device, Rejection(R.FINISHED, "the job has finished", peek_seq(payload)))
        rate, burst, limit = self.config.max_commit_rate, self.config.max_commit_burst, self.commit_limit
        record = self.registry.record(device)
        if rate is not None and self.registry.permits(device):
            record = self.registry.limits(device)
            over = (f"more than {rate:g} commits/s" if not record.commits.take(1, now, rate, burst)
                    else f"more than {rate * limit:g} bytes/s"
                    if not record.bytes.take(len(payload), now, rate * limit, burst * limit) else None)  # fmt: skip
            if over is not None:
                return self._flooding(device, over, peek_seq(payload), now)
        try:
            update = validate_commit(
                payload,
                device,
                self.registry,
                self.store.version,
                self.store.shapes,
                self.commit_limit,
                frozenset({self.codec, self.previous_codec}),
            )
        except Rejection as rejection:
            # a copy of a commit the server holds (its work is in the model) gets no notice: the device
            # would send that work again
            redelivered = rejection.reason is R.REPLAYED and self.registry.redelivered(device, rejection.seq)
            out = self._count(rejection) if redelivered else self._reject(device, rejection)
            if rejection.reason in (R.REPLAYED, R.OUT_OF_ORDER) and record is not None:
                out += self._resequence(device)
            return out
        self.frequency.balancer.on_commit(device, update.steps, now)
        self.pace.add(update)
        if device in self.registry.active() and self.membership.on_commit(
            device, self.store.version - update.base_version
        ):
            log.info("device %s rejoins the barrier", device)
        return self._maybe_aggregate(now) or [self._barrier()]

    def _flooding(self, device: str, over: str, seq: int | None, now: float) -> list[Publish]:
        """A commit beyond the device's rate limit: refused, and the server stops listening to the
        device's commits for a while (``DeviceRegistry.mute``), so that the broker drops a flood
        instead of queueing it in front of the other devices' commits."""
        if self.registry.muted(device):  # already in flight when it was muted
            return self._reject(device, Rejection(RejectReason.RATE_LIMITED, over, seq), now)
        duration = self.registry.mute(device, now)
        log.warning("device %s floods (%s): not listening to its commits for %g s", device, over, duration)
        detail = f"{over}: its commits are not received for {duration:g} s"
        record = self.registry.limits(device)
        record.noticed_at = None  # this notice goes out whatever the one-a-second rule says
        return self._reject(device, Rejection(RejectReason.RATE_LIMITED, detail, seq), now)

    def subscriptions(self) -> list[str]:
        """The topics the server listens to now: statuses, commands, and the commit topic of each
        device in ``DeviceRegistry.listening``. The driver makes them its subscriptions after every
        batch, before publishing the batch's results (a device's control goes out after the
        subscription to its commits)."""
        t = self.topics
        return [t.all_status, t.cmd, *(t.grad(device) for device in self.registry.listening())]

    def _resequence(self, device: str) -> list[Publish]:
        """A device used a sequence number at or below the highest received: its Control again,
        with where its numbers resume (it may have lost count: a restart the server did not see)."""
        record = self.registry.record(device)
        if record is None or record.incarnation is None or record.seq_base >= record.highest_seq:
            return []
        record.seq_base = record.highest_seq
        return [self._control(device)]

    def on_tick(self, now: float) -> list[Publish]:
        """Time passes: drop devices that let the round's deadline pass; publish metrics when
        none went out for ``metrics_interval_s`` (so that traffic shows between versions)."""
        for device in self.registry.unmute_due(now):
            log.info("listening to device %s again", device)
        duration = self.config.duration_s
        if duration is not None and self.quorum and not self.finished and now - self._started >= duration:
            log.info("job %s reached its duration of %.1f s", self.config.job, duration)
            return self._finish(now)
        interval = self.config.metrics_interval_s
        if interval is not None and not self.finished and now - self._metrics_at >= interval:
            return [self._metrics(now), *self._deadline(now)]
        return self._deadline(now)

    def _deadline(self, now: float) -> list[Publish]:
        deadline = self.config.round_deadline_s
        if deadline is None or not self.pace.wait_for_barrier or self.finished or self.paused or not self.quorum:
            return []
        waited = now - self.round_started
        late = [d for d in self.pace.waiting_for(self.barrier_set())
                if waited >= self.membership.deadline([d], deadline)]  # fmt: skip
        if not late:
            return []
        self.membership.missed(late)
        log.warning("round %d deadline passed: %s leave the barrier", self.store.version, ", ".join(late))
        return self._maybe_aggregate(now) or [self._barrier()]

    def barrier_set(self) -> frozenset[str]:
        """Devices the next aggregate waits for: online, not left (past a deadline, or released)."""
        return self.membership.barrier(self.registry.active())

    def next_deadline(self) -> float | None:
        """When ``on_tick`` next has something to do for the open round's deadline, or a mute that
        ends (None: nothing timed in force), on the core's clock."""
        unmute = self.registry.next_unmute()
        deadline = self.config.round_deadline_s
        if deadline is None or not self.pace.wait_for_barrier or self.finished or self.paused or not self.quorum:
            return unmute
        late = self.pace.waiting_for(self.barrier_set())
        if not late:
            return unmute
        due = self.round_started + min(self.membership.deadline([d], deadline) for d in late)
        return due if unmute is None else min(due, unmute)

    def on_command(
        self, payload: bytes, now: float, response_topic: str | None = None, correlation_data: bytes | None = None
    ) -> list[Publish]:
        """An operator's command: carried out whole or not at all, answered when it asks for a reply
        (MQTT 5 response topic and correlation data, or the command's reply_to and correlation)."""
        reply_to, correlation = self._reply_address(payload)
        if reply_to is None and response_topic is not None:
            reply_to = self._reply_topic(response_topic)
        if correlation is None and correlation_data is not None:
            correlation = correlation_data.decode("utf-8", "replace")[:128]
        where = (reply_to, correlation_data)
        try:
            command = Command.from_bytes(payload)
            log.info("operator command: %s %s", command.cmd, command.reason)
            out, detail = self._execute(command, now)
        except ValueError as exc:  # MessageError, an unknown pace, bounds that cross ...
            self.traffic.rejected[RejectReason.INVALID_COMMAND] += 1
            log.warning("rejected command: %s", exc)
            return self._reply(where, Reply(cmd=_command_name(payload), correlation=correlation, ok=False,
                                            detail=str(exc)[:1024]))  # fmt: skip
        status = self.status(now) if command.cmd == "status" else None
        answer = Reply(cmd=command.cmd, correlation=correlation, ok=True, detail=detail, status=status)
        return [*out, *self._reply(where, answer)]

    def status(self, now: float) -> dict[str, Any]:
        """The job's state, for operators."""
        evaluation = self._evaluation or (0, float("nan"), float("nan"))
        barrier = self.barrier_set()
        return {
            "job": self.config.job,
            "state": "finished" if self.finished else "paused" if self.paused else "running",
            "pace": self.pace.name,
            "version": self.store.version,
            "accuracy": evaluation[1],
            "loss": evaluation[2],
            "evaluated_version": evaluation[0],
            "devices_online": sorted(self.registry.active()),
            "waiting_for": self.pace.waiting_for(barrier) if self.pace.wait_for_barrier else [],
            "left": sorted(self.membership.left),
            "evicted": sorted(self.registry.evicted),
            "codec": self.codec,
            "pull_codec": self.config.pull_codec,
            "frequency": {
                "policy": self.frequency.policy.name,
                "frozen": self.frequency.frozen is not None,
                "base": self.frequency.base,
                "low": self.frequency.bounds.low,
                "high": self.frequency.bounds.high,
                "push_every": {d: self.frequency.push_every(d) for d in sorted(self.registry.active())},
            },
            "commits": self.traffic.commits,
            "applied": self.traffic.applied,
            "rejected": dict(self.traffic.rejected),
            "elapsed_s": round(now - self._started, 3),
        }

    def _execute(self, command: Command, now: float) -> tuple[list[Publish], str]:
        """(messages, what was done) for a valid command; ValueError changes nothing."""
        cmd = command.cmd
        if cmd == "status":
            return [], ""
        if cmd == "pause":
            self.paused = True
            return [self._barrier()], "aggregation paused"
        if cmd == "resume":
            self.paused = False
            return self._maybe_aggregate(now) or [self._barrier()], "aggregation resumed"
        if cmd == "set_codec" and command.codec is not None:
            self.previous_codec, self.codec = self.codec, command.codec
            return [self._control(device) for device in sorted(self.registry.active())], f"codec {self.codec}"
        if cmd == "set_pace" and command.pace is not None:
            return self._set_pace(command.pace, now), f"pace {self.pace.name}"
        if cmd == "evict" and command.device is not None:
            return self._evict(command.device, now), f"{command.device} evicted"
        if cmd in ("set_frequency", "freeze_frequency", "unfreeze_frequency"):
            return self._frequency_command(command), f"push_every base {self.frequency.base}"
        return self._finish(now), "job finished"

    def _set_pace(self, spec: str, now: float) -> list[Publish]:
        pace = make_pace(spec)  # ValueError for an unknown one, before anything changes
        for update in self.pace.take_all():  # buffered commits carry over to the new pace
            pace.add(update)
        self.pace = pace
        controls = [self._control(device) for device in sorted(self.registry.active())]
        return [*controls, *(self._maybe_aggregate(now) or [self._barrier()])]

    def _evict(self, device: str, now: float) -> list[Publish]:
        if not self.registry.known(device):
            raise ValueError(f"no device {device!r} in this job")
        self.registry.evict(device)
        dropped = self.pace.drop(device)  # its buffered commits go with it, counted
        if dropped:
            self.traffic.rejected[RejectReason.EVICTED.value] += len(dropped)
        notice = Notice(
            device=device, reason=RejectReason.EVICTED, detail="an operator removed this device from the job"
        )
        return [Publish(self.topics.notice(device), notice.to_bytes(), qos=1), *self._device_left(device, now)]

    def _reply_address(self, payload: bytes) -> tuple[str | None, str | None]:
        """Where to answer a command (a ``reply/{client}`` topic of this job only), read leniently
        so that an invalid command still gets its error reply."""
        try:
            body = json.loads(payload) if len(payload) <= 64 * 1024 else None
        except ValueError:
            return None, None
        if not isinstance(body, dict):
            return None, None
        reply_to, correlation = body.get("reply_to"), body.get("correlation")
        correlation = correlation[:128] if isinstance(correlation, str) else None
        return self._reply_topic(reply_to), correlation

    def _reply_topic(self, topic: object) -> str | None:
        """``topic`` if it is a ``reply/{client}`` topic of this job: replies go nowhere else."""
        try:
            kind, _ = self.topics.parse(topic) if isinstance(topic, str) else (None, None)
        except ValueError:
            return None
        return topic if kind == "reply" and isinstance(topic, str) else None

    def _reply(self, where: tuple[str | None, bytes | None], reply: Reply) -> list[Publish]:
        """``reply`` to ``where``: (reply topic or None, MQTT 5 correlation data to echo)."""
        reply_to, correlation_data = where
        if reply_to is None:
            return []
        return [Publish(reply_to, reply.to_bytes(), qos=1, correlation=correlation_data)]

    def _frequency_command(self, command: Command) -> list[Publish]:
        frequency = self.frequency
        if command.cmd == "freeze_frequency":
            frequency.freeze()
        elif command.cmd == "unfreeze_frequency":
            frequency.unfreeze()
        else:
            frequency.set_bounds(command.low, command.high)  # ValueError if they cross the bound in force
            if command.policy is not None and command.policy != frequency.policy.name:
                frequency.set_policy(make_policy(command.policy, self.config.push_every))
        return self._reassign()

    def _release(self, now: float) -> list[Publish]:
        """Release balancing: stop waiting for devices much slower than the rest."""
        if not self.pace.wait_for_barrier or not self.quorum or self.finished:
            return []
        released = self.frequency.released(sorted(self.registry.active())) - self.membership.left
        if not released:
            return []
        log.info("round %d does not wait for %s (slow)", self.store.version, ", ".join(sorted(released)))
        self.membership.release(released)
        return self._maybe_aggregate(now)

    def _reassign(self) -> list[Publish]:
        """Control messages for the devices whose push_every changed."""
        devices = sorted(self.registry.active())
        before = {device: self.frequency.push_every(device) for device in devices}  # what each was told
        after = self.frequency.assign(devices)
        return [self._control(device) for device, value in after.items() if before[device] != value]

    # -------------------------------------------------------------- internals
    def _device_left(self, device: str, now: float, incarnation: int | None = None) -> list[Publish]:
        if not self.registry.set_offline(device, incarnation):  # not online, or an earlier boot's will
            return []
        self.membership.forget(device)
        self.frequency.forget(device)
        log.info("device %s offline: it leaves the barrier", device)
        return self._maybe_aggregate(now) or [self._barrier()]

    def _max_extrapolation(self) -> float:
        """How far the next aggregate may be extrapolated: the job's setting, else the pace's
        under a fixed push_every, after the pace's warm-up. An adaptive frequency policy changes
        the local work per round, which FedExP's step takes as steady: measured, trend with it
        oscillated (seeds 0-2: plateau 0.957 against 0.962 without, lowest sample 0.70 against
        0.89; docs/FREQUENCY.md). Likewise a codec whose noise swamps the norms FedExP compares
        (``norms_hold``)."""
        if self.store.version < self.pace.extrapolation_warmup:
            return 1.0
        if self.config.extrapolation is not None:
            return self.config.extrapolation
        if self.pace.max_extrapolation <= 1:  # asp and ssp ask this once per commit
            return 1.0
        if self.frequency.policy.name != "fixed" or not all(map(norms_hold, (self.codec, self.config.pull_codec))):
            return 1.0
        return self.pace.max_extrapolation

    def _maybe_aggregate(self, now: float) -> list[Publish]:
        out: list[Publish] = []
        while self.quorum and not self.paused and not self.finished and self.pace.ready(self.barrier_set()):
            taken = self.pace.take()
            refused = self.bound.outliers(taken, self.store.version, self.store.norm())
            updates = [u for u in taken if u.device not in refused]
            out += [self._refuse_outlier(u) for u in taken if u.device in refused]
            if not updates:
                continue
            try:
                result = aggregate(
                    updates, self.store.version, self._weights(updates), self.pace.mixing, self._max_extrapolation()
                )
                self.store.apply(result.delta)
                self.server_step = result.step
            except ValueError as exc:  # validated updates summing to Inf: refuse the aggregate, keep the model
                log.error("aggregate of %d updates refused: %s", len(updates), exc)
                self.traffic.rejected[RejectReason.NON_FINITE.value] += len(updates)
                continue
            self.traffic.applied += len(updates)
            if self.pace.wait_for_barrier:
                self.membership.round_closed(now - self.round_started)
            self.round_started = now
            self._unbroadcast += 1
            last = self.store.version >= self.config.rounds
            if last or self._unbroadcast >= self.pace.broadcast_every(len(self.barrier_set())):
                out += self._broadcast_version(now)
            else:
                out.append(self._barrier())
        return out

    def _refuse_outlier(self, update: Update) -> Publish:
        detail = "its update is far from the other devices' (ps_service.robust): not applied"
        [notice] = self._reject(update.device, Rejection(RejectReason.OUTLIER, detail, update.seq))
        return notice

    def _weights(self, updates: list[Update]) -> dict[str, int]:
        """The data size each device of an aggregate is weighted by: what it declared (else the
        samples its commits consumed), bounded against the job's median (ps_service.robust)."""
        declared = self.registry.sizes()
        claimed = {u.device: declared.get(u.device) or 0 for u in updates}
        for u in updates:
            if not declared.get(u.device):
                claimed[u.device] += u.samples
        reference = [size for size in declared.values() if size > 0]
        return bounded_sizes(claimed, reference, self.config.samples_factor, self.config.max_device_samples)

    def _broadcast_version(self, now: float) -> list[Publish]:
        self._unbroadcast = 0
        messages, per_device = self.broadcaster.publish(self.store)
        self._last_broadcast = messages
        self.traffic.bytes_down += per_device * len(self.registry.active())
        if self.store.version >= self.config.rounds:
            self.finished = True
        if self.pace.wait_for_params:  # waiting devices train again from here
            for device in self.registry.active():
                self.frequency.balancer.on_ready(device, now)
        metrics = self._metrics(now)  # evaluates, and the policy observes the evaluation
        changed = [] if self.finished else self._reassign()
        if self.pace.wait_for_barrier and not self.finished:  # the new round waits only for those it should
            self.membership.release(self.frequency.released(sorted(self.registry.active())))
        out = [*messages, *changed, self._barrier(), metrics]
        if self.finished:
            log.info("job %s finished at version %d", self.config.job, self.store.version)
        return out

    def _finish(self, now: float) -> list[Publish]:
        if self.finished:
            return []
        self.finished = True
        if self._unbroadcast:  # the retained snapshot must be the final model
            return self._broadcast_version(now)
        return [self._barrier(), self._metrics(now)]

    def _count(self, rejection: Rejection) -> list[Publish]:
        self.traffic.rejected[rejection.reason.value] += 1
        return []

    def _reject(self, device: str, rejection: Rejection, now: float | None = None) -> list[Publish]:
        self._count(rejection)
        count = self.traffic.rejected[rejection.reason.value]
        record = self.registry.record(device)
        if rejection.reason is RejectReason.RATE_LIMITED and now is not None and record is not None:
            # a flooding device gets one notice (and one log line) a second, not one per message
            if record.noticed_at is not None and now - record.noticed_at < 1.0:
                return []
            record.noticed_at = now
        if count <= 100 or count % 1000 == 0 or rejection.reason is RejectReason.RATE_LIMITED:
            log.warning("rejected message from %s: %s: %s", device, rejection.reason.value, rejection.detail)
        notice = Notice(device=device, seq=rejection.seq, reason=rejection.reason, detail=rejection.detail[:512])
        return [Publish(self.topics.notice(device), notice.to_bytes(), qos=1)]

    def _control(self, device: str) -> Publish:
        record = self.registry.record(device)
        assert record is not None and record.incarnation is not None, "a control answers a device's hello"
        push_every = self.frequency.push_every(device)
        control = Control(
            device=device,
            run=self.run,
            incarnation=record.incarnation,
            seq_base=record.seq_base,
            max_uncommitted_steps=self.config.max_uncommitted_factor * push_every,
            push_every=push_every,
            lr=self.config.lr,
            batch_size=self.config.batch_size,
            codec=self.codec,
            pull_codec=self.config.pull_codec,
            wait_for_params=self.pace.wait_for_params,
            staleness_bound=self.pace.staleness_bound,
            one_commit_per_version=self.pace.one_commit_per_version,
        )
        return Publish(self.topics.ctrl(device), control.to_bytes(), qos=1, retain=True)

    def _barrier(self) -> Publish:
        barrier_set = self.barrier_set()
        state = "finished" if self.finished else "paused" if self.paused else "running"
        barrier = Barrier(
            run=self.run,
            round=self.store.version,
            version=self.store.version,
            pace=self.pace.name,
            state=state,
            waiting_for=self.pace.waiting_for(barrier_set) if self.pace.wait_for_barrier else [],
            committed=self.pace.committed(),
            left=sorted(self.membership.left),
            slowest_clock=self.registry.slowest_clock(barrier_set),
        )
        return Publish(self.topics.barrier, barrier.to_bytes(), qos=1, retain=True)

    def _evaluate(self, now: float) -> tuple[int, float, float]:
        """The latest evaluation, made afresh every ``eval_every`` versions and at the end."""
        version = self.store.version
        due = self._evaluation is None or version - self._evaluation[0] >= self.config.eval_every or self.finished
        if due and (self._evaluation is None or self._evaluation[0] != version):
            accuracy, loss = self.evaluator(self.store.view())
            self._evaluation = (version, accuracy, loss)
            self.frequency.observe(now - self._started, accuracy, loss)
        assert self._evaluation is not None
        return self._evaluation

    def _metrics(self, now: float) -> Publish:
        self._metrics_at = now
        evaluated, accuracy, loss = self._evaluate(now)
        metrics = Metrics(
            job=self.config.job,
            run=self.run,
            version=self.store.version,
            round=self.store.version,
            pace=self.pace.name,
            accuracy=accuracy,
            loss=loss,
            commits=self.traffic.commits,
            applied=self.traffic.applied,
            rejected=dict(self.traffic.rejected),
            bytes_up=self.traffic.bytes_up,
            bytes_down=self.traffic.bytes_down,
            devices_online=len(self.registry.active()),
            elapsed_s=round(now - self._started, 6),
            finished=self.finished,
            evaluated_version=evaluated,
            eval_s=round(self.evaluator.seconds, 6),
            frequency=self.frequency.policy.name if self.frequency.frozen is None else "frozen",
            trend=self.frequency.policy.trend,
            server_step=round(self.server_step, 4),
            push_every={d: self.frequency.push_every(d) for d in sorted(self.registry.active())},
        )
        if not self.history or self.history[-1].version != metrics.version or metrics.finished:
            self.history.append(metrics)
            self.history_json.append(metrics.to_bytes())
        return Publish(self.topics.metrics, metrics.to_bytes(), qos=1)
