"""Settings of one parameter-server job."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator

from schemas.codecs import make_codec
from schemas.messages import Name
from schemas.topics import check_name

#: Where ``edgeps ps`` (a server process) departs from ServerConfig's defaults, which suit the
#: simulator and tests: it publishes metrics at least every second, so that traffic shows
#: between versions.
PROCESS_DEFAULTS: dict[str, Any] = {"metrics_interval_s": 1.0}


class ServerConfig(BaseModel):
    """What the server needs to run a job; devices get their share through control messages.
    The one schema of the job's options: ``edgeps ps`` and ``edgeps demo`` derive their flags from
    it (edgeps/options.py), the simulator and the benches hold one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: Name = Field("demo", description="job name (topic prefix edgeps/JOB/)")
    pace: str = Field("bsp", description="bsp, acbsp, asp or ssp:S")
    rounds: int = Field(100, ge=1, description="global versions to produce before the job finishes")
    push_every: int = Field(10, ge=1, description="local steps per commit")
    lr: float = Field(0.2, gt=0, description="the devices' SGD learning rate")
    batch_size: int = Field(32, ge=1, description="the devices' batch size")
    loss: Name = Field(
        "cross_entropy",
        description="the loss devices train with and the server reports: cross_entropy, bce, mse, mae "
        "(docs/TASKS.md), or a task trainer's own",
    )
    metrics: str = Field(
        "",
        description="held-out metrics, comma-separated, the first the one reports and policies follow: accuracy, "
        "macro_f1 (classification), mse, mae, rmse (regression); default accuracy, or mse,mae for a regression",
    )
    codec: str = Field("fp32", description="codec devices use for their commits: fp32, fp16, int8, sign, ternary, "
                       "qsgd:S or topk:P")  # fmt: skip
    pull_codec: str = Field("fp32", description="fp32: broadcast snapshots; else compressed deltas in this codec")

    @field_validator("codec", "pull_codec")
    @classmethod
    def _known_codec(cls, spec: str) -> str:
        return make_codec(spec).spec

    @field_validator("pace")
    @classmethod
    def _known_pace(cls, spec: str) -> str:
        from ps_service.paces import make_pace

        return make_pace(spec).name

    duration_s: float | None = Field(
        None, gt=0, description="finish the job this many seconds after its start quorum (none: after --rounds)",
        json_schema_extra={"flag": "duration"},
    )  # fmt: skip
    min_devices: int = Field(
        1, ge=1, description="devices that must have come online before the first aggregate (a start quorum)"
    )
    round_deadline_s: float | None = Field(
        30.0, gt=0, description="bsp/acbsp: devices not committed this many seconds after a round began leave the "
        "barrier (0: none)", json_schema_extra={"flag": "round-deadline"},
    )  # fmt: skip
    max_commit_bytes: int | None = Field(
        None,
        ge=1024,
        description="largest commit accepted, bytes (default: the model's fp32 commit, the largest valid one)",
    )
    max_commit_rate: float | None = Field(
        1000.0,
        gt=0,
        description="commits per second a device may send, sustained (0: no limit); in bytes, as many as that "
        "many of the largest accepted commits",
    )
    max_commit_burst: int = Field(50, ge=1, description="commits a device may send at once")
    max_uncommitted_factor: int = Field(
        8, ge=1, description="a device holds at most this many times its push_every in uncommitted local steps"
    )
    clip_factor: float = Field(
        2.0,
        ge=1,
        description="a device's per-step update is clipped to this many times the fleet's median per-step norm "
        "(one below 1/16 of it is refused as outlier)",
    )
    samples_factor: float = Field(
        2.0, ge=1, description="a device's declared data size counts at most this many times the job's median"
    )
    max_device_samples: int | None = Field(
        None, ge=1, description="a ceiling on any device's declared data size (default: none)"
    )
    metrics_interval_s: float | None = Field(
        None, gt=0, description="also publish metrics when none went out for this many seconds (0: per version only)",
        json_schema_extra={"flag": "metrics-interval"},
    )  # fmt: skip
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

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The metrics to measure: those named, or the loss's default (learning.metrics.job_metrics)."""
        from learning.metrics import job_metrics

        return job_metrics(self.loss, [m.strip() for m in self.metrics.split(",") if m.strip()])

    @model_validator(mode="after")
    def _metrics_fit_loss(self) -> ServerConfig:
        self.metric_names  # noqa: B018  (LossError, a ValueError, for metrics the loss does not measure)
        return self

    @field_validator("frequency")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        from ps_service.frequency import make_policy

        make_policy(name, 1)
        return name

    allowed_devices: frozenset[str] | None = Field(
        None, description="comma-separated device ids allowed in the job (default: any)",
        json_schema_extra={"flag": "devices"},
    )  # fmt: skip
    sites: frozenset[str] | None = Field(
        None, description="comma-separated sites whose aggregators' site commits the server takes (part/{site}; "
        "default: none)",
    )  # fmt: skip

    sites_only: bool = Field(
        False, description="take commits only in site commits: ingest workers (edgeps aggregator --shared) read "
        "the devices' commit topics, the server none",
    )  # fmt: skip

    @field_validator("sites")
    @classmethod
    def _site_names(cls, sites: frozenset[str] | None) -> frozenset[str] | None:
        for site in sites or ():
            check_name(site, "site name")
        return sites

    @field_serializer("allowed_devices", "sites")
    def _sorted(self, devices: frozenset[str] | None) -> list[str] | None:
        """Sorted, so that a configuration's JSON is the same on every run (a checkpoint compares it)."""
        return None if devices is None else sorted(devices)
