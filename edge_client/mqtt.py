"""The MQTT driver of a device: broker in, DeviceCore, broker out."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from broker.client import BrokerAddress, MqttTransport, Transport
from edge_client.cache import cached_artifacts, save_artifact
from edge_client.core import DeviceCore
from edge_client.profile import DeviceProfile

log = logging.getLogger("edgeps.device")


def connect_device(core: DeviceCore, broker: BrokerAddress, timeout: float = 10.0) -> MqttTransport:
    """An MQTT transport with the device's subscriptions, hello on every connect and its last will."""
    transport = MqttTransport(
        broker,
        client_id=f"edgeps-dev-{core.topics.job}-{core.device}",
        subscriptions=core.subscriptions(),
        will=core.status("offline"),
        hello=core.status("online"),
    )
    transport.wait_connected(timeout)
    return transport


def run_device(
    core: DeviceCore,
    transport: Transport,
    profile: DeviceProfile | None = None,
    stop: threading.Event | None = None,
    cache: Path | None = None,
) -> None:
    """Train until the server says the job is finished (or ``stop`` is set), then leave cleanly.

    ``profile`` emulates a device class: each local step takes
    ``max(its measured time, profile.step_s) * profile.slowdown`` seconds. Time spent unable to train (waiting for
    parameters or the staleness bound) is counted in ``core.idle_s``, training in
    ``core.busy_s``; both go out in the final offline status. With ``cache``, verified model
    artifacts are kept there and the newest one that still verifies is used at start.
    """
    profile = profile or DeviceProfile()
    if cache is not None and core.use_artifact:
        for payload in cached_artifacts(cache):
            if core.load_artifact(payload):
                break
    cached = core.backend.artifact
    clock = time.perf_counter
    mark = clock()
    while not core.finished and not (stop is not None and stop.is_set()):
        training = core.ready  # the time until the next mark counts as busy or idle by this
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
            if core.trained:  # a step at the cap of uncommitted work only commits
                time.sleep(max(0.0, profile.step_time(elapsed) - elapsed))
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
    transport.close(last=core.status("offline"))
