"""bsp: bulk synchronous rounds."""

from __future__ import annotations

from ps_service.paces.base import DeviceRules, Pace, register


@register
class Bsp(Pace):
    """Bulk synchronous: a round closes when every device in the barrier has committed;
    devices idle from their commit until the round's new parameters arrive."""

    name = "bsp"
    rounds = True

    def configure(self, device: str) -> DeviceRules:
        return DeviceRules(wait_for_params=True)

    def ready(self, barrier: frozenset[str]) -> bool:
        return bool(self._buffer) and not self.waiting_for(barrier)
