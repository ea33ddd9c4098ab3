"""The operator's command interpreter: a command on ``cmd`` in, the core's operation and a
reply out. A command is carried out whole or not at all."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from ps_service.reporting import status
from schemas.messages import Command, RejectReason, Reply
from schemas.topics import Publish, Topics

if TYPE_CHECKING:
    from ps_service.core import ServerCore

log = logging.getLogger("edgeps.ps")


def command_name(payload: bytes) -> str:
    """The ``cmd`` field of a command that may not validate, for its error reply."""
    try:
        name = json.loads(payload).get("cmd")
    except (ValueError, AttributeError):
        return "invalid"
    return name[:32] if isinstance(name, str) else "invalid"


def reply_topic(topics: Topics, topic: object) -> str | None:
    """``topic`` if it is a ``reply/{client}`` topic of this job: replies go nowhere else."""
    if not isinstance(topic, str):
        return None
    try:
        kind, _ = topics.parse(topic)
    except ValueError:
        return None
    return topic if kind == "reply" else None


def reply_address(topics: Topics, payload: bytes) -> tuple[str | None, str | None]:
    """Where to answer a command (its ``reply_to``, a reply topic of this job) and its
    ``correlation``, read leniently so that an invalid command still gets its error reply."""
    try:
        body = json.loads(payload) if len(payload) <= 64 * 1024 else None
    except ValueError:
        return None, None
    if not isinstance(body, dict):
        return None, None
    correlation = body.get("correlation")
    return reply_topic(topics, body.get("reply_to")), correlation[:128] if isinstance(correlation, str) else None


def execute(core: ServerCore, command: Command, now: float) -> tuple[list[Publish], str]:
    """(messages, what was done) for a valid command; ValueError changes nothing."""
    cmd = command.cmd
    if cmd == "status":
        return [], ""
    if cmd == "pause":
        return core.pause(), "aggregation paused"
    if cmd == "resume":
        return core.resume_aggregation(now), "aggregation resumed"
    if cmd == "set_codec" and command.codec is not None:
        return core.set_codec(command.codec), f"codec {core.codec}"
    if cmd == "set_pace" and command.pace is not None:
        return core.set_pace(command.pace, now), f"pace {core.pace.name}"
    if cmd == "evict" and command.device is not None:
        return core.evict(command.device, now), f"{command.device} evicted"
    if cmd in ("set_frequency", "freeze_frequency", "unfreeze_frequency"):
        return core.set_frequency(command), f"push_every base {core.frequency.base}"
    return core.finish(now), "job finished"


def on_command(
    core: ServerCore, payload: bytes, now: float, response_topic: str | None, correlation_data: bytes | None
) -> list[Publish]:
    """An operator's command: carried out whole or not at all, answered when it asks for a reply
    (MQTT 5 response topic and correlation data, or the command's reply_to and correlation)."""
    reply_to, correlation = reply_address(core.topics, payload)
    if reply_to is None and response_topic is not None:
        reply_to = reply_topic(core.topics, response_topic)
    if correlation is None and correlation_data is not None:
        correlation = correlation_data.decode("utf-8", "replace")[:128]

    def answer(reply: Reply) -> list[Publish]:
        return [] if reply_to is None else [Publish(reply_to, reply.to_bytes(), qos=1, correlation=correlation_data)]

    try:
        command = Command.from_bytes(payload)
        log.info("operator command: %s %s", command.cmd, command.reason)
        out, detail = execute(core, command, now)
    except ValueError as exc:  # MessageError, an unknown pace, bounds that cross ...
        core.report.traffic.rejected[RejectReason.INVALID_COMMAND.value] += 1
        log.warning("rejected command: %s", exc)
        return answer(Reply(cmd=command_name(payload), correlation=correlation, ok=False, detail=str(exc)[:1024]))
    state = status(core, now) if command.cmd == "status" else None
    return [*out, *answer(Reply(cmd=command.cmd, correlation=correlation, ok=True, detail=detail, status=state))]
