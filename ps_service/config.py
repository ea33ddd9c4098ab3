"""Settings of one parameter-server job."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator
from pydantic.fields import FieldInfo

from schemas.codecs import make_codec
from schemas.messages import Name
from schemas.topics import check_name


class DoorConfig(BaseModel):
    """The bounds of the door (``Door``): one schema for the server, site aggregators and ingest
    workers, nested in each role's options (``ServerConfig``, ``SiteConfig``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_commit_bytes: int | None = Field(
        None,
        ge=1024,
        description="largest commit accepted, bytes (default: the model's fp32 commit, the largest valid one)",
    )
    max_commit_rate: float | None = Field(
        1000.0,
        gt=0,
        description="commits per second a device (or a site) may send, sustained (0: no limit); in bytes, as many "
        "as that many of the largest accepted commits",
    )
    max_commit_burst: int = Field(50, ge=1, description="commits a device (or a site) may send at once")
    max_held_commits: int = Field(
        16,
        ge=1,
        description="commits of one device held at once (accepted, not yet aggregated); more are refused "
        "as rate_limited (their work carries into the device's next commit)",
    )
    max_held_mib: float = Field(
        256.0, gt=0, description="MiB of commits held at once, all devices together (the same refusal beyond)"
    )


def nested_model(info: FieldInfo) -> type[BaseModel] | None:
    """The model a field holds, for a field that holds a set of options of its own (given flat:
    ``ServerConfig.door``'s options are ``--max-commit-rate`` and the rest)."""
    annotation = info.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def flat_names(model: type[BaseModel]) -> set[str]:
    """The names ``model`` takes flat: its fields, and those of the models it holds (``door``'s)."""
    names = set(model.model_fields)
    for info in model.model_fields.values():
        nested = nested_model(info)
        if nested is not None:
            names |= flat_names(nested)
    return names


