"""Settings of one parameter-server job."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
    max_commit_bytes: int = Field(8 << 20, ge=1024)
    allowed_devices: frozenset[str] | None = None
