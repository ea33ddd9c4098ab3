"""What the server knows of each device: online state, incarnation, samples, sequence numbers and
its rate limits."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

RECENT_SEQS = 256
#: The longest a flooding device is not listened to.
MUTE_MAX_S = 60.0


@dataclass
class TokenBucket:
    """``burst`` units at once, ``rate`` per second sustained; full when first used."""

    tokens: float | None = None
    refilled_at: float = 0.0

    def take(self, amount: float, now: float, rate: float, burst: float) -> bool:
        """Take ``amount`` units if the bucket holds them (an amount above ``burst`` passes only from a
        full bucket, leaving it empty); False otherwise, and nothing is taken."""
        if self.tokens is None:
            self.tokens, self.refilled_at = float(burst), now
        self.tokens = min(float(burst), self.tokens + max(0.0, now - self.refilled_at) * rate)
        self.refilled_at = now
        if self.tokens < min(amount, float(burst)):
            return False
        self.tokens = max(0.0, self.tokens - amount)
        return True

    def to_state(self, now: float) -> dict[str, Any]:
        return {"tokens": self.tokens, "age_s": now - self.refilled_at}

    @classmethod
    def from_state(cls, state: dict[str, Any], now: float) -> TokenBucket:
        return cls(state["tokens"], now - float(state["age_s"]))


@dataclass
class DeviceRecord:
    online: bool = False
    samples: int = 0
    incarnation: int | None = None  # the boot of the device last seen online
    seq_base: int = 0  # where that incarnation's sequence numbers resume (exclusive)
    first_seq: int = 0  # the highest number received when that incarnation came online: its own are above
    highest_seq: int = 0
    recent_seqs: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_SEQS))
    seq_floor: int = 0  # the highest number that left ``recent_seqs``: nothing at or below it is taken unordered
    commits: TokenBucket = field(default_factory=TokenBucket)  # rate limit in commits
    bytes: TokenBucket = field(default_factory=TokenBucket)  # rate limit in payload bytes
    statuses: TokenBucket = field(default_factory=TokenBucket)  # rate limit of status messages
    noticed_at: float | None = None  # when it last got a rate-limit notice (one a second at most)
    muted_until: float | None = None  # flooding: the server does not listen to its commits until then
    mutes: int = 0  # mutes in a row (each one twice as long), forgotten after a quiet MUTE_MAX_S

    def to_state(self, now: float) -> dict[str, Any]:
        return {
            "online": self.online,
            "samples": self.samples,
            "incarnation": self.incarnation,
            "seq_base": self.seq_base,
            "first_seq": self.first_seq,
            "highest_seq": self.highest_seq,
            "recent_seqs": list(self.recent_seqs),
            "seq_floor": self.seq_floor,
            "commits": self.commits.to_state(now),
            "bytes": self.bytes.to_state(now),
            "statuses": self.statuses.to_state(now),
            "noticed_age_s": None if self.noticed_at is None else now - self.noticed_at,
            "muted_for_s": None if self.muted_until is None else self.muted_until - now,
            "mutes": self.mutes,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], now: float) -> DeviceRecord:
        noticed, muted = state["noticed_age_s"], state["muted_for_s"]
        return cls(
            online=bool(state["online"]),
            samples=int(state["samples"]),
            incarnation=state["incarnation"],
            seq_base=int(state["seq_base"]),
            first_seq=int(state["first_seq"]),
            highest_seq=int(state["highest_seq"]),
            recent_seqs=deque((int(s) for s in state["recent_seqs"]), maxlen=RECENT_SEQS),
            seq_floor=int(state.get("seq_floor", 0)),  # checkpoints before 1.5 have none
            commits=TokenBucket.from_state(state["commits"], now),
            bytes=TokenBucket.from_state(state["bytes"], now),
            statuses=TokenBucket.from_state(state["statuses"], now),
            noticed_at=None if noticed is None else now - float(noticed),
            muted_until=None if muted is None else now + float(muted),
            mutes=int(state["mutes"]),
        )


class DeviceRegistry:
    """Devices seen on the status topic. Only known devices may commit.

    ``allowed``, when given, is the closed list of device ids this job accepts.
    """

    def __init__(self, allowed: frozenset[str] | None = None) -> None:
        self.allowed = allowed
        self.evicted: set[str] = set()  # removed by an operator: refused from then on
        self.unable: dict[str, str] = {}  # devices whose status says they cannot take part, and why (1.7)
        self._devices: dict[str, DeviceRecord] = {}
        self._active: frozenset[str] | None = None  # the online devices, until one comes or goes
        self._sizes: tuple[int, Mapping[str, int]] = (-1, {})  # (generation, sizes): sizes()
        self.generation = 0  # counts changes of who is online and what sizes they declared (for caches)

    def permits(self, device: str) -> bool:
        return device not in self.evicted and (self.allowed is None or device in self.allowed)

    def evict(self, device: str) -> None:
        """Remove ``device`` from the job: its statuses and commits are refused from now on."""
        self.evicted.add(device)

    def record(self, device: str) -> DeviceRecord | None:
        return self._devices.get(device)

    def limits(self, device: str) -> DeviceRecord:
        """``device``'s record, made if it has none, for its rate limits: a device the server hears
        from before its hello (one on the allow-list) is limited too; it is not ``known`` by this."""
        record = self._devices.get(device)
        if record is None:  # (not setdefault: a record is made only when there is none)
            record = self._devices[device] = DeviceRecord()
        return record

    def listening(self) -> list[str]:
        """The devices whose commits the server wants to receive, sorted: those on the allow-list and
        those that said hello, less evicted ones and those muted for flooding."""
        devices = set(self.allowed or ()) | {d for d, r in self._devices.items() if r.incarnation is not None}
        return sorted(d for d in devices if self.permits(d) and not self.muted(d))

    def muted(self, device: str) -> bool:
        record = self._devices.get(device)
        return record is not None and record.muted_until is not None

    def mute(self, device: str, now: float) -> float:
        """Stop listening to ``device`` (it floods): for 1 s, twice as long for each mute in a row
        (at most ``MUTE_MAX_S``); return for how long."""
        record = self.limits(device)
        quiet = record.noticed_at is None or now - record.noticed_at > MUTE_MAX_S
        record.mutes = 1 if quiet else record.mutes + 1
        duration = min(MUTE_MAX_S, 2.0 ** (record.mutes - 1))
        record.muted_until = now + duration
        return duration

    def unmute_due(self, now: float) -> list[str]:
        """Listen again to the devices whose mute is over; return them."""
        due = [d for d, r in self._devices.items() if r.muted_until is not None and r.muted_until <= now]
        for device in due:
            self._devices[device].muted_until = None
        return due

    def next_unmute(self) -> float | None:
        return min((r.muted_until for r in self._devices.values() if r.muted_until is not None), default=None)

    def set_online(self, device: str, samples: int, incarnation: int) -> tuple[bool, bool]:
        """Mark ``device`` online as ``incarnation``; return (it was not online before, the
        incarnation is new). A new incarnation's sequence numbers resume above the highest one
        received: a rebooted device that starts counting again loses nothing to ``replayed``, and
        a commit captured from an earlier incarnation stays refused."""
        record = self._devices.setdefault(device, DeviceRecord())
        new = record.incarnation != incarnation
        if new:
            record.incarnation, record.seq_base, record.first_seq = incarnation, record.highest_seq, record.highest_seq
        was_online, record.online, record.samples = record.online, True, samples
        if not was_online:  # a speed report from a device online already changes nothing here
            self._active = None
        self.generation += 1
        return not was_online, new

    def set_offline(self, device: str, incarnation: int | None = None) -> bool:
        """Mark ``device`` offline; return True if it was online before. An offline status of
        another incarnation (the last will of an earlier boot, delivered late) changes nothing."""
        record = self._devices.get(device)
        if record is None or not record.online:
            return False
        if incarnation is not None and incarnation != record.incarnation:
            return False
        record.online = False
        self._active = None
        self.generation += 1
        return True

    def devices(self) -> set[str]:
        """Every device id the server has a record of."""
        return set(self._devices)

    def known(self, device: str) -> bool:
        """Whether ``device`` ever said hello (an online status the server accepted)."""
        record = self._devices.get(device)
        return record is not None and record.incarnation is not None

    def sizes(self) -> Mapping[str, int]:
        """Training samples each device said it holds (read-only; kept until a device says another)."""
        if self._sizes[0] != self.generation:
            self._sizes = (self.generation, MappingProxyType({d: r.samples for d, r in self._devices.items()}))
        return self._sizes[1]

    def slowest_clock(self, devices: frozenset[str]) -> int:
        """The lowest highest-sequence-number among ``devices`` (0 if none)."""
        return min((self._devices[d].highest_seq for d in devices if d in self._devices), default=0)

    def active(self) -> frozenset[str]:
        """The online devices (asked several times per commit: kept until one comes or goes)."""
        if self._active is None:
            self._active = frozenset(d for d, r in self._devices.items() if r.online)
        return self._active

    def seq_fault(self, device: str, seq: int, ordered: bool = True) -> str | None:
        """``replayed`` or ``out_of_order`` if ``device`` may not use ``seq``, else None (nothing recorded).
        Not ``ordered`` (commits that came through several ingest workers, which may pass one another):
        a number below the highest is taken if it is not among the recent ones and above every number
        that left them (``seq_floor``), an anti-replay window."""
        record = self._devices[device]
        if seq > record.highest_seq:  # above every number taken (``recent_seqs`` holds none above it)
            return None
        if seq in record.recent_seqs or seq == record.highest_seq:
            return "replayed"
        if seq < record.highest_seq and (ordered or seq <= record.seq_floor):
            return "out_of_order"
        return None

    def check_seq(self, device: str, seq: int, ordered: bool = True) -> str | None:
        """Record ``seq`` for ``device``; return ``replayed`` or ``out_of_order`` if it may not be used."""
        fault = self.seq_fault(device, seq, ordered)
        if fault is not None:
            return fault
        record = self._devices[device]
        record.highest_seq = max(record.highest_seq, seq)
        if len(record.recent_seqs) == record.recent_seqs.maxlen:
            record.seq_floor = max(record.seq_floor, record.recent_seqs[0])
        record.recent_seqs.append(seq)
        return None

    def redelivered(self, device: str, seq: int | None) -> bool:
        """Whether ``seq``, refused as ``replayed``, is a number the device's current incarnation
        already delivered: a copy of a commit the server holds (an MQTT redelivery), not work the
        device lost count of."""
        record = self._devices.get(device)
        return record is not None and seq is not None and seq > record.first_seq and record.incarnation is not None

    def to_state(self, now: float) -> dict[str, Any]:
        return {
            "evicted": sorted(self.evicted),
            "devices": {device: record.to_state(now) for device, record in sorted(self._devices.items())},
        }

    def load_state(self, state: dict[str, Any], now: float) -> None:
        self.evicted = {str(d) for d in state["evicted"]}
        self._devices = {str(d): DeviceRecord.from_state(r, now) for d, r in state["devices"].items()}
        self._active = None
        self.generation += 1
