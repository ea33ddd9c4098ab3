"""An operator's client of a job: one command and the server's reply (request/reply over MQTT),
and the job's metrics as they come. ``edgeps ctl`` is a thin shell over it."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from broker.client import BrokerAddress, MqttTransport, connect
from schemas.messages import Barrier, Command, Metrics, Reply
from schemas.topics import Publish, Topics

log = logging.getLogger("edgeps")


def _transport(address: BrokerAddress, subscriptions: list[str]) -> MqttTransport:
    """An operator's connection (no persistent session): MQTT 5 where the broker speaks it."""
    return connect(address, f"edgeps-ctl-{os.getpid()}-{time.time_ns()}", subscriptions, persistent=False)


def request(
    address: BrokerAddress, job: str, fields: dict[str, Any], timeout: float = 10.0, client: str | None = None
) -> Reply:
    """Send the command ``fields`` (``cmd`` and its arguments, as docs/PROTOCOL.md names them) to
    ``job`` and return the server's reply. The reply comes on ``reply/{client}`` (default: the
    account's username, else ``ctl-PID``), addressed by MQTT 5 properties or, over MQTT 3.1.1, by
    the command's ``reply_to`` and ``correlation``. With an account, the command goes on its own
    ``cmd/{username}`` (what `edgeps broker init` lets an operator write), else on ``cmd``.
    ValueError for a command the protocol refuses (before anything is sent); TimeoutError when no
    reply comes within ``timeout`` seconds."""
    topics = Topics(job)
    fields = {k: v for k, v in fields.items() if v is not None}
    Command.model_validate(fields)  # refused here, not by the server
    client = client or address.username or f"ctl-{os.getpid()}"
    correlation, reply_topic = f"{client}-{time.time_ns()}", topics.reply(client)
    cmd = topics.cmd_of(address.username) if address.username else topics.cmd
    transport = _transport(address, [reply_topic])
    try:
        if transport.mqtt5:  # the answer's address travels as MQTT 5 properties
            message = Publish(cmd, b"", qos=1, response_topic=reply_topic, correlation=correlation.encode())
        else:  # MQTT 3.1.1: in the command itself
            fields |= {"reply_to": reply_topic, "correlation": correlation}
            message = Publish(cmd, b"", qos=1)
        transport.publish(dataclasses.replace(message, payload=Command.model_validate(fields).to_bytes()))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            inbound = transport.receive(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            if inbound is None:
                continue
            reply = Reply.from_bytes(inbound.payload, tolerant=True)
            if reply.correlation == correlation:
                return reply
    finally:
        transport.close()
    raise TimeoutError(f"no reply within {timeout:g} s: is a server running job {job!r}?")


def watch(
    address: BrokerAddress, job: str, stop: threading.Event | None = None, note_s: float = 15.0
) -> Iterator[Metrics]:
    """The job's metrics records as the server publishes them, until it finishes (or ``stop``). A job
    that already finished (its retained barrier says so) ends the watch at once; while nothing comes,
    a line says so every ``note_s`` seconds."""
    topics = Topics(job)
    transport = _transport(address, [topics.metrics, topics.barrier])
    noted = time.monotonic()
    try:
        while stop is None or not stop.is_set():
            message = transport.receive(timeout=0.5)
            if message is None:
                if time.monotonic() - noted >= note_s:
                    noted = time.monotonic()
                    log.info("no metrics from job %s yet: is its server (edgeps ps --job %s) running?", job, job)
                continue
            noted = time.monotonic()
            if message.topic == topics.barrier:
                if message.retain and message.payload:
                    barrier = Barrier.from_bytes(message.payload, tolerant=True)
                    if barrier.state == "finished":
                        log.info("job %s has finished (version %d)", job, barrier.version)
                        return
                continue
            metrics = Metrics.from_bytes(message.payload, tolerant=True)
            yield metrics
            if metrics.finished:
                return
    finally:
        transport.close()
