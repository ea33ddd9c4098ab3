"""Pydantic models of every JSON message on the topic tree (see docs/PROTOCOL.md).

Every model forbids unknown fields, so a typo in a field name is an error rather than
a silently ignored setting: the server parses what it receives strictly. Devices parse what
the server sends with ``tolerant=True`` (unknown fields are dropped), so that a newer server
can add fields without breaking older devices. No float may be NaN or infinite.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from schemas.codecs import make_codec
from schemas.topics import NAME_PATTERN

#: A job name or a device id: one segment of the topic tree (``schemas.topics.NAME_PATTERN``).
Name = Annotated[str, StringConstraints(pattern=rf"^{NAME_PATTERN}$")]
DeviceId = Name

MAX_JSON_BYTES = 64 * 1024
FREQUENCY_POLICIES = ("fixed", "adacomm", "trend")
#: The largest integer every JSON implementation reads exactly (IEEE doubles): run ids and
#: incarnations stay at or below it.
MAX_SAFE_INT = 2**53 - 1
MAX_U32 = 2**32 - 1
#: A device re-publishes its status (a speed report) at most this often.
STATUS_INTERVAL_S = 1.0


class Message(BaseModel):
    """Base of all JSON messages: strict field names, finite numbers, compact UTF-8 JSON on the wire."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, payload: bytes, tolerant: bool = False) -> Self:
        """Parse and validate a payload; raise MessageError with a readable reason. ``tolerant``
        (devices reading what the server sends): fields this version does not know are dropped."""
        if len(payload) > MAX_JSON_BYTES:
            raise MessageError(f"{cls.__name__}: payload of {len(payload)} bytes exceeds {MAX_JSON_BYTES}")
        try:
            if not tolerant:
                return cls.model_validate_json(payload)
            try:
                body = json.loads(payload)
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                raise MessageError(f"{cls.__name__}: not JSON") from None
            if isinstance(body, dict):
                body = {key: value for key, value in body.items() if key in cls.model_fields}
            return cls.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise MessageError(f"{cls.__name__}: {where}: {first['msg']}") from exc


class MessageError(ValueError):
    """A JSON message that does not validate."""


#: A one-line human reason a device gives (printable ASCII, no quotes or backslashes: a C device
#: writes it without escaping).
Reason = Annotated[str, StringConstraints(pattern=r"^[ !#-\[\]-~]{1,200}$")]


def as_reason(text: str) -> str:
    """``text`` as a ``Reason``: its first line, at most 200 characters, any other character as '?'."""
    line = (text.strip().splitlines() or ["?"])[0][:200]
    return "".join(c if " " <= c <= "~" and c not in '"\\' else "?" for c in line) or "?"


class DeviceStatus(Message):
    """``status/{device}``, retained. ``online`` on connect; the last will publishes ``offline``.

    ``incarnation`` names this boot of the device (a random number, or a boot counter): the server
    answers a new one with where the device's sequence numbers resume (``Control.seq_base``), and
    ignores an ``offline`` status of an earlier incarnation (a late last will)."""

    device: DeviceId
    state: Literal["online", "offline"]
    incarnation: int | None = Field(
        None, ge=1, le=MAX_SAFE_INT, description="this boot of the device; required when online"
    )
    samples: int = Field(0, ge=0, le=MAX_U32, description="training samples held by the device")
    backend: str = Field("numpy", max_length=32)
    busy_s: float = Field(0.0, ge=0, description="seconds spent training so far (in the offline status: the total)")
    idle_s: float = Field(0.0, ge=0, description="seconds spent waiting for parameters or the staleness bound")
    step_s: float | None = Field(
        None, ge=1e-6, le=3600, description="measured compute seconds per local step (sent again when it drifts)"
    )
    error: Reason | None = Field(
        None,
        description="(1.7) why the device cannot take part in the job as it stands: a model, loss or codec its "
        "trainer lacks, a model too large for its memory; absent: it can",
    )

    @model_validator(mode="after")
    def _online_names_its_incarnation(self) -> DeviceStatus:
        if self.state == "online" and self.incarnation is None:
            raise ValueError("an online status needs its incarnation")
        return self


