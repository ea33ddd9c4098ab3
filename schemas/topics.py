"""The MQTT topic tree of one training job.

The device id sits inside the topic so that broker ACLs can pin it (``pattern write
edgeps/+/grad/%u``); the server checks that a body's device id matches its topic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

ROOT = "edgeps"

# A device id or job name is a short, topic-safe token: no wildcards, no slashes.
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_NAME = re.compile(rf"^{NAME_PATTERN}$")


class TopicError(ValueError):
    """A topic, job name or device id that is not one of this protocol's."""


Kind = Literal["status", "grad", "ctrl", "notice"]


def check_name(name: str, what: str = "name") -> str:
    """Return ``name`` if it is a valid job or device id, else raise TopicError."""
    if not _NAME.match(name):
        raise TopicError(f"invalid {what} {name!r}: use 1-64 of [A-Za-z0-9_.-], starting alphanumeric")
    return name


#: Topics a ``Topics`` keeps parsed (a server parses every message's).
PARSED = 1 << 16


@dataclass(frozen=True)
class Topics:
    """Every topic of one job, by name."""

    job: str
    #: Topics ``parse`` read already (at most ``PARSED`` of them: the job's own, a few per device).
    _parsed: dict[str, tuple[str, str | None]] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_name(self.job, "job name")

    @property
    def prefix(self) -> str:
        return f"{ROOT}/{self.job}"

    def status(self, device: str) -> str:
        """device -> all, retained: hello/online; the last will says offline."""
        return f"{self.prefix}/status/{device}"

    def grad(self, device: str) -> str:
        """device -> PS, QoS 1: commit frames."""
        return f"{self.prefix}/grad/{device}"

    def ctrl(self, device: str) -> str:
        """PS -> device, retained: push_every, lr, batch size, barrier mode."""
        return f"{self.prefix}/ctrl/{device}"

    def notice(self, device: str) -> str:
        """PS -> device, not retained: why a message of this device was rejected."""
        return f"{self.prefix}/notice/{device}"

    @property
    def params(self) -> str:
        """PS -> devices, retained: the current parameter snapshot frame."""
        return f"{self.prefix}/params"

    @property
    def delta(self) -> str:
        """PS -> devices, not retained: compressed change from one broadcast version to the next."""
        return f"{self.prefix}/delta"

    @property
    def barrier(self) -> str:
        """PS -> devices, retained: round and barrier state."""
        return f"{self.prefix}/barrier"

    @property
    def metrics(self) -> str:
        """PS -> operators: accuracy, loss, traffic, rejections per version."""
        return f"{self.prefix}/metrics"

    @property
    def cmd(self) -> str:
        """operator -> PS: commands (schemas.messages.Command), from any client (the local demo's)."""
        return f"{self.prefix}/cmd"

    def cmd_of(self, operator: str) -> str:
        """operator ``operator`` -> PS: its commands, answered on its own ``reply/{operator}`` only
        (an ACL pins the topic to the account); ``+`` gives the wildcard."""
        return f"{self.prefix}/cmd/{operator if operator == '+' else check_name(operator, 'operator')}"

    def reply(self, client: str) -> str:
        """PS -> operator ``client``: the replies to its commands (the only topics replies go to);
        ``+`` gives the wildcard for ACLs."""
        return f"{self.prefix}/reply/{client if client == '+' else check_name(client, 'reply client')}"

    def site(self, site: str) -> str:
        """site broker -> operators, retained: its bridge to the core is up (``1``) or not (``0``);
        ``+`` gives the wildcard for ACLs."""
        return f"{self.prefix}/site/{site if site == '+' else check_name(site, 'site name')}"

    def part(self, site: str) -> str:
        """site aggregator -> PS, QoS 1: site commits (its devices' commits summed); ``+`` gives the
        wildcard."""
        return f"{self.prefix}/part/{site if site == '+' else check_name(site, 'site name')}"

    @property
    def model(self) -> str:
        """PS -> devices, retained: the model artifact (the devices' TFLite trainer)."""
        return f"{self.prefix}/model"

    # Subscriptions
    @property
    def all_status(self) -> str:
        return f"{self.prefix}/status/+"

    @property
    def all_grad(self) -> str:
        return f"{self.prefix}/grad/+"

    def parse(self, topic: str) -> tuple[str, str | None]:
        """Split a topic of this job into (kind, device or None); raise TopicError otherwise."""
        parsed = self._parsed.get(topic)
        if parsed is None:
            parsed = self._parse(topic)
            if len(self._parsed) < PARSED:
                self._parsed[topic] = parsed
        return parsed

    def _parse(self, topic: str) -> tuple[str, str | None]:
        head = self.prefix + "/"
        if not topic.startswith(head):
            raise TopicError(f"topic {topic!r} is not under {head!r}")
        parts = topic[len(head) :].split("/")
        if len(parts) == 1 and parts[0] in ("params", "delta", "barrier", "metrics", "cmd", "model"):
            return parts[0], None
        if len(parts) == 2 and parts[0] in ("status", "grad", "ctrl", "notice", "reply", "part", "cmd"):
            return parts[0], check_name(parts[1], "device id")
        raise TopicError(f"topic {topic!r} is not part of the edgeps topic tree")


@dataclass(frozen=True)
class Inbound:
    """A message a transport received, handed to a core (acknowledged to the broker once processed)."""

    topic: str
    payload: bytes
    mid: int = 0
    qos: int = 0
    response_topic: str | None = None  # MQTT 5: where the sender wants an answer
    correlation: bytes | None = None  # MQTT 5: echoed with the answer
    retain: bool = False  # the broker delivered a retained message (not one published live)
    duplicate: bool = False  # the broker delivers it again (MQTT DUP): it may have been received before


@dataclass(frozen=True)
class Publish:
    """A message a sans-IO core wants sent; a driver hands it to its transport."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False
    response_topic: str | None = None  # MQTT 5 only: where an answer should go
    correlation: bytes | None = None  # MQTT 5 only: what the answer echoes
