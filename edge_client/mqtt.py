"""The MQTT driver of a device: broker in, DeviceCore, broker out."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from broker.client import BrokerAddress, MqttTransport, reachable
from broker.driver import drive
from broker.transport import Transport
from edge_client.cache import cached_artifacts, save_artifact
from edge_client.core import RESEND_S, DeviceCore
from edge_client.profile import DeviceProfile
from schemas.topics import Inbound, Publish

log = logging.getLogger("edgeps.device")


def connect_device(core: DeviceCore, broker: BrokerAddress, timeout: float = 10.0) -> MqttTransport:
    """An MQTT transport with the device's subscriptions, hello on every connect and its last will;
    ConnectionError at once if nothing listens at the broker's address."""
    reachable(broker, min(timeout, 5.0))
    transport = MqttTransport(
        broker,
        client_id=f"edgeps-dev-{core.topics.job}-{core.device}",
        subscriptions=core.subscriptions(),
        will=core.status("offline"),
        hello=core.status("online"),
    )
    transport.wait_connected(timeout)
    return transport


WAIT_NOTE_S = 15.0  # while the device cannot train, say what it waits for this often
DEVICE_IDLE_S = 0.05  # the longest wait for a message while the device cannot train


def awaited(core: DeviceCore) -> str:
    """What keeps ``core`` from training, for a person reading its log."""
    job = core.topics.job
    if core.control is None:
        return f"a Control from job {job}'s server (is `edgeps ps --job {job}` running on this broker?)"
    if core.replica is None:
        return f"job {job}'s parameters"
    if core.backend.trainer is None:
        return "the server's model artifact (--backend tflite: the server needs --export-tflite)"
    barrier = core.barrier
    if barrier is not None and barrier.state == "paused":
        return f"job {job} to resume (an operator paused it: edgeps ctl resume)"
    if core.blocked and core.control is not None:
        return (
            f"the slowest device: ssp's staleness bound ({core.control.staleness_bound} commits) holds this one "
            f"{core.seq - core.slowest_clock} commits ahead"
        )
    if barrier is not None and barrier.waiting_for:
        names = ", ".join(barrier.waiting_for[:5]) + (", ..." if len(barrier.waiting_for) > 5 else "")
        return f"version {barrier.version + 1}: the round waits for {len(barrier.waiting_for)} devices ({names})"
    if barrier is None or barrier.version == 0:
        return f"job {job}'s first version: its start quorum (edgeps ps --min-devices) and the round's commits"
    return f"version {barrier.version + 1}: the pace waits for this round's commits (this device holds its own)"


class Gateway:
    """A device's core for ``broker.driver.drive`` on this machine's clock: the DeviceCore, the
    emulated step time of its ``profile``, and its artifact ``cache``."""

    def __init__(
        self, core: DeviceCore, profile: DeviceProfile, cache: Path | None, resend_s: float, clock: Callable[[], float]
    ) -> None:
        self.core, self.profile, self.cache, self.resend_s, self.clock = core, profile, cache, resend_s, clock
        self.events = core.events
        self.cached = core.backend.artifact
        self.noted = clock()
        self.received = False  # a message came this turn: look for more before the next step

    @property
    def done(self) -> bool:
        return self.core.finished

    def receive(self, message: Inbound, now: float) -> list[Publish]:
        core = self.core
        self.received = True
        core.on_message(message.topic, message.payload)
        if self.cache is not None and core.backend.artifact is not None and core.backend.artifact is not self.cached:
            save_artifact(self.cache, core.backend.artifact)
            self.cached = core.backend.artifact
        return []

    def on_tick(self, now: float) -> list[Publish]:
        if self.core.ready:
            self.noted = now
        elif now - self.noted >= WAIT_NOTE_S:  # a silent wait looks like a hang: say what is awaited
            self.noted = now
            log.info("waiting for %s", awaited(self.core))
        return self.core.on_tick(now, self.resend_s)

    def after_batch(self, now: float) -> list[Publish]:
        """A local step when the device is ready and no message came this turn (the next turn reads
        what followed it first: the barrier that says finished right behind the last version),
        taking the time its profile says."""
        core, out = self.core, []
        if core.ready and not self.received:
            started = self.clock()
            out += core.step()
            elapsed = self.clock() - started
            pause = self.profile.step_time(elapsed) - elapsed if core.trained else 0.0  # a step at the cap only commits
            if pause > 0:  # never sleep(0): on a busy machine it gives the CPU away for a whole time slice
                time.sleep(pause)
            out += core.timed_step(self.clock() - started) if core.trained else []
        core.account(self.clock())
        self.received = False
        return out

    def next_deadline(self) -> float | None:
        return self.clock() if self.core.ready else self.core.next_deadline(self.resend_s)

    def subscriptions(self) -> list[str]:
        return self.core.subscriptions()

    def resubscriptions(self) -> list[str]:
        return self.core.resubscriptions()

    def acknowledge(self, batch: list[Inbound]) -> list[Inbound]:
        return batch


def run_device(
    core: DeviceCore,
    transport: Transport,
    profile: DeviceProfile | None = None,
    stop: threading.Event | None = None,
    cache: Path | None = None,
    resend_s: float = RESEND_S,
) -> None:
    """Train until the server says the job is finished (or ``stop`` is set), then leave cleanly.

    ``profile`` emulates a device class: each local step takes
    ``max(its measured time, profile.step_s) * profile.slowdown`` seconds. Time spent unable to train (waiting for
    parameters or the staleness bound) is counted in ``core.idle_s``, training in
    ``core.busy_s``; both go out in the final offline status. With ``cache``, verified model
    artifacts are kept there and the newest one that still verifies is used at start. A commit the
    device waits on that brought no new version within ``resend_s`` is sent again, the same bytes.
    """
    if cache is not None and core.use_artifact:
        for payload in cached_artifacts(cache):
            if core.load_artifact(payload):
                break
    clock = time.perf_counter
    gateway = Gateway(core, profile or DeviceProfile(), cache, resend_s, clock)
    drive(gateway, transport, clock, stop, idle_s=DEVICE_IDLE_S, log=log)
    transport.close(last=core.status("offline"), end_session=core.finished and core.fatal is None)  # job over