class Control(Message):
    """``ctrl/{device}``, retained: how this device trains and when it commits, for one incarnation
    of the device in one run of the job."""

    device: DeviceId
    run: int = Field(ge=1, le=MAX_SAFE_INT, description="the job's run: a new run starts from its own version 0")
    incarnation: int = Field(ge=1, le=MAX_SAFE_INT, description="the device incarnation this control answers")
    seq_base: int = Field(0, ge=0, description="the device's next commit has a sequence number above this")
    max_uncommitted_steps: int = Field(
        ge=1, le=10_000_000, description="a device does not train while it holds this many uncommitted steps"
    )
    push_every: int = Field(ge=1, le=100_000, description="local steps per commit")
    lr: float = Field(gt=0, le=100)
    batch_size: int = Field(ge=1, le=65_536)
    loss: Name = Field(
        "cross_entropy",
        description="the loss the device trains with (v1.2): cross_entropy, bce, mse, mae, or a task trainer's own",
    )
    codec: str = Field("fp32", description="codec spec for commit tensors, e.g. fp32, sign, topk:0.01")
    wait_for_params: bool = Field(
        description="after a commit, idle until parameters newer than the commit's base arrive (bsp)"
    )
    one_commit_per_version: bool = Field(
        False,
        description="acbsp: after a commit keep training, but commit again only once a newer version arrived",
    )
    staleness_bound: int | None = Field(
        None, ge=0, description="ssp: do not run more than this many commits ahead of the barrier's slowest_clock"
    )

    pull_codec: str = Field(
        "fp32", description="fp32: every version comes as a snapshot on params; else as a delta in this codec"
    )
    columns: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{16}$",
        description="(1.8) the fingerprint of the job's data columns and their scaling; a device whose rows "
        "have another does not train",
    )

    @field_validator("codec", "pull_codec")
    @classmethod
    def _known_codec(cls, spec: str) -> str:
        return make_codec(spec).spec  # CodecError is a ValueError: pydantic reports it


class Barrier(Message):
    """``barrier``, retained: the round in progress and who it waits for."""

    run: int = Field(ge=1, le=MAX_SAFE_INT, description="the job's run this barrier belongs to")
    round: int = Field(ge=0)
    version: int = Field(ge=0)
    pace: str
    state: Literal["running", "paused", "finished"]
    waiting_for: list[DeviceId] = Field(default_factory=list)
    committed: list[DeviceId] = Field(default_factory=list)
    left: list[DeviceId] = Field(default_factory=list, description="online devices dropped past the round deadline")
    slowest_clock: int = Field(0, ge=0, description="lowest commit sequence number among devices in the barrier")
    max_norm: float | None = Field(
        None, ge=0, description="the per-step update norm the server clips to now (site aggregators clip to it)"
    )
    max_weight: float | None = Field(
        None, gt=0, description="the most data size a device's update is weighted by now (site aggregators too)"
    )


class RejectReason(StrEnum):
    """Why the server refused an inbound message. Counted per reason in metrics."""

    MALFORMED = "malformed"  # the frame or JSON does not parse
    UNKNOWN_DEVICE = "unknown_device"  # no online status was seen for this device id
    DEVICE_MISMATCH = "device_mismatch"  # the body's device id differs from the topic's
    WRONG_KIND = "wrong_kind"  # a parameter frame on a commit topic, say
    UNSUPPORTED_CODEC = "unsupported_codec"
    SHAPE_MISMATCH = "shape_mismatch"  # tensor names, shapes or dtypes differ from the model's
    NON_FINITE = "non_finite"  # NaN or Inf in a tensor
    REPLAYED = "replayed"  # a sequence number already received from this device
    OUT_OF_ORDER = "out_of_order"  # a sequence number lower than one already received
    FUTURE_VERSION = "future_version"  # based on a parameter version the server never published
    OVERSIZED = "oversized"  # payload larger than the server accepts
    INVALID_COMMAND = "invalid_command"
    RATE_LIMITED = "rate_limited"  # more commits (or bytes) per second than the server allows a device
    EVICTED = "evicted"  # an operator removed the device from the job
    FINISHED = "finished"  # a commit after the job's last version
    WRONG_CODEC = "wrong_codec"  # a commit in a codec other than the one the job asked for
    RETAINED = "retained"  # a commit delivered as a retained message (left on the broker, not sent live)
    UNPROCESSABLE = "unprocessable"  # the server failed on this message (a bug): counted, acknowledged, dropped
    OUTLIER = "outlier"  # an update far larger or smaller than the other devices': left out of its aggregate


#: Rejections after which a device puts the refused commit's progress back into its next commit:
#: the work was valid, only its delivery was refused.
CARRIED = frozenset(
    {RejectReason.RATE_LIMITED, RejectReason.UNKNOWN_DEVICE, RejectReason.REPLAYED, RejectReason.OUT_OF_ORDER}
)


class Notice(Message):
    """``notice/{device}``: a message of this device was rejected and not applied."""

    device: str
    seq: int | None = None
    reason: RejectReason
    detail: str


