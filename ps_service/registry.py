"""What the server knows of each device: online state, samples, and sequence numbers."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

RECENT_SEQS = 256


@dataclass
class DeviceRecord:
    online: bool = False
    samples: int = 0
    highest_seq: int = 0
    recent_seqs: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_SEQS))
    tokens: float | None = None  # the rate limiter's bucket; full when first used
    refilled_at: float = 0.0


class DeviceRegistry:
    """Devices seen on the status topic. Only known devices may commit.

    ``allowed``, when given, is the closed list of device ids this job accepts.
    """

    def __init__(self, allowed: frozenset[str] | None = None) -> None:
        self.allowed = allowed
        self.evicted: set[str] = set()  # removed by an operator: refused from then on
        self._devices: dict[str, DeviceRecord] = {}

    def permits(self, device: str) -> bool:
        return device not in self.evicted and (self.allowed is None or device in self.allowed)

    def evict(self, device: str) -> None:
        """Remove ``device`` from the job: its statuses and commits are refused from now on."""
        self.evicted.add(device)

    def set_online(self, device: str, samples: int) -> bool:
        """Mark ``device`` online; return True if it was not online before."""
        record = self._devices.setdefault(device, DeviceRecord())
        was_online, record.online, record.samples = record.online, True, samples
        return not was_online

    def set_offline(self, device: str) -> bool:
        """Mark ``device`` offline; return True if it was online before."""
        record = self._devices.get(device)
        if record is None or not record.online:
            return False
        record.online = False
        return True

    def known(self, device: str) -> bool:
        return device in self._devices

    def sizes(self) -> dict[str, int]:
        """Training samples each device said it holds."""
        return {d: r.samples for d, r in self._devices.items()}

    def slowest_clock(self, devices: frozenset[str]) -> int:
        """The lowest highest-sequence-number among ``devices`` (0 if none)."""
        return min((self._devices[d].highest_seq for d in devices if d in self._devices), default=0)

    def active(self) -> frozenset[str]:
        return frozenset(d for d, r in self._devices.items() if r.online)

    def take_token(self, device: str, now: float, rate: float, burst: int) -> bool:
        """Rate limiting, a token bucket per device: ``burst`` commits at once, ``rate`` per second
        sustained. False if ``device`` has none left (a device the registry does not know passes:
        validation refuses it anyway)."""
        record = self._devices.get(device)
        if record is None:
            return True
        if record.tokens is None:
            record.tokens, record.refilled_at = float(burst), now
        record.tokens = min(float(burst), record.tokens + max(0.0, now - record.refilled_at) * rate)
        record.refilled_at = now
        if record.tokens < 1.0:
            return False
        record.tokens -= 1.0
        return True

    def check_seq(self, device: str, seq: int) -> str | None:
        """Record ``seq`` for ``device``; return ``replayed`` or ``out_of_order`` if it may not be used."""
        record = self._devices[device]
        if seq in record.recent_seqs or seq == record.highest_seq:
            return "replayed"
        if seq < record.highest_seq:
            return "out_of_order"
        record.highest_seq = seq
        record.recent_seqs.append(seq)
        return None
