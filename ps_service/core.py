"""The sans-IO parameter server: decoded-or-raw messages in, messages to publish out.

It never touches a socket or the clock: every event carries ``now`` (seconds, from any
epoch), and every method returns the ``Publish`` list its driver must send.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from learning.model import Params
from ps_service.aggregate import aggregate, norms_hold
from ps_service.broadcast import Broadcaster
from ps_service.config import ServerConfig
from ps_service.evaluator import Evaluator
from ps_service.frequency import Bounds, FrequencyController, make_policy
from ps_service.pace import make_pace
from ps_service.registry import DeviceRegistry
from ps_service.store import ParameterStore
from ps_service.validation import Rejection, validate_commit
from schemas.messages import (
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


@dataclass
class Traffic:
    commits: int = 0
    applied: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    rejected: Counter[str] = field(default_factory=Counter)


class ServerCore:
    """One training job's parameter server as a state machine."""

    def __init__(
        self,
        config: ServerConfig,
        params: Params,
        evaluator: Evaluator,
        now: float = 0.0,
        artifact: bytes | None = None,
    ) -> None:
        self.config = config
        self.artifact = artifact  # the devices' TFLite trainer (schemas/artifact.py), published retained
        self.topics = Topics(config.job)
        self.store = ParameterStore(params)
        self.broadcaster = Broadcaster(self.topics, config.pull_codec)
        self.codec = config.codec  # the commit codec; operators may change it during a run
        self.pace = make_pace(config.pace)
        self.registry = DeviceRegistry(config.allowed_devices)
        self.evaluator = evaluator
        self.frequency = FrequencyController(
            make_policy(config.frequency, config.push_every),
            Bounds(config.push_every_min, max(config.push_every_min, config.push_every_max)),
            config.balance,
        )
        self._evaluation: tuple[int, float, float] | None = None  # (version, accuracy, loss)
        self.traffic = Traffic()
        self.history: list[Metrics] = []
        self.paused = False
        self.finished = False
        self.quorum = False
        self.stragglers: set[str] = set()  # online but dropped from the barrier past a deadline
        self.round_started = now
        self._unbroadcast = 0  # versions applied since the last parameter broadcast
        self.server_step = 1.0  # the last aggregate's step: 1 plain averaging, more extrapolated
        self._last_broadcast: list[Publish] = []  # the newest version's parameter messages
        self._rate_noticed: dict[str, float] = {}  # when each rate-limited device last got a notice
        self._metrics_at = now  # when metrics last went out
        self._started = now

    # ----------------------------------------------------------------- events
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

    def shift_clock(self, delta: float) -> None:
        """Move every stored time by ``delta`` seconds (a restored server runs on a new clock)."""
        self._started += delta
        self.round_started += delta
        self._metrics_at += delta
        for rate in self.frequency.balancer.rates.values():
            if rate.ready_at is not None:
                rate.ready_at += delta

    def on_message(
        self,
        topic: str,
        payload: bytes,
        now: float,
        response_topic: str | None = None,
        correlation: bytes | None = None,
    ) -> list[Publish]:
        """Dispatch one inbound MQTT message; never raises for bad input. ``response_topic`` and
        ``correlation``: a command's MQTT 5 properties, where its sender spoke MQTT 5."""
        try:
            kind, device = self.topics.parse(topic)
        except ValueError as exc:
            log.warning("ignored message on %s: %s", topic, exc)
            return []
        if kind == "grad" and device is not None:
            return self.on_commit(device, payload, now)
        if kind == "status" and device is not None:
            return self.on_status(device, payload, now)
        if kind == "cmd":
            return self.on_command(payload, now, response_topic, correlation)
        return []

    def on_status(self, device: str, payload: bytes, now: float) -> list[Publish]:
        """A device's hello (online) or last will (offline)."""
        if not payload:  # a cleared retained status
            return self._device_left(device, now)
        try:
            status = DeviceStatus.from_bytes(payload)
        except MessageError as exc:
            return self._reject(device, Rejection(RejectReason.MALFORMED, str(exc)))
        if status.device != device:
            return self._reject(device, Rejection(RejectReason.DEVICE_MISMATCH, f"status body names {status.device!r}"))
        if status.state == "offline":
            return self._device_left(device, now)
        if not self.registry.permits(device):
            return self._reject(device, Rejection(RejectReason.UNKNOWN_DEVICE, f"{device!r} is not in this job"))
        if status.step_s is not None:
            self.frequency.balancer.on_report(device, status.step_s)
        if not self.registry.set_online(device, status.samples):  # already online: a speed report
            if status.step_s is None:
                return []
            return self._reassign() + self._release(now)
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

    def on_commit(self, device: str, payload: bytes, now: float) -> list[Publish]:
        """A commit frame on ``grad/{device}``: validate, buffer, maybe aggregate."""
        self.traffic.commits += 1
        self.traffic.bytes_up += len(payload)
        if self.finished:
            return []
        rate = self.config.max_commit_rate
        if rate is not None and not self.registry.take_token(device, now, rate, self.config.max_commit_burst):
            return self._reject(device, Rejection(RejectReason.RATE_LIMITED, f"more than {rate:g} commits/s"), now)
        try:
            update = validate_commit(
                payload,
                device,
                self.registry,
                self.store.version,
                self.store.shapes,
                self.config.max_commit_bytes,
            )
        except Rejection as rejection:
            return self._reject(device, rejection)
        self.frequency.balancer.on_commit(device, update.steps, now)
        self.pace.add(update)
        if device in self.stragglers:  # a late device rejoins with this commit
            self.stragglers.discard(device)
            log.info("device %s rejoins the barrier", device)
        return self._maybe_aggregate(now) or [self._barrier()]

    def on_tick(self, now: float) -> list[Publish]:
        """Time passes: drop devices that let the round's deadline pass; publish metrics when
        none went out for ``metrics_interval_s`` (so that traffic shows between versions)."""
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
        if now - self.round_started < deadline:
            return []
        late = self.pace.waiting_for(self.barrier_set())
        if not late:
            return []
        self.stragglers.update(late)
        log.warning("round %d deadline passed: %s leave the barrier", self.store.version, ", ".join(late))
        return self._maybe_aggregate(now) or [self._barrier()]

    def barrier_set(self) -> frozenset[str]:
        """Devices the next aggregate waits for: online, not dropped past a deadline."""
        return self.registry.active() - self.stragglers

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
            "left_barrier": sorted(self.stragglers),
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
            self.codec = command.codec
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
        released = self.frequency.released(sorted(self.registry.active())) - self.stragglers
        if not released:
            return []
        log.info("round %d does not wait for %s (slow)", self.store.version, ", ".join(sorted(released)))
        self.stragglers.update(released)
        return self._maybe_aggregate(now)

    def _reassign(self) -> list[Publish]:
        """Control messages for the devices whose push_every changed."""
        devices = sorted(self.registry.active())
        before = {device: self.frequency.push_every(device) for device in devices}  # what each was told
        after = self.frequency.assign(devices)
        return [self._control(device) for device, value in after.items() if before[device] != value]

    # -------------------------------------------------------------- internals
    def _device_left(self, device: str, now: float) -> list[Publish]:
        self.stragglers.discard(device)
        if not self.registry.set_offline(device):
            return []
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
            updates = self.pace.take()
            try:
                result = aggregate(
                    updates, self.store.version, self.registry.sizes(), self.pace.mixing, self._max_extrapolation()
                )
                self.store.apply(result.delta)
                self.server_step = result.step
            except ValueError as exc:  # validated updates summing to Inf: refuse the aggregate, keep the model
                log.error("aggregate of %d updates refused: %s", len(updates), exc)
                self.traffic.rejected[RejectReason.NON_FINITE.value] += len(updates)
                continue
            self.traffic.applied += len(updates)
            self.round_started = now
            self._unbroadcast += 1
            last = self.store.version >= self.config.rounds
            if last or self._unbroadcast >= self.pace.broadcast_every(len(self.barrier_set())):
                out += self._broadcast_version(now)
            else:
                out.append(self._barrier())
        return out

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
            self.stragglers.update(self.frequency.released(sorted(self.registry.active())))
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

    def _reject(self, device: str, rejection: Rejection, now: float | None = None) -> list[Publish]:
        self.traffic.rejected[rejection.reason.value] += 1
        count = self.traffic.rejected[rejection.reason.value]
        if rejection.reason is RejectReason.RATE_LIMITED and now is not None:
            # a flooding device gets one notice (and one log line) a second, not one per message
            if now - self._rate_noticed.get(device, -1e9) < 1.0:
                return []
            self._rate_noticed[device] = now
        if count <= 100 or count % 1000 == 0 or rejection.reason is RejectReason.RATE_LIMITED:
            log.warning("rejected message from %s: %s: %s", device, rejection.reason.value, rejection.detail)
        notice = Notice(device=device, seq=rejection.seq, reason=rejection.reason, detail=rejection.detail[:512])
        return [Publish(self.topics.notice(device), notice.to_bytes(), qos=1)]

    def _control(self, device: str) -> Publish:
        control = Control(
            device=device,
            push_every=self.frequency.push_every(device),
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
            round=self.store.version,
            version=self.store.version,
            pace=self.pace.name,
            state=state,
            waiting_for=self.pace.waiting_for(barrier_set),
            committed=self.pace.committed(),
            left=sorted(self.stragglers),
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
        return Publish(self.topics.metrics, metrics.to_bytes(), qos=1)
