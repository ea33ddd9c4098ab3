"""Devices' messages at the door: statuses (hello, will, speed reports) and commits.

Each is rate-limited, validated (ps_service.validation) and either refused with a counted
notice or handed on: a device online to the registry and the round, a commit to the pace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ps_service.round import release_slow
from ps_service.update import Partial, SiteUpdate
from ps_service.validation import Rejection, validate_commit
from schemas.frame import FrameError, peek_seq
from schemas.messages import MAX_JSON_BYTES, DeviceStatus, MessageError, RejectReason, SiteCommit, SiteEntry
from schemas.sitecommit import parse_site_commit
from schemas.topics import Publish

if TYPE_CHECKING:
    from ps_service.core import ServerCore


#: Statuses a device may send at once, and per second sustained (a hello per connection, a speed
#: report a second at most): a flood of statuses is refused as ``rate_limited``.
STATUS_BURST, STATUS_RATE = 10, 2.0


def on_status(core: ServerCore, device: str, payload: bytes, now: float) -> list[Publish]:
    """A device's hello (online) or last will (offline); an empty (cleared) status is offline."""
    record = core.registry.record(device)
    if record is not None and not record.statuses.take(1, now, STATUS_RATE, STATUS_BURST):
        return core.reject(device, Rejection(RejectReason.RATE_LIMITED, "statuses too often"), now)
    if not payload:
        return core.device_left(device, now)
    try:
        status = DeviceStatus.from_bytes(payload)
    except MessageError as exc:
        return core.reject(device, Rejection(RejectReason.MALFORMED, str(exc)))
    if status.device != device:
        return core.reject(device, Rejection(RejectReason.DEVICE_MISMATCH, f"status body names {status.device!r}"))
    if status.state == "offline":
        return core.device_left(device, now, status.incarnation)
    if not core.registry.permits(device):
        return core.reject(device, Rejection(RejectReason.UNKNOWN_DEVICE, f"{device!r} is not in this job"))
    assert status.incarnation is not None  # DeviceStatus requires it online
    if status.step_s is not None:
        core.frequency.balancer.on_report(device, status.step_s)
    first, rebooted = core.registry.set_online(device, status.samples, status.incarnation)
    if not first and not rebooted:  # already online: a speed report
        if status.step_s is None or not core.frequency.balancer.reacts_to_speed:
            return []  # (recomputing every device's push_every for a report costs O(fleet))
        return core.reassign() + release_slow(core, now)
    if rebooted and not first:
        core.events.info("device %s restarted (incarnation %d): its sequence resumes above %d", device,
                 status.incarnation, core.registry.record(device).seq_base)  # type: ignore[union-attr]  # fmt: skip
    core.events.info("device %s online (%d samples)", device, status.samples)
    if core.broadcaster.deltas:  # a joining device first reads the retained snapshot
        core.traffic.bytes_down += len(core.broadcaster.snapshot)
    out = [core.control(device)]
    if not core.round.quorum and len(core.registry.active()) >= core.config.min_devices:
        core.round.reach_quorum(now)  # the job's clock starts with its quorum
        core.events.info("start quorum of %d devices reached", core.config.min_devices)
        out += core.advance(now)
    return [*out, *core.barrier(now)]


def on_commit(core: ServerCore, device: str, payload: bytes, now: float, retained: bool = False) -> list[Publish]:
    """A commit frame on ``grad/{device}``: validate, buffer, maybe aggregate."""
    core.traffic.commits += 1
    core.traffic.bytes_up += len(payload)
    R = RejectReason
    if retained:  # left on the broker by someone: never a device's live work
        return core.reject(device, Rejection(R.RETAINED, "commits must not be retained", peek_seq(payload)))
    if core.finished:
        return core.reject(device, Rejection(R.FINISHED, "the job has finished", peek_seq(payload)))
    rate, burst, limit = core.config.max_commit_rate, core.config.max_commit_burst, core.commit_limit
    record = core.registry.record(device)
    if rate is not None and core.registry.permits(device):
        record = core.registry.limits(device)
        over = (f"more than {rate:g} commits/s" if not record.commits.take(1, now, rate, burst)
                else f"more than {rate * limit:g} bytes/s"
                if not record.bytes.take(len(payload), now, rate * limit, burst * limit) else None)  # fmt: skip
        if over is not None:
            return flooding(core, device, over, peek_seq(payload), now)
    try:
        update = validate_commit(
            payload,
            device,
            core.registry,
            core.store.version,
            core.store.shapes,
            core.commit_limit,
            frozenset({core.codec, core.previous_codec}),
        )
    except Rejection as rejection:
        # a copy of a commit the server holds (its work is in the model) gets no notice: the device
        # would send that work again
        redelivered = rejection.reason is R.REPLAYED and core.registry.redelivered(device, rejection.seq)
        out = core.count(rejection) if redelivered else core.reject(device, rejection)
        if rejection.reason in (R.REPLAYED, R.OUT_OF_ORDER) and record is not None:
            out += resequence(core, device)
        return out
    core.frequency.balancer.on_commit(device, update.steps, now)
    core.pace.add(update)
    if device in core.registry.active() and core.membership.on_commit(device, core.store.version - update.base_version):
        core.events.info("device %s rejoins the barrier", device)
    return core.advance(now) or core.barrier(now)


