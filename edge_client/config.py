"""Settings of one device process: which job, who it is, its data, its trainer."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.messages import DeviceId, Name


class DeviceConfig(BaseModel):
    """What ``edgeps client`` needs; the server's Control sets the rest (push_every, lr, codecs, ...).
    The one schema of a device's options: the client's flags derive from it (edgeps/options.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: Name = Field("demo", description="job name (topic prefix edgeps/JOB/)")
    device: DeviceId | None = Field(None, description="device id (also its MQTT topic segment); required")
    data: str | None = Field(
        None, description="the device's training shard, .npz with x and y; required without a task's device_data"
    )
    task: str | None = Field(None, description="a task file: its trainer and data (docs/TASKS.md)")
    backend: Literal["numpy", "tflite", "auto"] = Field(
        "numpy",
        description="numpy; tflite: the server's TFLite trainer (needs ai-edge-litert or tflite-runtime); "
        "auto: numpy until a runnable artifact arrives",
    )
    cache: str | None = Field(None, description="directory for verified model artifacts (tflite/auto)")
    slowdown: float = Field(1.0, gt=0, description="emulate a device this many times slower")
    step_time: float = Field(0.0, ge=0, description="emulated compute seconds per local step")
    seed: int = Field(0, description="seed of the device's batches and stochastic codecs")