def nest_fields(data: Any, holder: type[BaseModel], field: str, model: type[BaseModel], default: BaseModel) -> Any:
    """For a ``mode="before"`` validator of ``holder``, a model that holds a ``model`` in ``field``:
    the fields of ``model`` given flat in ``data`` (``rounds=15``) go into ``field`` (over
    ``default``'s values where ``data`` gives none), but for names ``holder`` has itself."""
    if not isinstance(data, dict):
        return data
    names = flat_names(model)
    flat = {k: v for k, v in data.items() if k in names and k not in holder.model_fields}
    if not flat:
        return data
    held = data.get(field, default)
    base = held.model_dump() if isinstance(held, BaseModel) else dict(held)
    return {**{k: v for k, v in data.items() if k not in flat}, field: {**base, **flat}}


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
    rounds: int | None = Field(
        None,
        ge=1,
        description="global versions to produce before the job finishes (default: until the held-out metric has "
        "not improved for --patience broadcasts, at most --max-rounds versions)",
    )
    patience: int = Field(
        100,
        ge=1,
        description="without --rounds: parameter broadcasts (one a round under bsp and acbsp, one per fleet of "
        "commits under asp) without a better held-out metric before the job finishes",
    )
    max_rounds: int = Field(5000, ge=1, description="without --rounds: the most global versions a job makes")
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
    codec: str = Field(
        "fp32", description="codec devices use for their commits: fp32, fp16, int8, sign, ternary, qsgd:S or topk:P"
    )
    pull_codec: str = Field("fp32", description="fp32: broadcast snapshots; else compressed deltas in this codec")

    @model_validator(mode="before")
    @classmethod
    def _door_fields(cls, data: Any) -> Any:
        """The door's options may be given flat (``ServerConfig(max_commit_rate=10)``)."""
        return nest_fields(data, cls, "door", DoorConfig, DoorConfig())

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
        None,
        gt=0,
        description="finish the job this many seconds after its start quorum (none: after --rounds)",
        json_schema_extra={"flag": "duration"},
    )
    min_devices: int = Field(
        1, ge=1, description="devices that must have come online before the first aggregate (a start quorum)"
    )
    round_deadline_s: float | None = Field(
        30.0,
        gt=0,
        description="bsp/acbsp: devices not committed this many seconds after a round began leave the "
        "barrier (0: none)",
        json_schema_extra={"flag": "round-deadline"},
    )
    door: DoorConfig = Field(DoorConfig(), description="the bounds of the door every commit comes through")
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
        1.0,
        ge=1,
        description="a device's declared data size counts at most this many times the lower median of "
        "the job's declared sizes (1: no device weighs more than the typical one)",
    )
    max_device_samples: int | None = Field(
        None, ge=1, description="a ceiling on any device's declared data size (default: none)"
    )
    metrics_interval_s: float | None = Field(
        None,
        gt=0,
        description="also publish metrics when none went out for this many seconds (0: per version only)",
        json_schema_extra={"flag": "metrics-interval"},
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
        None,
        description="comma-separated device ids allowed in the job (default: any)",
        json_schema_extra={"flag": "devices"},
    )
    site_devices: dict[str, frozenset[str]] | None = Field(
        None,
        description="a site aggregator's site and the devices it speaks for, as `edgeps broker init --site` "
        "gave them (repeat for each site; its site commits come on part/{site}): its site commits may name those "
        "devices and no others",
        json_schema_extra={"flag": "site", "metavar": "NAME=DEV,DEV"},
    )
    sites: frozenset[str] | None = Field(
        None,
        description="comma-separated ingest workers (edgeps aggregator --shared) whose site commits the "
        "server takes, each for any device; only with --sites-only (sites of devices: --site)",
    )

    sites_only: bool = Field(
        False,
        description="take commits only in site commits: ingest workers (edgeps aggregator --shared) read "
        "the devices' commit topics, the server none",
    )

    @field_validator("sites")
    @classmethod
    def _site_names(cls, sites: frozenset[str] | None) -> frozenset[str] | None:
        for site in sites or ():
            check_name(site, "site name")
        return sites

    @field_validator("site_devices", mode="before")
    @classmethod
    def _site_map(cls, value: Any) -> Any:
        """``NAME=DEV,DEV`` texts (the flag, repeated; a TOML list; or one text of them separated by
        spaces) as {site: devices}; a mapping as it is."""
        if value is None or isinstance(value, dict):
            return value
        entries = value.split() if isinstance(value, str) else list(value)
        sites: dict[str, frozenset[str]] = {}
        for entry in entries:
            name, _, devices = str(entry).partition("=")
            members = frozenset(d for d in devices.split(",") if d)
            if not name or not members or name in sites:
                raise ValueError(f"{entry!r}: give each site once, as NAME=DEV,DEV,...")
            sites[name] = members
        return sites

    @model_validator(mode="after")
    def _sites_speak_for_their_devices(self) -> ServerConfig:
        for site, members in (self.site_devices or {}).items():
            check_name(site, "site name")
            for device in members:
                check_name(device, "device id")
        shared = [
            d
            for d in set().union(*(self.site_devices or {}).values())
            if sum(d in m for m in (self.site_devices or {}).values()) > 1
        ]
        if shared:
            raise ValueError(f"--site: {', '.join(sorted(shared))} named by two sites; a device belongs to one site")
        if self.sites and not self.sites_only:
            raise ValueError(
                "--sites names ingest workers (with --sites-only); give a site's devices with --site "
                "NAME=DEV,DEV (a site speaks only for the devices the deployment gave it)"
            )
        if self.sites_only and not self.sites:
            raise ValueError("--sites-only takes commits only from ingest workers: name them with --sites")
        return self

    @property
    def site_names(self) -> frozenset[str]:
        """Every site whose site commits the server takes: the sites of devices and the ingest workers."""
        return frozenset(self.site_devices or ()) | (self.sites or frozenset())

    def site_members(self, site: str) -> frozenset[str] | None:
        """The devices ``site`` may speak for (None: any, an ingest worker's)."""
        return None if self.site_devices is None or site not in self.site_devices else self.site_devices[site]

    @field_serializer("allowed_devices", "sites")
    def _sorted(self, devices: frozenset[str] | None) -> list[str] | None:
        """Sorted, so that a configuration's JSON is the same on every run (a checkpoint compares it)."""
        return None if devices is None else sorted(devices)

    @field_serializer("site_devices")
    def _sorted_sites(self, sites: dict[str, frozenset[str]] | None) -> dict[str, list[str]] | None:
        return None if sites is None else {site: sorted(members) for site, members in sorted(sites.items())}
