"""Devices' messages at the door: statuses (hello, will, speed reports) and commits.

Each is rate-limited, validated (ps_service.validation) and either refused with a counted
notice or handed on: a device online to the registry and the round, a commit to the pace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ps_service.door import Refusal, SiteRefusal
from ps_service.validation import Rejection
from schemas.messages import DeviceStatus, RejectReason
from schemas.topics import Publish

if TYPE_CHECKING:
    from ps_service.server.job import Job


def on_status(job: Job, device: str, payload: bytes, now: float) -> list[Publish]:
    """A device's hello (online) or last will (offline); an empty (cleared) status is offline."""
    status = job.door.read_status(device, payload, now)
    if isinstance(status, Rejection):
        return job.reject(device, status, now)
    if status is None:  # cleared: offline
        return job.device_left(device, now)
    if status.state == "offline":
        return job.device_left(device, now, status.incarnation)
    if not job.registry.permits(device):
        return job.reject(device, Rejection(RejectReason.UNKNOWN_DEVICE, f"{device!r} is not in this job"))
    assert status.incarnation is not None  # DeviceStatus requires it online
    if status.error is not None:
        return unable(job, device, status, now)
    if job.registry.unable.pop(device, None) is not None:
        job.events.info("device %s can take part again", device)
    if status.step_s is not None:
        job.frequency.balancer.on_report(device, status.step_s)
    first, rebooted = job.registry.set_online(device, status.samples, status.incarnation)
    if not first and not rebooted:  # already online: a speed report
        if status.step_s is None or not job.frequency.balancer.reacts_to_speed:
            return []  # (recomputing every device's push_every for a report costs O(fleet))
        return job.reassign() + job.release_slow(now)
    record = job.registry.record(device)
    if rebooted and not first and record is not None:
        resumes = record.seq_base
        job.events.info(
            "device %s restarted (incarnation %d): its sequence resumes above %d", device, status.incarnation, resumes
        )
    job.events.info("device %s online (%d samples)", device, status.samples)
    if job.broadcaster.deltas:  # a joining device first reads the retained snapshot
        job.traffic.bytes_down += len(job.broadcaster.snapshot)
    out = [job.control(device)]
    if not job.round.quorum and len(job.registry.active()) >= job.config.min_devices:
        job.round.reach_quorum(now)  # the job's clock starts with its quorum
        job.events.info("start quorum of %d devices reached", job.config.min_devices)
        out += job.advance(now)
    return [*out, *job.barrier(now)]


def unable(job: Job, device: str, status: DeviceStatus, now: float) -> list[Publish]:
    """A device that says it cannot take part in the job as it stands (its trainer lacks the model,
    loss or codec; the model does not fit its memory): logged once per reason, kept for ``ctl
    status``, the metrics and the report, and out of the barrier, so that no round waits for it. A
    new incarnation still gets its Control: a new run may bring a model it can take."""
    assert status.incarnation is not None and status.error is not None
    if job.registry.unable.get(device) != status.error:
        job.events.warning("device %s cannot take part in the job: %s", device, status.error)
    job.registry.unable[device] = status.error
    _, rebooted = job.registry.set_online(device, status.samples, status.incarnation)
    return ([job.control(device)] if rebooted else []) + job.device_left(device, now, status.incarnation)


def on_commit(job: Job, device: str, payload: bytes, now: float, retained: bool = False) -> list[Publish]:
    """A commit frame on ``grad/{device}``: through the door (ps_service.door), buffered, maybe aggregated."""
    job.traffic.commits += 1
    job.traffic.bytes_up += len(payload)
    update = job.door.admit(device, payload, now, job.checks(), retained)
    if isinstance(update, Refusal):
        return refused(job, device, update, now)
    job.door.hold_updates([update])
    job.frequency.balancer.on_commit(device, update.steps, now)
    job.pace.add(update)
    if device in job.registry.active() and job.membership.on_commit(device, job.store.version - update.base_version):
        job.events.info("device %s rejoins the barrier", device)
    return job.advance(now) or job.barrier(now)


def refused(job: Job, device: str, refusal: Refusal, now: float) -> list[Publish]:
    """What a refused commit costs: counted, and noticed unless silent (a redelivered copy); a
    flood muted (the server stops listening to the device's commits: ``DeviceRegistry.mute``, so
    that the broker drops the flood instead of queueing it in front of the other devices'); a
    spent sequence number answered with the device's Control (``resequence``)."""
    out = job.report.refused(device, refusal, job.registry.record(device), now)
    return out + resequence(job, device) if refusal.resequence else out


def on_site_commit(job: Job, site: str, payload: bytes, now: float, retained: bool = False) -> list[Publish]:
    """A site commit on ``part/{site}`` (its aggregator's sum of its devices' commits): through the
    door (ps_service.door ``admit_site``), taken whole or refused whole. Taken, each entry counts as
    its device's commit (its sequence number, the round, membership, speed); the server bounds the
    site's sums with the fleet's bounds when it aggregates (ps_service.server.versions)."""
    job.traffic.bytes_up += len(payload)
    update = job.door.admit_site(site, payload, now, job.checks(), job.config.site_members(site), retained)
    if isinstance(update, SiteRefusal):
        return _site_refused(job, site, update, now)
    job.door.hold_updates([update])
    job.report.site_refusals(site, update.refused)
    job.traffic.commits += len(update.entries)
    for entry in update.entries:
        job.registry.check_seq(entry.device, entry.seq, ordered=job.door.ordered)
        job.frequency.balancer.on_commit(entry.device, entry.steps, now)
        lag = job.store.version - entry.base_version
        if entry.device in job.registry.active() and job.membership.on_commit(entry.device, lag):
            job.events.info("device %s rejoins the barrier", entry.device)
    job.pace.add(update)
    return job.advance(now) or job.barrier(now)


def _site_refused(job: Job, site: str, refusal: SiteRefusal, now: float) -> list[Publish]:
    """A refused site commit: one counted rejection a commit it names (one in all when its header
    could not be read), and a notice to each device it names: its own fault, or ``unprocessable``
    naming the site's. A redelivered copy of one the server holds is counted silently; a flood
    mutes the site (``subscriptions`` leaves its topic out for a while). Logged at the server's
    bounded rate, as devices' refusals are (``Report.reject``)."""
    first, header = refusal.rejection, refusal.header
    if refusal.muted is not None:
        job.events.warning(
            "site %s floods (%s): not listening to its site commits for %g s",
            site,
            first.detail.partition(":")[0],
            refusal.muted,
        )
    if header is None:
        job.traffic.commits += 1
        return job.report.reject(f"site {site}", first, job.door.sites.limits(site), now, notify=False)
    job.traffic.commits += len(header.commits)
    if refusal.silent:  # the whole site commit again: the server holds it
        for entry in header.commits:
            job.count((refusal.faults or {})[entry.device])
        return []
    out: list[Publish] = []
    for entry in header.commits:
        own = (refusal.faults or {}).get(entry.device)
        why = own or Rejection(RejectReason.UNPROCESSABLE, f"site {site}'s commit was refused: {first}", entry.seq)
        out += job.reject(entry.device, why)
    return out


def resequence(job: Job, device: str) -> list[Publish]:
    """A device used a sequence number at or below the highest received: its Control again,
    with where its numbers resume (it may have lost count: a restart the server did not see)."""
    record = job.registry.record(device)
    if record is None or record.incarnation is None or record.seq_base >= record.highest_seq:
        return []
    record.seq_base = record.highest_seq
    return [job.control(device)]
