"""Device profiles: how fast a device computes and how fast its link is.

Real clients emulate the compute part; the simulator uses all of it to set its clock.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class DeviceProfile(BaseModel):
    """A class of device. ``step_s`` is a reference device's time per local step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    slowdown: float = Field(1.0, ge=1.0, description="compute time factor against the reference device")
    step_s: float = Field(0.0, ge=0.0, description="reference compute time per local step, seconds")
    up_bps: float = Field(2e6, gt=0, description="uplink bandwidth, bits per second")
    down_bps: float = Field(2e6, gt=0, description="downlink bandwidth, bits per second")
    latency_s: float = Field(0.02, ge=0, description="one-way latency to the broker, seconds")

    def step_time(self, measured_s: float = 0.0) -> float:
        """Seconds one local step takes on this device, given the host's measured time."""
        return max(measured_s, self.step_s) * self.slowdown

    def transfer_s(self, size: int, up: bool) -> float:
        """Seconds to move ``size`` bytes over this device's link (serialisation only)."""
        return 8 * size / (self.up_bps if up else self.down_bps)
