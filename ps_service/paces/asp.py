"""asp: asynchronous, every update applied on arrival."""

from __future__ import annotations

from ps_service.paces.base import DeviceRules, Pace, register
from ps_service.update import Contribution


@register
class Asp(Pace):
    """Asynchronous: every update is applied on arrival, mixed in with weight ``mixing`` times
    its staleness discount (after FedAsync)."""

    name = "asp"
    mixing = 0.5
    #: Versions per parameter broadcast, as a share of the fleet (see ``broadcast_every``).
    broadcast_share = 1.0

    def broadcast_every(self, fleet: int) -> int:
        """A version per commit broadcast to every device would flood the devices' downlinks
        (n devices, n broadcasts per fleet-round, each to n devices): broadcast once per
        ``broadcast_share * fleet`` versions, so devices get about one snapshot per commit of
        their own, as in push-then-pull ASP."""
        return max(1, round(self.broadcast_share * fleet))

    def configure(self, device: str) -> DeviceRules:
        return DeviceRules(one_commit_per_version=True)

    def ready(self, barrier: frozenset[str]) -> bool:
        return bool(self._buffer)

    def take(self) -> list[Contribution]:
        """The oldest buffered update with every other one buffered from the same device (there is
        more than one only while aggregation is paused or a device floods): a device's batch makes
        one version, as one device's share, however many commits it sent."""
        device = self._buffer[0].device
        taken = [u for u in self._buffer if u.device == device]
        self._buffer = [u for u in self._buffer if u.device != device]
        return taken
