"""The sans-IO parameter server: decoded-or-raw messages in, messages to publish out.

It never touches a socket or the clock: every event carries ``now`` (seconds, from any
epoch), and every method returns the ``Publish`` list its driver must send. ``ServerCore`` is
the job's record (ps_service.server.job) and the one place its follow-ups are carried out: it routes
each message to its concern (admission, commands), and makes versions (ps_service.server.versions),
finishes the job, drops late devices and releases slow ones when a concern asks.
"""

from __future__ import annotations

import traceback
from typing import Any

from ps_service.round import JobState
from ps_service.server import admission, commands, readout, state, versions
from ps_service.server.job import BARRIER_DETAIL_S, Job, new_run
from ps_service.validation import Rejection
from schemas.frame import peek_seq
from schemas.messages import Metrics, RejectReason
from schemas.topics import Inbound, Publish

__all__ = ["BARRIER_DETAIL_S", "ServerCore", "new_run"]


class ServerCore(Job):
    """One training job's parameter server as a state machine (built as a ``Job``: a fresh server
    starts a new run, a server restored from its checkpoint keeps the saved one; devices that hold
    another run's parameters start again from this one's)."""

    def status(self, now: float) -> dict[str, Any]:
        """The job's state, for operators."""
        return readout.status(self, now)

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
        return [*model, *self.last_broadcast, *self.barrier(now, force=True), readout.metrics(self, now)]

    def to_state(self, now: float) -> dict[str, Any]:
        """What a checkpoint holds (ps_service.server.state)."""
        return state.to_state(self, now)

    def load_state(self, saved: dict[str, Any], history: list[Metrics], now: float) -> None:
        """Become the server ``to_state`` described (built with the same configuration)."""
        state.load_state(self, saved, history, now)

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

    # ------------------------------------------------- the driver's call shape (broker.driver.Core)
    @property
    def done(self) -> bool:
        return self.finished

    def receive(self, message: Inbound, now: float) -> list[Publish]:
        """``on_message`` for a message as a transport received it."""
        m = message
        return self.on_message(m.topic, m.payload, now, m.response_topic, m.correlation, m.retain)

    def after_batch(self, now: float) -> list[Publish]:
        return []  # everything happens as messages come (on_message) or time passes (on_tick)

    def resubscriptions(self) -> list[str]:
        return []

    def acknowledge(self, batch: list[Inbound]) -> list[Inbound]:
        return batch  # every message is processed within its turn

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
            return [*out, readout.metrics(self, now), *self.drop_late(now)]
        return [*out, *self.drop_late(now)]

    def next_deadline(self) -> float | None:
        """When ``on_tick`` next has something to do, on the core's clock (None: nothing timed in
        force): the open round's deadline, a mute that ends, metrics due on their interval, the
        job's duration, a barrier that waited. A driver sleeps until then unless a message comes first."""
        times = [self.registry.next_unmute(), self.door.sites.next_unmute(), self.round_due(), self._barrier_due]
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
        return [*self.barrier(now), readout.metrics(self, now)]

    # -------------------------------------------------------------- internals
    def device_left(self, device: str, now: float, incarnation: int | None = None) -> list[Publish]:
        if not self.registry.set_offline(device, incarnation):  # not online, or an earlier boot's will
            return []
        self.membership.forget(device)
        self.frequency.forget(device)
        self.events.info("device %s offline: it leaves the barrier", device)
        return self.advance(now) or self.barrier(now)

    def advance(self, now: float) -> list[Publish]:
        """Make versions while the pace is ready (ps_service.server.versions)."""
        return versions.advance(self, now)

    def broadcast_version(self, now: float) -> list[Publish]:
        """Publish the newest version (ps_service.server.versions)."""
        return versions.broadcast(self, now)

    def release_slow(self, now: float) -> list[Publish]:
        """Release balancing: the round stops waiting for devices much slower than the rest."""
        if not self.pace.rounds or not self.round.quorum or self.finished:
            return []
        released = self.frequency.released(sorted(self.registry.active())) - self.membership.left
        if not released:
            return []
        self.events.info("round %d does not wait for %s (slow)", self.store.version, ", ".join(sorted(released)))
        self.membership.release(released)
        return self.advance(now)

    def drop_late(self, now: float) -> list[Publish]:
        """Devices that let the open round's deadline pass leave the barrier; the round may close."""
        deadline = self.deadline_in_force()
        late = [] if deadline is None else self.round.late(self.waiting_for(), self.membership, deadline, now)
        if not late:
            return []
        self.membership.missed(late)
        self.events.warning("round %d deadline passed: %s leave the barrier", self.store.version, ", ".join(late))
        return self.advance(now) or self.barrier(now)
