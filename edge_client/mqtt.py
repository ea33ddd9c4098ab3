"""The MQTT driver of a device: broker in, DeviceCore, broker out."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from broker.client import BrokerAddress, MqttTransport, Transport, reachable
from edge_client.cache import cached_artifacts, save_artifact
from edge_client.core import DeviceCore
from edge_client.profile import DeviceProfile

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
RESEND_S = 30.0  # a commit that brought no new version in this long goes out again (DeviceCore.resend)


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
    profile = profile or DeviceProfile()
    if cache is not None and core.use_artifact:
        for payload in cached_artifacts(cache):
            if core.load_artifact(payload):
                break
    cached = core.backend.artifact
    clock = time.perf_counter
    mark = noted = since = clock()
    progress = (core.server_version, core.seq)  # a new version or a new commit restarts the resend clock
    while not core.finished and not (stop is not None and stop.is_set()):
        if (core.server_version, core.seq) != progress:
            progress, since = (core.server_version, core.seq), clock()
        elif clock() - since >= resend_s and (again := core.resend()):
            since = clock()
            log.info("commit %d brought no new version in %g s: sending it again", core.seq, resend_s)
            for message in again:
                transport.publish(message)
        training = core.ready  # the time until the next mark counts as busy or idle by this
        if training:
            noted = clock()
        elif clock() - noted >= WAIT_NOTE_S:  # a silent wait looks like a hang: say what is awaited
            noted = clock()
            log.info("waiting for %s", awaited(core))
        inbound = transport.receive(timeout=0.0 if training else 0.05)
        if inbound is not None:
            core.on_message(inbound.topic, inbound.payload)
            transport.ack(inbound)
            transport.subscribe_only(core.subscriptions())  # e.g. read the snapshot once, then deltas
            if core.resync:  # a new run of the job: its newest snapshot is the retained one
                core.resync = False
                transport.resubscribe([core.topics.params])
            if cache is not None and core.backend.artifact is not None and core.backend.artifact is not cached:
                save_artifact(cache, core.backend.artifact)
                cached = core.backend.artifact
        elif core.ready:
            started = clock()
            for message in core.step():
                transport.publish(message)
            elapsed = clock() - started
            pause = profile.step_time(elapsed) - elapsed if core.trained else 0.0  # a step at the cap only commits
            if pause > 0:  # never sleep(0): on a busy machine it gives the CPU away for a whole time slice
                time.sleep(pause)
            for message in core.timed_step(clock() - started) if core.trained else []:
                transport.publish(message)
        now = clock()
        if training:
            core.busy_s += now - mark
        else:
            core.idle_s += now - mark
        mark = now
        for event in core.events.take():  # what the core had to say
            log.log(event.level, event.message)
    transport.close(last=core.status("offline"), end_session=core.finished and core.fatal is None)  # job over
