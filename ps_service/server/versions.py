"""From buffered updates to published versions: outliers refused, data-size weights, the
pace's aggregate applied to the store, and the broadcast of the new parameters."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ps_service.aggregate import Clip, norm_kept, norms_hold
from ps_service.robust import bounded_part, bounded_sizes, claimed_sizes, per_device
from ps_service.round import JobState
from ps_service.server import readout
from ps_service.store import NonFinite
from ps_service.update import Contribution, SiteUpdate, Update
from ps_service.validation import Rejection
from schemas.messages import RejectReason
from schemas.topics import Publish

if TYPE_CHECKING:
    from ps_service.server.job import Job


def steady(job: Job) -> bool:
    """Whether FedExP's server step may extrapolate: only under a fixed push_every (an adaptive
    policy changes the local work per round, which the step takes as steady) and codecs whose
    noise leaves the norms it compares meaningful (``norms_hold``); measured in docs/FREQUENCY.md
    and docs/PACES.md."""
    return job.frequency.policy.name == "fixed" and all(map(norms_hold, (job.codec, job.config.pull_codec)))


def advance(job: Job, now: float) -> list[Publish]:
    """Make versions while the pace is ready: outliers refused, the rest aggregated, applied,
    and broadcast as often as the pace says."""
    out: list[Publish] = []
    while job.round.aggregating and job.pace.ready(job.barrier_set()):
        taken = job.pace.take()
        job.door.release_updates(taken)
        version = job.store.version
        direct = [u for u in taken if isinstance(u, Update)]
        sites = [u for u in taken if isinstance(u, SiteUpdate)]
        current = per_device(direct, version)
        stated = {e.device: (e.norm, float(e.steps)) for site in sites for e in site.entries}
        limits = job.bounds.limits(version, job.store.norm, {**stated, **current}, job.steps_ceiling())
        judged = {device: limits.judge(norm, steps) for device, (norm, steps) in current.items()}
        refused = {device for device, verdict in judged.items() if verdict.refused}
        kept = [u for u in direct if u.device not in refused]
        out += [refuse_outlier(job, u.device, u.seq) for u in direct if u.device in refused]
        parts, taken_from_sites = [], []
        for site in sites:
            part, verdicts = bounded_part(site, limits, job.weight_cap())
            judged.update(verdicts)
            for entry in site.entries:
                if verdicts[entry.device].refused:
                    out.append(refuse_outlier(job, entry.device, entry.seq))
                else:
                    taken_from_sites.append(entry)
            if part is not None:
                parts.append(dataclasses.replace(site, part=part))
        updates: list[Contribution] = [*kept, *parts]
        if not updates:
            continue
        clips = {d: Clip(v.scale, v.steps) for d, v in judged.items() if not v.refused and d in current}
        try:
            weights = sizes(job, kept)
            even = steady(job)
            cap = job.step_guard.limit(job.pace.step_cap(version, job.config.extrapolation, even))
            result = job.pace.aggregate(updates, version, weights, cap, even, norm_kept(job.codec), clips)
            job.store.apply_flat(result.flat)
            job.server_step = result.step
        except NonFinite as exc:  # validated updates summing to Inf: refuse the aggregate, keep the model
            commits = sum(len(u.devices) for u in updates)
            job.events.error("aggregate of %d commits refused: %s", commits, exc)
            job.traffic.rejected[RejectReason.NON_FINITE.value] += commits
            continue
        for device, verdict in judged.items():  # what was taken, as it was taken, is the fleet's history
            if not verdict.refused:
                norm = current[device][0] if device in current else stated[device][0]
                job.bounds.remember(device, norm * verdict.scale, verdict.steps, version)
        job.traffic.applied += len(kept) + len(taken_from_sites)
        if job.pace.rounds:
            job.membership.round_closed(now - job.round.opened)
        job.round.opened = now
        job.unbroadcast += 1
        last = last_version(job)
        if last or job.unbroadcast >= job.pace.broadcast_every(len(job.barrier_set())):
            out += job.broadcast_version(now)
        else:
            out += job.barrier(now)
    return out


def last_version(job: Job) -> bool:
    """Whether the newest version is the job's last: the ``rounds``-th, or without ``rounds``, one
    made ``patience`` broadcasts after the best evaluated so far (the held-out metric stopped
    improving; not for a job of a set ``duration_s``), or the ``max_rounds``-th."""
    config, version = job.config, job.store.version
    if config.rounds is not None:
        return version >= config.rounds
    if config.duration_s is not None:  # a job of a set duration ends by the clock (or at max_rounds)
        return version >= config.max_rounds
    best = job.report.best
    since = version - (best.version if best is not None else 0)
    broadcasts = since / job.pace.broadcast_every(len(job.barrier_set()))
    return version >= config.max_rounds or broadcasts >= config.patience


def refuse_outlier(job: Job, device: str, seq: int) -> Publish:
    detail = "its update is far shorter than the other devices' (ps_service.robust): not applied"
    [notice] = job.reject(device, Rejection(RejectReason.OUTLIER, detail, seq))
    return notice


def sizes(job: Job, updates: list[Update]) -> dict[str, int]:
    """The data size each device of an aggregate is weighted by: its claim, bounded by ``weight_cap``
    (none for a lone commit, asp's every version: one device's share is 1 whatever its size)."""
    if len(updates) == 1:
        return {}
    return bounded_sizes(claimed_sizes(updates, job.registry.sizes()), job.weight_cap())


def broadcast(job: Job, now: float) -> list[Publish]:
    """Publish the newest version (and, at the last one, finish): parameters, changed controls,
    the barrier and the metrics (evaluating when due)."""
    job.unbroadcast = 0
    messages, per_device = job.broadcaster.publish(job.store)
    job.last_broadcast = messages
    job.traffic.bytes_down += per_device * len(job.registry.active())
    readout.evaluate(job, now)  # when due: whether this version is the best decides whether the job goes on
    if last_version(job):
        job.round.state = JobState.FINISHED
    for device in job.registry.active():  # devices waiting for parameters train again from here
        if job.pace.configure(device).wait_for_params:
            job.frequency.balancer.on_ready(device, now)
    metrics = readout.metrics(job, now)  # evaluates, and the policy observes the evaluation
    changed = [] if job.finished else job.reassign()
    if job.pace.rounds and not job.finished:  # the new round waits only for those it should
        job.membership.release(job.frequency.released(sorted(job.registry.active())))
    out = [*messages, *changed, *job.barrier(now), metrics]
    if job.finished:
        job.events.info("job %s finished at version %d", job.config.job, job.store.version)
    return out
