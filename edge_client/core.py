"""The sans-IO device: parameters and control in, commit frames out.

The driver feeds it inbound messages and, whenever ``ready`` is true, calls ``step()``
for one local SGD step; a step that completes ``push_every`` steps returns a commit. Time comes
in as ``now``: ``on_tick`` resends a commit that brought nothing, ``account`` counts busy and idle
time, and ``resubscriptions`` names the snapshot topic to read again when a new run began.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from edge_client.backend import Backend
from edge_client.speed import SpeedMeter
from edge_client.trainer import ArtifactTrainer, Trainer
from learning.data import Dataset
from learning.model import Params
from schemas.codecs import CodecError, ErrorFeedback, make_codec
from schemas.events import Events
from schemas.frame import Frame, FrameError, FrameKind, decode_frame, encode_compact
from schemas.messages import (
    CARRIED,
    MAX_SAFE_INT,
    Barrier,
    Control,
    DeviceStatus,
    MessageError,
    Notice,
    RejectReason,
    as_reason,
)
from schemas.topics import Publish, TopicError, Topics

#: A commit that brought no new version in this long goes out again (``DeviceCore.on_tick``).
RESEND_S = 30.0


def new_incarnation() -> int:
    """A random incarnation for this boot of a device (1 .. 2**53 - 1)."""
    return 1 + secrets.randbelow(MAX_SAFE_INT)


@dataclass(frozen=True)
class Sent:
    """The device's newest commit, kept until the next one: if the server refuses it for a reason
    in ``CARRIED``, its progress goes back into the next commit."""

    seq: int
    base_version: int
    tensors: Params  # what the server would have added: decoded for a biased codec, else the delta
    steps: int
    samples: int
    message: Publish  # the commit as published (resend)


class DeviceCore:
    """One device's training state machine.

    The device trains on ``local``; ``anchor`` is the point its uncommitted progress is
    measured from (``local - anchor`` is what the next commit carries). When a newer
    global version arrives the device adopts it and keeps that uncommitted progress:
    ``local = new + (local - anchor)``. Under ``wait_for_params`` (bsp) it has no
    uncommitted progress while waiting, so this is plain adoption.

    A device follows one Control at a time: the newest one that answers its own ``incarnation``
    (a Control left retained for an earlier boot is ignored). The Control names the job's run;
    parameters of another run are ignored, and a Control of a new run drops the replica and
    everything not yet committed (its base no longer exists) and asks for a ``resync``.
    """

    def __init__(
        self,
        job: str,
        device: str,
        data: Dataset,
        trainer: Trainer | None,
        seed: int = 0,
        artifact_trainer: ArtifactTrainer | None = None,
        incarnation: int | None = None,
        columns: str | None = None,
    ) -> None:
        if len(data) == 0:
            raise ValueError("a device needs training data")
        self.topics = Topics(job)
        self.device = device
        self.data = data
        self.columns = columns  # the fingerprint of the data's CSV columns and scaling, if it came from one
        self.events = Events()  # what happened, for the driver to log
        self.backend = Backend(trainer, artifact_trainer, self.events)  # the trainer, maybe the server's artifact's
        self.rng = np.random.default_rng(seed)
        self.incarnation = incarnation if incarnation is not None else new_incarnation()
        self.control: Control | None = None
        self.run: int | None = None  # the job's run, from the Control followed
        self.feedback = ErrorFeedback(make_codec("fp32"))
        self.server_version = -1  # the newest global version held, the base of the next commit
        self._replica: Params | None = None  # that version, bit for bit as the server broadcast it
        self._replica_run: int | None = None  # the run the replica belongs to
        self._anchor: Params | None = None  # where uncommitted progress is measured from
        self._local: Params | None = None
        self.steps = 0  # local steps the next commit carries (a refused commit's carried ones included)
        self.samples = 0
        self.since_commit = 0  # local steps since the last commit: what push_every and the cap count
        self.seq = 0
        self.waiting = False
        self.gap = False  # a delta did not follow on from our replica: resync from the snapshot
        self.resync = False  # the driver should subscribe to params again (the retained snapshot)
        self.committed_on = -1  # the base version of our last commit
        self.sent: Sent | None = None  # the newest commit, until the next one
        self.slowest_clock = 0
        self.barrier: Barrier | None = None  # the newest Barrier of this run (what a wait is for)
        self.finished = False
        self.trained = False  # whether the last step() made an SGD step (only those are timed)
        self.last_loss = float("nan")
        self.notices: list[Notice] = []
        self.fatal: str | None = None  # why this device cannot take part in the job
        self._fits: tuple[object, ...] | None = None  # (trainer, loss, model shapes) judged fit (_unfit)
        self.busy_s = 0.0  # time the device could train (``account``)
        self.idle_s = 0.0  # time it could not: waiting for parameters, a Control, the staleness bound
        self._mark: tuple[float, bool] | None = None  # (when ``account`` last counted, whether it was ready)
        self._progress = (self.server_version, self.seq)  # a new version or commit restarts the resend clock
        self._progress_at: float | None = None  # when ``_progress`` last changed
        self.speed = SpeedMeter()  # step times, and the one last reported to the server

    @property
    def use_artifact(self) -> bool:
        """Whether the device takes the server's model artifact (subscribes to the model topic)."""
        return self.backend.artifact_trainer is not None

    # ---------------------------------------------------------------- topics
    def subscriptions(self) -> list[str]:
        """Topics to be subscribed to now. With compressed pulls the retained snapshot is read
        only to start or to recover from a gap; deltas carry every other version."""
        t = self.topics
        deltas = self.control is not None and self.control.pull_codec != "fp32"
        snapshot = [t.params] if not deltas or self.server_version < 0 or self.gap else []
        model = [t.model] if self.use_artifact else []
        return [*snapshot, t.delta, t.ctrl(self.device), t.barrier, t.notice(self.device), *model]

    def status(self, state: str) -> Publish:
        """The retained status message (``online`` hello, or ``offline`` for the last will)."""
        body = DeviceStatus(
            device=self.device,
            state=state,
            incarnation=self.incarnation,
            samples=len(self.data),
            backend=self.backend.name,
            busy_s=round(self.busy_s, 6),
            idle_s=round(self.idle_s, 6),
            step_s=self.speed.reported,
            error=None if self.fatal is None else as_reason(self.fatal),
        )
        return Publish(self.topics.status(self.device), body.to_bytes(), qos=1, retain=True)

    @property
    def blocked(self) -> bool:
        """ssp: too far ahead of the slowest device in the barrier."""
        bound = self.control.staleness_bound if self.control is not None else None
        return bound is not None and self.seq - self.slowest_clock > bound

    @property
    def ready(self) -> bool:
        """Whether ``step()`` may run now: a local step, or the commit due when the device holds
        ``max_uncommitted_steps`` (then it does not train further until it can commit)."""
        return (
            self.control is not None
            and self.backend.trainer is not None
            and self._local is not None
            and self._replica_run == self.run
            and not self.waiting
            and not self.blocked
            and not self.finished
            and (self.since_commit < self.control.max_uncommitted_steps or self._commit_due)
        )

    @property
    def _commit_due(self) -> bool:
        return self.control is not None and self.since_commit >= self.control.push_every and not self.holding

    # ---------------------------------------------------------------- events
    def on_message(self, topic: str, payload: bytes) -> None:
        """Feed one inbound message; bad ones are logged and ignored. Messages from the server
        are read tolerantly: fields a newer server adds are dropped."""
        try:
            kind, _ = self.topics.parse(topic)
            if kind in ("params", "delta"):
                self.on_params(decode_frame(payload))
            elif kind == "ctrl" and payload:
                self.on_control(Control.from_bytes(payload, tolerant=True))
            elif kind == "barrier" and payload:
                barrier = Barrier.from_bytes(payload, tolerant=True)
                if barrier.run == self.run:  # a retained barrier of another run says nothing about ours
                    self.barrier = barrier
                    self.slowest_clock = barrier.slowest_clock
                    self.finished = barrier.state == "finished" or self.finished
            elif kind == "model" and payload and self.use_artifact:
                self.load_artifact(payload)
            elif kind == "notice":
                self.on_notice(Notice.from_bytes(payload, tolerant=True))
        except (TopicError, FrameError, MessageError, CodecError) as exc:  # a bad message; anything else: a bug
            self.events.warning("ignored bad message on %s: %s", topic, exc)

    def on_control(self, control: Control) -> None:
        """Follow ``control`` if it answers this incarnation. A new run starts afresh: the replica
        and uncommitted progress belong to the old one."""
        if control.device != self.device or control.incarnation != self.incarnation:
            return  # a control left for another device or an earlier boot of this one
        if self.run is not None and control.run != self.run:
            self.events.warning("job run %d replaces run %d: starting again from its parameters", control.run, self.run)
            self._forget_replica()
        if self._replica is not None and self._replica_run != control.run:
            self._forget_replica()  # read before the control: parameters of another run
        self.run = control.run
        self.seq = max(self.seq, control.seq_base)
        if control.codec != self.feedback.codec.spec:  # the residual carries over (ErrorFeedback)
            self.feedback.codec = make_codec(control.codec)
        self.control = control
        self._unfit(self._replica)

    def _unfit(self, replica: Params | None) -> bool:
        """Whether this device cannot train the job's loss, or its model on this data; if so its part
        ends (``fatal``) rather than failing on its first step. Judged once the Control is held."""
        if self.control is None or self.fatal is not None:
            return self.fatal is not None
        shapes = None if replica is None else tuple((name, values.shape) for name, values in replica.items())
        judged = (self.backend.trainer, self.control.loss, shapes)
        if judged == self._fits:  # every version: the labels were checked once for this model and loss
            return False
        problem = self.backend.use_loss(self.control.loss) or self._other_columns()
        problem = problem or (None if replica is None else self.backend.mismatch(replica, self.data))
        if problem is not None:
            self._end(problem)
        else:
            self._fits = judged
        return problem is not None

    def _other_columns(self) -> str | None:
        """Why this device's rows would mean other things than the fleet's (another set, order or
        scaling of CSV columns, another numbering of the classes), or None: where the job or the
        device knows no columns, nothing."""
        assert self.control is not None
        job = self.control.columns
        if job is None or self.columns is None or job == self.columns:
            return None
        mine = f"this device's CSV columns, scaling or class names (fingerprint {self.columns})"
        return f"{mine} differ from the job's ({job}): read the CSV with load_csv(..., scaling=the job's columns.json)"

    def _end(self, why: str) -> None:
        """This device cannot take part in the job: it stops (``fatal`` says why)."""
        self.fatal, self.finished = why, True
        self.events.error("%s", why)

    def _forget_replica(self) -> None:
        self.server_version, self._replica, self._replica_run = -1, None, None
        self._local = self._anchor = None
        self.steps = self.samples = self.since_commit = 0
        self.waiting, self.committed_on, self.sent = False, -1, None
        self.feedback.residual.clear()
        self.resync = True

    def on_notice(self, notice: Notice) -> None:
        """One of our messages was refused. A refused commit no longer holds the device (bsp waits
        for parameters after a commit), and, for a reason in ``CARRIED``, its progress goes into
        the next commit. ``evicted``, and ``finished`` about our newest commit, end the device's part in
        the job (a ``finished`` one about another commit was queued for an earlier run or boot)."""
        self.notices.append(notice)
        self.events.warning("server rejected seq %s: %s: %s", notice.seq, notice.reason.value, notice.detail)
        if notice.reason is RejectReason.EVICTED:
            self.finished = True
            return
        sent = self.sent
        if sent is None or notice.seq != sent.seq:
            return
        if notice.reason is RejectReason.FINISHED:
            self.finished = True
            return
        self.sent = None
        self.waiting = False
        if self.committed_on == sent.base_version:
            self.committed_on = -1  # the server holds no commit of ours on this version
        if notice.reason in CARRIED and self._anchor is not None and sent.base_version <= self.server_version:
            self._anchor = {name: self._anchor[name] - sent.tensors[name] for name in self._anchor}
            self.steps += sent.steps
            self.samples += sent.samples

    def load_artifact(self, payload: bytes) -> bool:
        """Verify a model artifact and train with its trainer from the next step (``Backend``)."""
        shapes = None if self._replica is None else {name: tuple(v.shape) for name, v in self._replica.items()}
        return self.backend.load_artifact(payload, shapes)

    def on_params(self, frame: Frame) -> None:
        """A snapshot or a delta of a newer version: update the replica and adopt it. A snapshot
        carries its run (``seq``); before any Control it is held, after one only its run's count."""
        if frame.kind == FrameKind.PARAMS:
            if self.run is not None and frame.seq != self.run:
                return  # a snapshot of another run of the job
            if frame.seq == self._replica_run and frame.base_version <= self.server_version:
                return  # an old or repeated version
            if self._replica_run is not None and frame.seq != self._replica_run:
                self._forget_replica()
                self.resync = False  # this snapshot is the one a resync would fetch
            self._replica_run = frame.seq
            self.gap = False
            self._adopt(frame.base_version, frame.tensors)
        elif frame.kind == FrameKind.DELTA:
            if frame.base_version <= self.server_version:
                return
            if frame.seq != self.server_version or self._replica is None or self._replica_run != self.run:
                self.gap = True
                self.events.warning(
                    "delta %d->%d does not follow our version %d: resync",
                    frame.seq,
                    frame.base_version,
                    self.server_version,
                )
                return
            if set(frame.tensors) != set(self._replica):
                raise FrameError("a delta whose tensors are not the model's")
            self._adopt(frame.base_version, {name: self._replica[name] + frame.tensors[name] for name in self._replica})

    @property
    def replica(self) -> Params | None:
        """The newest global version this device holds (bit-identical to the server's broadcast view)."""
        return self._replica

    @property
    def base_version(self) -> int:
        """The version the next commit is based on: the newest one held."""
        return self.server_version

    def _adopt(self, version: int, replica: Params) -> None:
        """Train on ``replica`` from now on, carrying uncommitted progress over. A model this device's
        data does not fit ends the device's part (``fatal``) rather than failing on its first step."""
        if self._unfit(replica):
            return
        self.server_version = version
        self._replica = replica
        shapes = {name: values.shape for name, values in replica.items()}
        if self._local is not None and shapes != {name: values.shape for name, values in self._local.items()}:
            self._local = self._anchor = None  # not the model we trained: nothing to carry over
        if self._local is None or self._anchor is None or self.waiting:
            self._local = {name: values.copy() for name, values in replica.items()}
        else:
            self._local = {name: replica[name] + (self._local[name] - self._anchor[name]) for name in self._local}
        self._anchor = replica
        self.waiting = False

    # ------------------------------------------------------------------ work
    def step(self) -> list[Publish]:
        """One local SGD step (none when the device holds ``max_uncommitted_steps``); returns the
        commit when ``push_every`` steps are done."""
        if not self.ready:
            raise RuntimeError("step() called while the device is not ready")
        assert self.control is not None and self._local is not None
        self.trained = self.since_commit < self.control.max_uncommitted_steps
        if self.trained:
            self._train(self.control)
        return [self._commit()] if self._commit_due and self.fatal is None else []

    def _train(self, control: Control) -> None:
        assert self._local is not None
        batch = self.rng.integers(0, len(self.data), size=min(control.batch_size, len(self.data)))
        self.last_loss, grads = self.backend.loss_and_grads(self._local, self.data.x[batch], self.data.y[batch])
        if not np.isfinite(self.last_loss):  # diverged: every commit from here on would be refused as non_finite
            self._end(
                f"local training diverged (loss {self.last_loss} at step {self.steps + 1}): "
                f"the job's learning rate {control.lr} is too high for this model and data"
            )
            return
        lr = np.float32(control.lr)
        for name, g in grads.items():
            self._local[name] -= lr * g
        self.steps += 1
        self.since_commit += 1
        self.samples += len(batch)

    def timed_step(self, seconds: float) -> list[Publish]:
        """The driver timed the last ``step()`` (one that ``trained``): the retained online status
        again, with ``step_s``, when the speed meter says it should be reported. The server balances
        push_every with it from the first round on, instead of learning speeds from commits that a
        slow device may take long to make."""
        if self.speed.observe(seconds) is None:
            return []
        return [self.status("online")]

    @property
    def holding(self) -> bool:
        """acbsp: this version already has our commit; keep training and commit on the next one."""
        return (
            self.control is not None and self.control.one_commit_per_version and self.committed_on == self.base_version
        )

    def _commit(self) -> Publish:
        assert self.control is not None and self._local is not None and self._anchor is not None
        self.seq += 1
        delta = {name: self._local[name] - self._anchor[name] for name in self._local}
        sent, payload = self.feedback.encode_compact(delta, self.rng)  # the only encoding of this commit
        frame = Frame(
            kind=FrameKind.COMMIT,
            base_version=self.base_version,
            tensors=sent,
            device=self.device,
            seq=self.seq,
            samples=self.samples,
            steps=self.steps,
            codec=self.control.codec,
        )
        message = Publish(self.topics.grad(self.device), encode_compact(frame, payload), qos=1)
        self.sent = Sent(self.seq, self.base_version, sent, self.steps, self.samples, message)
        self.steps = self.samples = self.since_commit = 0
        self.committed_on = self.base_version
        self._anchor = {name: values.copy() for name, values in self._local.items()}
        self.waiting = self.control.wait_for_params
        return message

    # ------------------------------------------------------------------ time
    def on_tick(self, now: float, resend_s: float = RESEND_S) -> list[Publish]:
        """Time passes: the newest commit goes out again (``resend``) when it brought no new version
        and no commit followed it in ``resend_s`` seconds."""
        progress = (self.server_version, self.seq)
        if progress != self._progress or self._progress_at is None:
            self._progress, self._progress_at = progress, now
            return []
        if now - self._progress_at < resend_s:
            return []
        again = self.resend()
        if again:
            self._progress_at = now
            self.events.info("commit %d brought no new version in %g s: sending it again", self.seq, resend_s)
        return again

    def next_deadline(self, resend_s: float = RESEND_S) -> float | None:
        """When ``on_tick`` may next resend (None: no commit waited on)."""
        return None if self._progress_at is None or self.sent is None else self._progress_at + resend_s

    def resubscriptions(self) -> list[str]:
        """The snapshot topic, once, when a new run began (``resync``): its retained message is the
        run's newest version."""
        if not self.resync:
            return []
        self.resync = False
        return [self.topics.params]

    def account(self, now: float) -> None:
        """Count the time since the last call as busy (the device could train then) or idle."""
        if self._mark is not None:
            at, ready = self._mark
            if ready:
                self.busy_s += now - at
            else:
                self.idle_s += now - at
        self._mark = (now, self.ready)

    def resend(self) -> list[Publish]:
        """The newest commit again, the same bytes, while the device waits on it (for parameters,
        or, under one commit per version, for the next version, or, under ssp, for the slowest clock to
        move: a lost commit keeps ``slowest_clock`` below it for good). A commit the server never received
        (dropped by the broker while the server was not listening to this device, say) would
        otherwise hold the device for good, and a job it is alone in. A copy of a commit the server
        holds is counted as ``replayed`` and not noticed (docs/PROTOCOL.md §6): sending it twice
        applies it once. ``on_tick`` calls this after ``RESEND_S`` without news."""
        if self.sent is None or self.finished or not (self.waiting or self.holding or self.blocked):
            return []
        return [self.sent.message]