def on_site_commit(core: ServerCore, site: str, payload: bytes, now: float, retained: bool = False) -> list[Publish]:
    """A site commit on ``part/{site}`` (its aggregator's sum of its devices' commits): taken whole
    or refused whole. Its bytes and tensors are checked as a commit's are, each entry as its
    device's own commit would be (known, sequence number, version); a copy of a site commit the
    server holds (a redelivery: every entry ``replayed``) is counted and dropped silently. A refused
    one sends each device it names a notice: its own fault, or ``unprocessable`` naming another's."""
    core.traffic.bytes_up += len(payload)
    R = RejectReason
    try:
        if retained:
            raise Rejection(R.RETAINED, "site commits must not be retained")
        header, weighted = parse_site_commit(payload, core.store.shapes, core.commit_limit + MAX_JSON_BYTES + 4)
        if header.site != site:
            raise Rejection(R.DEVICE_MISMATCH, f"header says site {header.site!r}, topic says {site!r}")
        if header.version > core.store.version:
            raise Rejection(R.FUTURE_VERSION, f"made at version {header.version} > current {core.store.version}")
        if not all(np.isfinite(values).all() for values in weighted.values()):
            raise Rejection(R.NON_FINITE, "a tensor holds NaN or Inf")
    except (FrameError, MessageError) as exc:
        return _site_refused(core, site, None, Rejection(R.MALFORMED, str(exc)))
    except Rejection as rejection:
        return _site_refused(core, site, None, rejection)
    if core.finished:
        faults = {e.device: Rejection(R.FINISHED, "the job has finished", e.seq) for e in header.commits}
    else:
        faults = {e.device: fault for e in header.commits if (fault := _entry_fault(core, e, site)) is not None}
    if faults:
        copy = len(faults) == len(header.commits) and all(
            f.reason is R.REPLAYED and core.registry.redelivered(d, f.seq) for d, f in faults.items()
        )
        if not copy:
            return _site_refused(core, site, header, next(iter(faults.values())), faults)
        core.traffic.commits += len(faults)  # the whole site commit again: the server holds it
        for fault in faults.values():
            core.count(fault)
        return []
    core.traffic.commits += len(header.commits)
    for entry in header.commits:
        core.registry.check_seq(entry.device, entry.seq, ordered=not core.config.sites_only)
        core.registry.record(entry.device).site = site  # type: ignore[union-attr]
        core.frequency.balancer.on_commit(entry.device, entry.steps, now)
        lag = core.store.version - entry.base_version
        if entry.device in core.registry.active() and core.membership.on_commit(entry.device, lag):
            core.events.info("device %s rejoins the barrier", entry.device)
    part = Partial(weighted, header.data, tuple(e.steps for e in header.commits), header.spread)
    core.pace.add(SiteUpdate(site, header.seq, header.version, tuple(header.commits), part))
    return core.advance(now) or core.barrier(now)


def _entry_fault(core: ServerCore, entry: SiteEntry, via: str) -> Rejection | None:
    """What would refuse ``entry``, in a site commit from site ``via``, as its device's own commit
    (nothing recorded), or None. A device belongs to the first site whose site commit the server
    took for it (ingest workers, ``sites_only``, all carry every device): a site speaks for no other
    site's devices."""
    R = RejectReason
    if not core.registry.known(entry.device) or not core.registry.permits(entry.device):
        return Rejection(R.UNKNOWN_DEVICE, f"device {entry.device!r} has not announced itself online", entry.seq)
    site = core.registry.record(entry.device).site  # type: ignore[union-attr]  # known: checked above
    if site is not None and site != via and not core.config.sites_only:
        return Rejection(R.DEVICE_MISMATCH, f"device {entry.device!r} commits through site {site!r}", entry.seq)
    fault = core.registry.seq_fault(entry.device, entry.seq, ordered=not core.config.sites_only)
    if fault is not None:
        return Rejection(R(fault), f"sequence number {entry.seq} was already used or passed", entry.seq)
    if entry.base_version > core.store.version:
        return Rejection(R.FUTURE_VERSION, f"base version {entry.base_version} > current {core.store.version}",
                         entry.seq)  # fmt: skip
    return None


def _site_refused(
    core: ServerCore,
    site: str,
    header: SiteCommit | None,
    first: Rejection,
    faults: dict[str, Rejection] | None = None,
) -> list[Publish]:
    """A refused site commit: one counted rejection a commit it names (one in all when its header
    could not be read), and a notice to each device it names."""
    core.events.warning("site commit from %s refused: %s", site, first)
    if header is None:
        core.traffic.commits += 1
        return core.count(first)
    core.traffic.commits += len(header.commits)
    out: list[Publish] = []
    for entry in header.commits:
        own = (faults or {}).get(entry.device)
        why = own or Rejection(RejectReason.UNPROCESSABLE, f"site {site}'s commit was refused: {first}", entry.seq)
        out += core.reject(entry.device, why)
    return out


def flooding(core: ServerCore, device: str, over: str, seq: int | None, now: float) -> list[Publish]:
    """A commit beyond the device's rate limit: refused, and the server stops listening to the
    device's commits for a while (``DeviceRegistry.mute``), so that the broker drops a flood
    instead of queueing it in front of the other devices' commits."""
    if core.registry.muted(device):  # already in flight when it was muted
        return core.reject(device, Rejection(RejectReason.RATE_LIMITED, over, seq), now)
    duration = core.registry.mute(device, now)
    core.events.warning("device %s floods (%s): not listening to its commits for %g s", device, over, duration)
    detail = f"{over}: its commits are not received for {duration:g} s"
    record = core.registry.limits(device)
    record.noticed_at = None  # this notice goes out whatever the one-a-second rule says
    return core.reject(device, Rejection(RejectReason.RATE_LIMITED, detail, seq), now)


def resequence(core: ServerCore, device: str) -> list[Publish]:
    """A device used a sequence number at or below the highest received: its Control again,
    with where its numbers resume (it may have lost count: a restart the server did not see)."""
    record = core.registry.record(device)
    if record is None or record.incarnation is None or record.seq_base >= record.highest_seq:
        return []
    record.seq_base = record.highest_seq
    return [core.control(device)]
