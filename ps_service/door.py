"""The one door every commit comes through: the server's, a site aggregator's and an ingest
worker's alike (docs/PROTOCOL.md §7, the order of the checks).

``Door.admit`` takes a device's commit frame and returns the ``Update`` it carries or the
``Refusal`` that says why not: retained, finished, the device's rate limits (in commits and in
bytes; beyond them the door stops listening to the device for a while: ``Refusal.muted``), the
commits the receiver already holds for it and in all (a memory budget), then the frame's own
checks (ps_service.validation: size, structure, kind, sender, sequence number, version, codec,
shapes, values). Every field is bounded to what the next stage can carry: a sequence number
beyond 2^53 - 1 (which a site commit cannot hold) is refused here, with a notice, instead of
failing the aggregator that would forward it. ``Door.admit_site`` does the same for a site
commit (``part/{site}``): the site's rate limits, its bytes, header and sums, and each entry as
its device's own commit would be checked, against the devices the deployment gave the site.

What a commit is checked against (the model's shapes, the version, the codecs) is the
receiver's knowledge, given as ``Checks``; what the door keeps is its sender's records (the
registry: sequence numbers, rate buckets, mutes) and the memory it has let in (``hold`` and
``release``). Pure logic: bytes and ``now`` in, updates or refusals out.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ps_service.config import DoorConfig
from ps_service.flat import Layout
from ps_service.registry import DeviceRegistry
from ps_service.update import Partial, SiteUpdate, Update
from ps_service.validation import Rejection, validate_commit
from schemas.frame import FrameError, fp32_commit_size, peek_seq
from schemas.messages import MAX_JSON_BYTES, DeviceStatus, MessageError, RejectReason
from schemas.sitecommit import SiteCommit, SiteEntry, parse_site_commit

R = RejectReason

#: Statuses a device may send at once, and per second sustained (a hello per connection, a speed
#: report a second at most): a flood of statuses is refused as ``rate_limited`` (at a site: ignored).
STATUS_BURST, STATUS_RATE = 10, 2.0
#: The largest commit taken before the receiver knows the model (a site aggregator just started).
UNKNOWN_MODEL_BYTES = 8 << 20
#: How far a site commit's sums may exceed what its entries state (float32 sums of float64 norms).
SUM_TOLERANCE = 1e-3


def finished(seq: int | None) -> Rejection:
    """Why every commit of a finished job is refused, by every receiver: no version will take it."""
    return Rejection(R.FINISHED, "the job has finished", seq)


class Checks(NamedTuple):
    """What the receiver checks a commit against: the version it knows, the model's ``shapes``,
    the ``codecs`` it accepts, and whether the job has ``finished``. (A NamedTuple: one is made
    for every commit.)"""

    version: int
    shapes: dict[str, tuple[int, ...]]
    codecs: frozenset[str]
    finished: bool = False
    layout: Layout | None = None  # ``shapes``' (ps_service.flat), where the receiver keeps one

    @property
    def values(self) -> int:
        return self.layout.size if self.layout is not None else sum(math.prod(s) for s in self.shapes.values())


class Refusal(NamedTuple):
    """A refused commit: ``rejection`` (reason, detail, seq), and what the receiver does besides:
    ``silent`` (a redelivered copy of one it holds: counted, no notice), ``muted`` (the door stopped
    listening to the sender for that many seconds), ``resequence`` (a known device used a spent
    sequence number: the server sends its Control again)."""

    rejection: Rejection
    silent: bool = False
    muted: float | None = None
    resequence: bool = False


class SiteRefusal(NamedTuple):
    """A refused site commit: the first fault, each entry's own fault by device, and its header
    when it could be read (each device it names is noticed); ``silent``: a redelivered copy."""

    rejection: Rejection
    header: SiteCommit | None = None
    faults: dict[str, Rejection] | None = None
    silent: bool = False
    muted: float | None = None


@dataclass
class Door:
    """Admission of commits (``admit``) and site commits (``admit_site``) for one receiver.
    ``ordered``: sequence numbers must rise strictly (else an anti-replay window: site commits of
    ingest workers may pass one another)."""

    config: DoorConfig
    registry: DeviceRegistry
    ordered: bool = True
    sites: DeviceRegistry = field(default_factory=DeviceRegistry)  # each site's rate buckets and mute
    held: Counter[str] = field(default_factory=Counter)  # commits held, by device (a site commit: by site)
    held_bytes: int = 0
    _limit: tuple[object, int] = (None, 0)  # (shapes, commit_limit): computed again for other shapes

    # ------------------------------------------------------------------ limits
    def commit_limit(self, shapes: dict[str, tuple[int, ...]]) -> int:
        """The largest commit accepted: the configured one, else the model's fp32 commit (before the
        model is known: ``UNKNOWN_MODEL_BYTES``)."""
        if self.config.max_commit_bytes:
            return self.config.max_commit_bytes
        if shapes is not self._limit[0]:  # a model's shapes come as the same dict at every commit
            self._limit = (shapes, fp32_commit_size(shapes) if shapes else UNKNOWN_MODEL_BYTES)
        return self._limit[1]

    def site_limit(self, shapes: dict[str, tuple[int, ...]]) -> int:
        """The largest site commit accepted: the largest commit, its header and its length field."""
        return self.commit_limit(shapes) + MAX_JSON_BYTES + 4

    @property
    def budget(self) -> int:
        return int(self.config.max_held_mib * (1 << 20))

    def _rate(self, record_of: DeviceRegistry, sender: str, size: int, limit: int, now: float) -> str | None:
        """Why ``sender``'s message of ``size`` bytes is beyond its rate limits, or None (and it is counted)."""
        rate, burst = self.config.max_commit_rate, self.config.max_commit_burst
        if rate is None:
            return None
        record = record_of.limits(sender)
        if not record.commits.take(1, now, rate, burst):
            return f"more than {rate:g} messages/s"
        if not record.bytes.take(size, now, rate * limit, burst * limit):
            return f"more than {rate * limit:g} bytes/s"
        return None

    def _flooding(self, record_of: DeviceRegistry, sender: str, over: str, now: float) -> tuple[str, float | None]:
        """A message beyond the rate: the door stops listening to ``sender`` (1 s, doubling while it
        goes on) unless it already did (a message in flight when it was muted)."""
        if record_of.muted(sender):
            return over, None
        duration = record_of.mute(sender, now)
        record_of.limits(sender).noticed_at = None  # this notice goes out whatever the one-a-second rule says
        return f"{over}: its messages are not received for {duration:g} s", duration

    def _room(self, sender: str, size: int) -> str | None:
        """Why no more can be held for ``sender`` (``size`` bytes more), or None."""
        if self.held[sender] >= self.config.max_held_commits:
            return f"{self.held[sender]} of its commits are held already (not yet aggregated)"
        if self.held_bytes + size > self.budget:
            return f"the receiver holds {self.held_bytes} bytes of commits (its budget: {self.budget})"
        return None

    # ------------------------------------------------------------------ commits
    def admit(
        self, device: str, payload: bytes, now: float, checks: Checks, retained: bool = False
    ) -> Update | Refusal:
        """A commit frame on ``grad/{device}``: its ``Update``, or why not (``screen``, then
        ``check``). The sequence number is used from the checks that say so on (docs/PROTOCOL.md §7)."""
        seq = peek_seq(payload)  # what a refusal names; the frame itself is read once, by ``check``
        refusal = self.screen(device, payload, now, checks, retained, seq)
        return refusal if refusal is not None else self.check(device, payload, checks, seq)

    def screen(
        self, device: str, payload: bytes, now: float, checks: Checks, retained: bool, seq: int | None
    ) -> Refusal | None:
        """The checks a commit meets on arrival, before anything of it is read or kept: retained,
        finished, the device's rate limits (a flood mutes it), and room for what it would hold.
        ``seq``: the commit's number as ``peek_seq`` reads it."""
        if retained:  # left on the broker by someone: never a device's live work
            return Refusal(Rejection(R.RETAINED, "commits must not be retained", seq))
        if checks.finished:
            return Refusal(finished(seq))
        if self.config.max_commit_rate is not None and self.registry.permits(device):
            over = self._rate(self.registry, device, len(payload), self.commit_limit(checks.shapes), now)
            if over is not None:
                detail, muted = self._flooding(self.registry, device, over, now)
                return Refusal(Rejection(R.RATE_LIMITED, detail, seq), muted=muted)
        full = self._room(device, max(len(payload), 4 * checks.values))
        if full is not None:
            return Refusal(Rejection(R.RATE_LIMITED, full, seq))
        return None

    def check(self, device: str, payload: bytes, checks: Checks, seq: int | None) -> Update | Refusal:
        """The frame's own checks (ps_service.validation), after ``screen`` (``seq``: as it peeked)."""
        try:
            limit = self.commit_limit(checks.shapes)
            args = (checks.version, checks.shapes, limit, checks.codecs)
            return validate_commit(payload, device, self.registry, *args, peeked=seq, layout=checks.layout)
        except Rejection as rejection:
            known = self.registry.record(device) is not None
            again = rejection.reason in (R.REPLAYED, R.OUT_OF_ORDER) and known
            return Refusal(rejection, silent=self._copy(device, rejection), resequence=again)

    def _copy(self, device: str, rejection: Rejection) -> bool:
        """Whether a refused commit is a copy of one the receiver holds (its work is in hand): counted,
        no notice (the device would send that work again)."""
        return rejection.reason is R.REPLAYED and self.registry.redelivered(device, rejection.seq)

    def read_status(self, device: str, payload: bytes, now: float) -> DeviceStatus | Rejection | None:
        """A device's status on ``status/{device}`` as every receiver reads it: why it is refused (too
        often, malformed, naming another device), None for a cleared (empty) one, else the status."""
        refused = self.status(device, now)
        if refused is not None:
            return refused
        if not payload:
            return None
        try:
            status = DeviceStatus.from_bytes(payload)
        except MessageError as exc:
            return Rejection(R.MALFORMED, str(exc))
        if status.device != device:
            return Rejection(R.DEVICE_MISMATCH, f"status body names {status.device!r}")
        return status

    def status(self, device: str, now: float) -> Rejection | None:
        """A device's status (hello, will, speed report; an empty one is offline) on arrival: None, or
        why it is refused (statuses too often: ``STATUS_RATE`` a second, bursts of ``STATUS_BURST``)."""
        record = self.registry.record(device)
        if record is not None and not record.statuses.take(1, now, STATUS_RATE, STATUS_BURST):
            return Rejection(R.RATE_LIMITED, "statuses too often")
        return None

    def hold(self, sender: str, nbytes: int) -> None:
        """The receiver keeps ``nbytes`` of ``sender``'s (a commit, until ``release``): counted
        against its budgets (``max_held_commits``, ``max_held_mib``)."""
        self.held[sender] += 1
        self.held_bytes += nbytes

    def release(self, sender: str, nbytes: int) -> None:
        """The receiver no longer keeps what ``hold`` counted (aggregated, sent up, or dropped)."""
        self.held[sender] -= 1
        if self.held[sender] <= 0:
            del self.held[sender]
        self.held_bytes = max(0, self.held_bytes - nbytes)

    def hold_updates(self, updates: Sequence[Update | SiteUpdate]) -> None:
        for update in updates:
            self.hold(update.device, nbytes(update))

    def release_updates(self, updates: Sequence[Update | SiteUpdate]) -> None:
        for update in updates:
            self.release(update.device, nbytes(update))

    # ------------------------------------------------------------------ site commits
    def admit_site(
        self,
        site: str,
        payload: bytes,
        now: float,
        checks: Checks,
        devices: frozenset[str] | None,
        retained: bool = False,
    ) -> SiteUpdate | SiteRefusal:
        """A site commit on ``part/{site}``: taken whole or refused whole. ``devices``: the devices
        the deployment gave the site (None: every device, an ingest worker's). Nothing is recorded
        but the site's rate buckets (the receiver records each entry's sequence number when it
        takes the site commit)."""
        if retained:
            return SiteRefusal(Rejection(R.RETAINED, "site commits must not be retained"))
        limit = self.site_limit(checks.shapes)
        over = self._rate(self.sites, site, len(payload), limit, now)
        if over is not None:
            detail, muted = self._flooding(self.sites, site, over, now)
            return SiteRefusal(Rejection(R.RATE_LIMITED, detail), muted=muted)
        try:
            header, weighted = parse_site_commit(payload, checks.shapes, limit)
            if header.site != site:
                raise Rejection(R.DEVICE_MISMATCH, f"header says site {header.site!r}, topic says {site!r}")
            if header.version > checks.version:
                raise Rejection(R.FUTURE_VERSION, f"made at version {header.version} > current {checks.version}")
            if not all(np.isfinite(values).all() for values in weighted.values()):
                raise Rejection(R.NON_FINITE, "a tensor holds NaN or Inf")
            _consistent(header, weighted)
        except (FrameError, MessageError) as exc:
            return SiteRefusal(Rejection(R.MALFORMED, str(exc)))
        except Rejection as rejection:
            return SiteRefusal(rejection)
        if checks.finished:
            faults = {e.device: finished(e.seq) for e in header.commits}
        else:
            faults = {e.device: f for e in header.commits if (f := self._entry_fault(e, site, checks, devices))}
        if faults:
            copy = len(faults) == len(header.commits) and all(self._copy(d, f) for d, f in faults.items())
            return SiteRefusal(next(iter(faults.values())), header, faults, silent=copy)
        full = self._room(f"site:{site}", 4 * checks.values)
        if full is not None:
            return SiteRefusal(Rejection(R.RATE_LIMITED, full), header)
        part = Partial(weighted, header.data, tuple(float(e.steps) for e in header.commits), header.spread)
        return SiteUpdate(site, header.seq, header.version, tuple(header.commits), part, header.refused)

    def _entry_fault(
        self, entry: SiteEntry, site: str, checks: Checks, devices: frozenset[str] | None
    ) -> Rejection | None:
        """What would refuse ``entry`` of a site commit from ``site`` as its device's own commit
        (nothing recorded), or None. A site speaks only for the devices the deployment gave it."""
        if not self.registry.known(entry.device) or not self.registry.permits(entry.device):
            return Rejection(R.UNKNOWN_DEVICE, f"device {entry.device!r} has not announced itself online", entry.seq)
        if devices is not None and entry.device not in devices:
            return Rejection(R.DEVICE_MISMATCH, f"device {entry.device!r} is not one of site {site!r}'s", entry.seq)
        fault = self.registry.seq_fault(entry.device, entry.seq, ordered=self.ordered)
        if fault is not None:
            return Rejection(R(fault), f"sequence number {entry.seq} was already used or passed", entry.seq)
        if entry.base_version > checks.version:
            return Rejection(
                R.FUTURE_VERSION, f"base version {entry.base_version} > current {checks.version}", entry.seq
            )
        return None


