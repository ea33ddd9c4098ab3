"""Settings of one parameter-server job."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from schemas.codecs import make_codec


class ServerConfig(BaseModel):
    """What the server needs to run a job; devices get their share through control messages."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: str = "demo"
    pace: str = "bsp"
    rounds: int = Field(100, ge=1, description="global versions to produce before the job finishes")
    push_every: int = Field(10, ge=1, description="local steps per commit")
    lr: float = Field(0.2, gt=0)
    batch_size: int = Field(32, ge=1)
    codec: str = Field("fp32", description="codec devices use for their commits")
    pull_codec: str = Field("fp32", description="fp32: broadcast snapshots; else compressed deltas in this codec")

    @field_validator("codec", "pull_codec")
    @classmethod
    def _known_codec(cls, spec: str) -> str:
        return make_codec(spec).spec

    duration_s: float | None = Field(None, gt=0, description="finish the job this long after it started")
    min_devices: int = Field(
        1, ge=1, description="devices that must have come online before the first aggregate (a start quorum)"
    )
    round_deadline_s: float | None = Field(
        30.0, gt=0, description="bsp/acbsp: devices not committed this long after a round began leave the barrier"
    )
    max_commit_bytes: int | None = Field(
        None, ge=1024, description="largest commit accepted (None: the model's fp32 commit, the largest valid one)"
    )
    max_commit_rate: float | None = Field(
        100.0,
        gt=0,
        description="commits per second a device may send, sustained (None: no limit); in bytes, as many as that "
        "many of the largest accepted commits",
    )
    max_commit_burst: int = Field(50, ge=1, description="commits a device may send at once")
    max_uncommitted_factor: int = Field(
        8, ge=1, description="a device holds at most this many times its push_every in uncommitted local steps"
    )
    outlier_factor: float = Field(
        8.0,
        ge=1,
        description="a per-step update beyond this many times the others' median norm (or below a "
        "1/(2x) share of it) is refused as outlier",
    )
    samples_factor: float = Field(
        2.0, ge=1, description="a device's declared data size counts at most this many times the job's median"
    )
    max_device_samples: int | None = Field(None, ge=1, description="a ceiling on any device's declared data size")
    metrics_interval_s: float | None = Field(
        None, gt=0, description="also publish metrics when none went out for this long (None: per version only)"
    )
    frequency: str = Field("fixed", description="push_every policy: fixed, adacomm or trend")
    push_every_min: int = Field(1, ge=1, description="lower bound of push_every for adacomm and trend")
    push_every_max: int = Field(160, ge=1, description="upper bound of push_every for adacomm and trend")
    balance: Literal["off", "steps", "release"] = Field(
        "off",
        description="per device: steps = push_every in proportion to its step rate; release = a device much "
        "slower than the median leaves the barrier and commits at its own pace",
    )
    extrapolation: float | None = Field(
        None, ge=1, description="most an aggregate may be extrapolated (FedExP); None: the pace's (acbsp 3, else 1)"
    )
    eval_every: int = Field(1, ge=1, description="evaluate the global model every this many broadcast versions")
    eval_sample: int | None = Field(None, ge=1, description="evaluate on a fixed sample of this many held-out rows")

    @field_validator("frequency")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        from ps_service.frequency import make_policy

        make_policy(name, 1)
        return name

    allowed_devices: frozenset[str] | None = None

    @field_serializer("allowed_devices")
    def _sorted(self, devices: frozenset[str] | None) -> list[str] | None:
        """Sorted, so that a configuration's JSON is the same on every run (a checkpoint compares it)."""
        return None if devices is None else sorted(devices)
