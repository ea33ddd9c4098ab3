"""The server and device cores wired together in memory: a whole job, no broker."""

from __future__ import annotations

import pytest

from schemas.topics import Publish
from tests.helpers import small_device, small_server


def run_in_memory(pace: str, devices: int = 4, rounds: int = 20):
    server = small_server(pace=pace, rounds=rounds)
    cores = [small_device(f"d{i}", seed=i) for i in range(devices)]
    queue: list[Publish] = list(server.start(0.0))
    retained: dict[str, bytes] = {}

    def deliver(now: float) -> None:
        while queue:
            message = queue.pop(0)
            if message.retain:
                retained[message.topic] = message.payload
            if message.topic.startswith("edgeps/t/grad/") or message.topic.startswith("edgeps/t/status/"):
                queue.extend(server.on_message(message.topic, message.payload, now))
            for core in cores:
                if message.topic in core.subscriptions():
                    core.on_message(message.topic, message.payload)

    for core in cores:
        queue.append(core.status("online"))
        deliver(0.0)
        for topic, payload in retained.items():  # a late subscriber gets the retained messages
            if topic in core.subscriptions():
                core.on_message(topic, payload)
    tick = 0
    while not server.finished and tick < 10_000:
        tick += 1
        for core in cores:
            if core.ready:
                queue.extend(core.step())
        deliver(float(tick))
    return server, cores


@pytest.mark.parametrize("pace", ["bsp", "asp"])
def test_whole_job_learns_and_every_device_finishes(pace) -> None:
    server, cores = run_in_memory(pace)
    assert server.finished and server.store.version == 20
    assert server.history[-1].accuracy > 0.9 > server.history[0].accuracy
    assert all(core.finished for core in cores)
    assert server.traffic.rejected == {}
    if pace == "bsp":  # every round folds in one commit per device
        assert server.traffic.applied == 4 * 20