def _consistent(header: SiteCommit, weighted: dict[str, np.ndarray]) -> None:
    """Refuse (``malformed``) a site commit whose sums are not what its entries state: ``data`` the
    sum of the weights, ``spread`` the sum of weight x norm², and the weighted sum no longer than
    the sum of weight x norm (the triangle inequality): a site cannot hide a longer update than
    the norms it states, which the server bounds."""
    weights = sum(e.weight for e in header.commits)
    if not math.isclose(header.data, weights, rel_tol=1e-6):
        raise Rejection(R.MALFORMED, f"data {header.data:g} is not the entries' weights summed ({weights:g})")
    spread = sum(e.weight * e.norm**2 for e in header.commits)
    if not math.isclose(header.spread, spread, rel_tol=SUM_TOLERANCE, abs_tol=1e-30):
        raise Rejection(R.MALFORMED, f"spread {header.spread:g} is not the entries' weight x norm² ({spread:g})")
    length = math.sqrt(sum(float(np.vdot(v.astype(np.float64), v)) for v in weighted.values()))
    stated = sum(e.weight * e.norm for e in header.commits)
    if length > stated * (1 + SUM_TOLERANCE) + 1e-12:
        raise Rejection(R.MALFORMED, f"its sums are {length:g} long, more than its entries state ({stated:g})")


def nbytes(update: Update | SiteUpdate) -> int:
    """The memory an update holds: its tensors (a device's: its flat vector, of which they are views)."""
    if isinstance(update, Update) and update.flat is not None:
        return int(update.flat.nbytes)
    tensors = update.delta if isinstance(update, Update) else update.part.weighted
    return sum(int(values.nbytes) for values in tensors.values())
