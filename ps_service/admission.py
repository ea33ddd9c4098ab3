"""Devices' messages at the door: statuses (hello, will, speed reports) and commits.

Each is rate-limited, validated (ps_service.validation) and either refused with a counted
notice or handed on: a device online to the registry and the round, a commit to the pace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ps_service.door import STATUS_BURST, STATUS_RATE, Refusal, SiteRefusal
from ps_service.round import release_slow
from ps_service.validation import Rejection
from schemas.messages import DeviceStatus, MessageError, RejectReason
from schemas.topics import Publish

if TYPE_CHECKING:
    from ps_service.core import ServerCore


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
    if status.error is not None:
        return unable(core, device, status, now)
    if core.registry.unable.pop(device, None) is not None:
        core.events.info("device %s can take part again", device)
    if status.step_s is not None:
        core.frequency.balancer.on_report(device, status.step_s)
    first, rebooted = core.registry.set_online(device, status.samples, status.incarnation)
    if not first and not rebooted:  # already online: a speed report
        if status.step_s is None or not core.frequency.balancer.reacts_to_speed:
            return []  # (recomputing every device's push_every for a report costs O(fleet))
        return core.reassign() + release_slow(core, now)
    record = core.registry.record(device)
    if rebooted and not first and record is not None:
        resumes = record.seq_base
        core.events.info(
            "device %s restarted (incarnation %d): its sequence resumes above %d", device, status.incarnation, resumes
        )
    core.events.info("device %s online (%d samples)", device, status.samples)
    if core.broadcaster.deltas:  # a joining device first reads the retained snapshot
        core.traffic.bytes_down += len(core.broadcaster.snapshot)
    out = [core.control(device)]
    if not core.round.quorum and len(core.registry.active()) >= core.config.min_devices:
        core.round.reach_quorum(now)  # the job's clock starts with its quorum
        core.events.info("start quorum of %d devices reached", core.config.min_devices)
        out += core.advance(now)
    return [*out, *core.barrier(now)]


def unable(core: ServerCore, device: str, status: DeviceStatus, now: float) -> list[Publish]:
    """A device that says it cannot take part in the job as it stands (its trainer lacks the model,
    loss or codec; the model does not fit its memory): logged once per reason, kept for ``ctl
    status``, the metrics and the report, and out of the barrier, so that no round waits for it. A
    new incarnation still gets its Control: a new run may bring a model it can take."""
    assert status.incarnation is not None and status.error is not None
    if core.registry.unable.get(device) != status.error:
        core.events.warning("device %s cannot take part in the job: %s", device, status.error)
    core.registry.unable[device] = status.error
    _, rebooted = core.registry.set_online(device, status.samples, status.incarnation)
    return ([core.control(device)] if rebooted else []) + core.device_left(device, now, status.incarnation)


def on_commit(core: ServerCore, device: str, payload: bytes, now: float, retained: bool = False) -> list[Publish]:
    """A commit frame on ``grad/{device}``: through the door (ps_service.door), buffered, maybe aggregated."""
    core.traffic.commits += 1
    core.traffic.bytes_up += len(payload)
    update = core.door.admit(device, payload, now, core.checks(), retained)
    if isinstance(update, Refusal):
        return refused(core, device, update, now)
    core.door.hold_updates([update])
    core.frequency.balancer.on_commit(device, update.steps, now)
    core.pace.add(update)
    if device in core.registry.active() and core.membership.on_commit(device, core.store.version - update.base_version):
        core.events.info("device %s rejoins the barrier", device)
    return core.advance(now) or core.barrier(now)


def refused(core: ServerCore, device: str, refusal: Refusal, now: float) -> list[Publish]:
    """What a refused commit costs: counted, and noticed unless silent (a redelivered copy); a
    flood muted (the server stops listening to the device's commits: ``DeviceRegistry.mute``, so
    that the broker drops the flood instead of queueing it in front of the other devices'); a
    spent sequence number answered with the device's Control (``resequence``)."""
    rejection = refusal.rejection
    if refusal.muted is not None:
        core.events.warning(
            "device %s floods (%s): not listening to its commits for %g s",
            device,
            rejection.detail.partition(":")[0],
            refusal.muted,
        )
    if refusal.silent:
        out = core.count(rejection)
    else:
        out = core.reject(device, rejection, now if rejection.reason is RejectReason.RATE_LIMITED else None)
    return out + resequence(core, device) if refusal.resequence else out


def on_site_commit(core: ServerCore, site: str, payload: bytes, now: float, retained: bool = False) -> list[Publish]:
    """A site commit on ``part/{site}`` (its aggregator's sum of its devices' commits): through the
    door (ps_service.door ``admit_site``), taken whole or refused whole. Taken, each entry counts as
    its device's commit (its sequence number, the round, membership, speed); the server bounds the
    site's sums with the fleet's bounds when it aggregates (ps_service.versions)."""
    core.traffic.bytes_up += len(payload)
    update = core.door.admit_site(site, payload, now, core.checks(), core.config.site_members(site), retained)
    if isinstance(update, SiteRefusal):
        return _site_refused(core, site, update, now)
    core.door.hold_updates([update])
    core.report.site_refusals(site, update.refused)
    core.traffic.commits += len(update.entries)
    for entry in update.entries:
        core.registry.check_seq(entry.device, entry.seq, ordered=core.door.ordered)
        core.frequency.balancer.on_commit(entry.device, entry.steps, now)
        lag = core.store.version - entry.base_version
        if entry.device in core.registry.active() and core.membership.on_commit(entry.device, lag):
            core.events.info("device %s rejoins the barrier", entry.device)
    core.pace.add(update)
    return core.advance(now) or core.barrier(now)


def _site_refused(core: ServerCore, site: str, refusal: SiteRefusal, now: float) -> list[Publish]:
    """A refused site commit: one counted rejection a commit it names (one in all when its header
    could not be read), and a notice to each device it names: its own fault, or ``unprocessable``
    naming the site's. A redelivered copy of one the server holds is counted silently; a flood
    mutes the site (``subscriptions`` leaves its topic out for a while). Logged at the server's
    bounded rate, as devices' refusals are (``Report.reject``)."""
    first, header = refusal.rejection, refusal.header
    if refusal.muted is not None:
        core.events.warning(
            "site %s floods (%s): not listening to its site commits for %g s",
            site,
            first.detail.partition(":")[0],
            refusal.muted,
        )
    if header is None:
        core.traffic.commits += 1
        return core.report.reject(f"site {site}", first, core.door.sites.limits(site), now, notify=False)
    core.traffic.commits += len(header.commits)
    if refusal.silent:  # the whole site commit again: the server holds it
        for entry in header.commits:
            core.count((refusal.faults or {})[entry.device])
        return []
    out: list[Publish] = []
    for entry in header.commits:
        own = (refusal.faults or {}).get(entry.device)
        why = own or Rejection(RejectReason.UNPROCESSABLE, f"site {site}'s commit was refused: {first}", entry.seq)
        out += core.reject(entry.device, why)
    return out


def resequence(core: ServerCore, device: str) -> list[Publish]:
    """A device used a sequence number at or below the highest received: its Control again,
    with where its numbers resume (it may have lost count: a restart the server did not see)."""
    record = core.registry.record(device)
    if record is None or record.incarnation is None or record.seq_base >= record.highest_seq:
        return []
    record.seq_base = record.highest_seq
    return [core.control(device)]
