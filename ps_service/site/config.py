"""A site aggregator's or ingest worker's options: the one schema ``edgeps aggregator`` derives its
flags, TOML keys and ``EDGEPS_*`` variables from."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_validator

from ps_service.config import DoorConfig, nest_fields
from schemas.messages import Name


class SiteConfig(BaseModel):
    """A site aggregator's or ingest worker's options (``edgeps aggregator``); the door's bounds
    (``door``: rate limits, commit size, memory) are the server's options of the same names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: Name = Field("demo", description="the job's name")
    site: Name = Field(description="the site's name (its site commits go to edgeps/{job}/part/{site})")
    flush_s: float = Field(
        1.0, gt=0, description="a site commit goes out at the latest this many seconds after its first commit came"
    )
    shared: bool = Field(
        False,
        description="an ingest worker beside the server: read the job's commits from shared subscriptions "
        "$share/edgeps-{job}/edgeps/{job}/grad/{device} on the core broker, a site commit per batch",
    )
    allowed_devices: frozenset[str] | None = Field(
        None,
        description="comma-separated devices whose commits it reads from the start, as the server's --devices "
        "(default: each once its status came; a device's first commit can race its status)",
        json_schema_extra={"flag": "devices"},
    )
    door: DoorConfig = Field(DoorConfig(), description="the bounds of the door every commit comes through")

    @field_serializer("allowed_devices")
    def _sorted(self, devices: frozenset[str] | None) -> list[str] | None:
        return None if devices is None else sorted(devices)

    @model_validator(mode="before")
    @classmethod
    def _door_fields(cls, data: Any) -> Any:
        return nest_fields(data, cls, "door", DoorConfig, DoorConfig())
