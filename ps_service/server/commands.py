"""The operator's command interpreter: a command on ``cmd`` in, the job's operation and a
reply out. A command is carried out whole or not at all."""

from __future__ import annotations

import base64
import io
import json
from typing import TYPE_CHECKING

import numpy as np

from ps_service.frequency import make_policy
from ps_service.paces import make_pace
from ps_service.round import JobState
from ps_service.server.readout import status
from schemas.messages import Command, MessageError, Notice, RejectReason, Reply
from schemas.topics import Publish, Topics

if TYPE_CHECKING:
    from ps_service.server.job import Job


class CommandError(ValueError):
    """A valid command that cannot be carried out (an unknown pace or device, crossing bounds)."""


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


def pause(job: Job, now: float) -> list[Publish]:
    """Stop making versions (commits are still accepted and buffered)."""
    if not job.finished:
        job.round.state = JobState.PAUSED
    return job.barrier(now)


def resume_aggregation(job: Job, now: float) -> list[Publish]:
    """Make versions again after ``pause``."""
    if job.paused:
        job.round.state = JobState.RUNNING
    return job.advance(now) or job.barrier(now)


def set_codec(job: Job, codec: str) -> list[Publish]:
    """Devices commit in ``codec`` from now on (commits in the previous one are still taken)."""
    job.previous_codec, job.codec = job.codec, codec
    return [job.control(device) for device in sorted(job.registry.active())]


def set_pace(job: Job, spec: str, now: float) -> list[Publish]:
    """Replace the pace; buffered commits carry over."""
    try:
        pace = make_pace(spec)  # before anything changes
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    for update in job.pace.take_all():  # buffered commits carry over to the new pace
        pace.add(update)
    job.pace = pace
    controls = [job.control(device) for device in sorted(job.registry.active())]
    return [*controls, *(job.advance(now) or job.barrier(now))]


def evict(job: Job, device: str, now: float) -> list[Publish]:
    """Remove ``device`` from the job (its buffered commits are dropped, counted)."""
    if not job.registry.known(device):
        raise CommandError(f"no device {device!r} in this job")
    job.registry.evict(device)
    dropped = job.pace.drop(device)  # its buffered commits go with it, counted
    job.door.release_updates(dropped)
    if dropped:
        job.traffic.rejected[RejectReason.EVICTED.value] += len(dropped)
    notice = Notice(device=device, reason=RejectReason.EVICTED, detail="an operator removed this device from the job")
    return [Publish(job.topics.notice(device), notice.to_bytes(), qos=1), *job.device_left(device, now)]


def set_frequency(job: Job, command: Command) -> list[Publish]:
    """set_frequency, freeze_frequency or unfreeze_frequency."""
    frequency = job.frequency
    if command.cmd == "freeze_frequency":
        frequency.freeze()
    elif command.cmd == "unfreeze_frequency":
        frequency.unfreeze()
    else:
        try:  # everything that can fail before anything changes
            policy = None
            if command.policy is not None and command.policy != frequency.policy.name:
                policy = make_policy(command.policy, job.config.push_every)
            frequency.set_bounds(command.low, command.high)  # refused if they cross the bound in force
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if policy is not None:
            frequency.set_policy(policy)
    return job.reassign()


#: What the reply to ``model`` may weigh beyond the largest commit: the broker that ``edgeps broker init``
#: sets up passes packets of 64 KiB more than that; the rest is for the topic and the JSON around the model.
MODEL_REPLY_ROOM = 60 * 1024