class Metrics(Message):
    """``metrics``: one record per new global version, for operators and reports."""

    job: str
    run: int = Field(0, ge=0, description="the job's run")
    version: int
    round: int
    pace: str
    metric: str = Field("accuracy", description="the task's metric: the one `value` holds")
    value: float | None = Field(None, description="the task's metric on the held-out set (v1.2; always sent)")
    values: dict[str, float] = Field(default_factory=dict, description="every metric of the task, by name (v1.2)")
    accuracy: float | None = Field(description="held-out accuracy where the task measures it, else null")
    loss: float
    commits: int = Field(description="commits received, accepted or not")
    applied: int = Field(description="commits folded into the model")
    rejected: dict[str, int]
    bytes_up: int = Field(description="commit payload bytes received by the server")
    bytes_down: int = Field(description="parameter payload bytes delivered: frame size x devices online")
    devices_online: int
    elapsed_s: float = Field(description="seconds since the job started (its start quorum)")
    finished: bool = False
    evaluated_version: int = Field(0, description="the version accuracy and loss were measured on (every eval_every)")
    eval_s: float = Field(0.0, ge=0, description="server seconds spent evaluating so far")
    frequency: str = Field("fixed", description="the push_every policy in force")
    trend: float | None = Field(None, description="trend policy: share of the remaining error closed over its window")
    push_every: dict[str, int] = Field(default_factory=dict, description="push_every per online device")
    server_step: float = Field(1.0, ge=0, description="the last aggregate's step: 1 plain averaging, more extrapolated")
    unable: dict[DeviceId, str] = Field(
        default_factory=dict, description="(1.7) devices whose status says they cannot take part, with their reason"
    )
    baseline: dict[str, float] = Field(
        default_factory=dict,
        description="(1.8) every metric of a constant predictor on the held-out set: its most common class, "
        "or for a regression its mean",
    )


class Command(Message):
    """``cmd``: an operator's order to the server. With ``reply_to`` (a ``reply/{client}`` topic of
    the job) the server answers with a ``Reply`` carrying ``correlation``.

    ``status`` asks for the job's state; ``pause``, ``resume``, ``stop``; ``set_pace`` switches the
    ``pace``; ``set_codec`` the devices' commit ``codec``; ``set_frequency`` picks the push_every
    ``policy`` and/or its bounds ``low`` and ``high``; ``freeze_frequency`` holds the current
    base push_every until ``unfreeze_frequency``; ``evict`` removes ``device`` from the job;
    ``model`` asks for the parameters of the ``which`` version (``best`` by the job's metric, or the
    ``last``, the default), answered in the reply."""

    cmd: Literal[
        "status",
        "pause",
        "resume",
        "stop",
        "set_pace",
        "set_codec",
        "set_frequency",
        "freeze_frequency",
        "unfreeze_frequency",
        "evict",
        "model",
    ]
    which: Literal["best", "last"] | None = Field(None, description="(1.8) model: the best version or the last")
    reason: str = Field("", max_length=256)
    codec: str | None = Field(None, description="set_codec: the commit codec devices switch to")
    pace: str | None = Field(None, max_length=32, description="set_pace: bsp, acbsp, asp or ssp:S")
    device: DeviceId | None = Field(None, description="evict: the device to remove")
    policy: str | None = Field(None, description="set_frequency: fixed, adacomm or trend")
    low: int | None = Field(None, ge=1, le=100_000, description="set_frequency: lowest push_every")
    high: int | None = Field(None, ge=1, le=100_000, description="set_frequency: highest push_every")
    reply_to: str | None = Field(None, max_length=256, description="edgeps/{job}/reply/{client}")
    correlation: str | None = Field(None, max_length=128, description="echoed in the reply")

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, spec: str | None) -> str | None:
        return None if spec is None else make_codec(spec).spec

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str | None) -> str | None:
        if name is not None and name not in FREQUENCY_POLICIES:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(FREQUENCY_POLICIES)}")
        return name

    @model_validator(mode="after")
    def _arguments_fit_the_command(self) -> Command:
        if (self.cmd == "set_codec") != (self.codec is not None):
            raise ValueError("set_codec needs codec, and only set_codec takes one")
        if (self.cmd == "set_pace") != (self.pace is not None):
            raise ValueError("set_pace needs pace, and only set_pace takes one")
        if (self.cmd == "evict") != (self.device is not None):
            raise ValueError("evict needs device, and only evict takes one")
        if self.which is not None and self.cmd != "model":
            raise ValueError("only model takes which")
        frequency_args = (self.policy, self.low, self.high)
        if self.cmd == "set_frequency":
            if all(arg is None for arg in frequency_args):
                raise ValueError("set_frequency needs policy, low or high")
            if self.low is not None and self.high is not None and self.low > self.high:
                raise ValueError("set_frequency: low is above high")
        elif any(arg is not None for arg in frequency_args):
            raise ValueError("only set_frequency takes policy, low or high")
        return self


class Reply(Message):
    """``reply/{client}``: the server's answer to a command that asked for one."""

    cmd: str
    correlation: str | None = None
    ok: bool
    detail: str = Field("", max_length=1024, description="what was done, or why nothing was")
    status: dict[str, Any] | None = Field(None, description="status: the job's state")
    model: str | None = Field(None, description="(1.8) model: the version's tensors, an .npz file in base64")
    model_version: int | None = Field(None, ge=0, description="(1.8) model: the version it holds")