def model_reply(job: Job, which: str) -> tuple[str, int, str]:
    """(the ``which`` version's tensors as an .npz in base64, its version, what was done); CommandError
    when there is none yet or it is too large for a reply (``--save-model`` writes any size)."""
    if which == "best":
        best = job.report.best
        if best is None:
            raise CommandError("no version has been evaluated yet")
        params, version = best.params, best.version
    else:
        params, version = job.store.params(), job.store.version
    archive = io.BytesIO()
    np.savez(archive, **params)  # type: ignore[arg-type]  # numpy's stub types **kwds as bool
    text = base64.b64encode(archive.getvalue()).decode("ascii")
    limit = job.door.commit_limit(job.store.shapes) + MODEL_REPLY_ROOM
    if len(text) > limit:
        raise CommandError(
            f"the model is {len(text)} bytes in base64, more than a reply carries ({limit}): "
            "edgeps ps --save-model writes it"
        )
    return text, version, f"{which} model: version {version}"


def execute(job: Job, command: Command, now: float) -> tuple[list[Publish], str]:
    """(messages, what was done) for a valid command; ValueError changes nothing."""
    cmd = command.cmd
    if cmd in ("status", "model"):  # answered in the reply
        return [], ""
    if cmd == "pause":
        return pause(job, now), "aggregation paused"
    if cmd == "resume":
        return resume_aggregation(job, now), "aggregation resumed"
    if cmd == "set_codec" and command.codec is not None:
        return set_codec(job, command.codec), f"codec {job.codec}"
    if cmd == "set_pace" and command.pace is not None:
        return set_pace(job, command.pace, now), f"pace {job.pace.name}"
    if cmd == "evict" and command.device is not None:
        return evict(job, command.device, now), f"{command.device} evicted"
    if cmd in ("set_frequency", "freeze_frequency", "unfreeze_frequency"):
        return set_frequency(job, command), f"push_every base {job.frequency.base}"
    return job.finish(now), "job finished"


def on_command(
    job: Job,
    payload: bytes,
    now: float,
    response_topic: str | None,
    correlation_data: bytes | None,
    operator: str | None = None,
) -> list[Publish]:
    """An operator's command: carried out whole or not at all, answered when it asks for a reply
    (MQTT 5 response topic and correlation data, or the command's reply_to and correlation). One
    on ``cmd/{operator}`` (an ACL pins it to that account) is answered on ``reply/{operator}`` and
    nowhere else, whatever it asks: an operator cannot send replies to another's topic."""
    reply_to, correlation = reply_address(job.topics, payload)
    if reply_to is None and response_topic is not None:
        reply_to = reply_topic(job.topics, response_topic)
    if operator is not None and reply_to is not None:
        reply_to = job.topics.reply(operator)
    if correlation is None and correlation_data is not None:
        correlation = correlation_data.decode("utf-8", "replace")[:128]

    def answer(reply: Reply) -> list[Publish]:
        return [] if reply_to is None else [Publish(reply_to, reply.to_bytes(), qos=1, correlation=correlation_data)]

    try:
        command = Command.from_bytes(payload)
        arguments = command.model_dump(exclude={"cmd", "reason", "reply_to", "correlation"}, exclude_none=True)
        job.events.info(
            "operator command: %s %s%s",
            command.cmd,
            " ".join(f"{k}={v}" for k, v in arguments.items()),
            f" (reason: {command.reason})" if command.reason else "",
        )
        out, detail = execute(job, command, now)
    except (MessageError, CommandError) as exc:
        job.report.traffic.rejected[RejectReason.INVALID_COMMAND.value] += 1
        job.events.warning("rejected command: %s", exc)
        return answer(Reply(cmd=command_name(payload), correlation=correlation, ok=False, detail=str(exc)[:1024]))
    state = status(job, now) if command.cmd == "status" else None
    reply = Reply(cmd=command.cmd, correlation=correlation, ok=True, detail=detail, status=state)
    if command.cmd == "model":
        try:
            text, version, detail = model_reply(job, command.which or "last")
        except CommandError as exc:
            job.report.traffic.rejected[RejectReason.INVALID_COMMAND.value] += 1
            job.events.warning("rejected command: %s", exc)
            return answer(Reply(cmd=command.cmd, correlation=correlation, ok=False, detail=str(exc)[:1024]))
        reply = reply.model_copy(update={"model": text, "model_version": version, "detail": detail})
    return [*out, *answer(reply)]
