"""From buffered updates to published versions: outliers refused, data-size weights, the
pace's aggregate applied to the store, and the broadcast of the new parameters."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ps_service import reporting
from ps_service.aggregate import Clip, norm_kept, norms_hold
from ps_service.robust import bounded_part, bounded_sizes, claimed_sizes, per_device, size_cap
from ps_service.round import JobState
from ps_service.store import NonFinite
from ps_service.update import Contribution, SiteUpdate, Update
from ps_service.validation import Rejection
from schemas.messages import RejectReason
from schemas.topics import Publish

if TYPE_CHECKING:
    from ps_service.core import ServerCore


def steady(core: ServerCore) -> bool:
    """Whether FedExP's server step may extrapolate: only under a fixed push_every (an adaptive
    policy changes the local work per round, which the step takes as steady) and codecs whose
    noise leaves the norms it compares meaningful (``norms_hold``); measured in docs/FREQUENCY.md
    and docs/PACES.md."""
    return core.frequency.policy.name == "fixed" and all(map(norms_hold, (core.codec, core.config.pull_codec)))


def advance(core: ServerCore, now: float) -> list[Publish]:
    """Make versions while the pace is ready: outliers refused, the rest aggregated, applied,
    and broadcast as often as the pace says."""
    out: list[Publish] = []
    while core.round.aggregating and core.pace.ready(core.barrier_set()):
        taken = core.pace.take()
        core.door.release_updates(taken)
        version = core.store.version
        direct = [u for u in taken if isinstance(u, Update)]
        sites = [u for u in taken if isinstance(u, SiteUpdate)]
        current = per_device(direct, version)
        stated = {e.device: (e.norm, float(e.steps)) for site in sites for e in site.entries}
        limits = core.bounds.limits(version, core.store.norm(), {**stated, **current}, steps_ceiling(core))
        judged = {device: limits.judge(norm, steps) for device, (norm, steps) in current.items()}
        refused = {device for device, verdict in judged.items() if verdict.refused}
        kept = [u for u in direct if u.device not in refused]
        out += [refuse_outlier(core, u.device, u.seq) for u in direct if u.device in refused]
        parts, taken_from_sites = [], []
        for site in sites:
            part, verdicts = bounded_part(site, limits, weight_cap(core))
            judged.update(verdicts)
            for entry in site.entries:
                if verdicts[entry.device].refused:
                    out.append(refuse_outlier(core, entry.device, entry.seq))
                else:
                    taken_from_sites.append(entry)
            if part is not None:
                parts.append(dataclasses.replace(site, part=part))
        updates: list[Contribution] = [*kept, *parts]
        if not updates:
            continue
        clips = {d: Clip(v.scale, v.steps) for d, v in judged.items() if not v.refused and d in current}
        try:
            weights = sizes(core, kept)
            cap = core.step_guard.limit(core.pace.step_cap(version, core.config.extrapolation, steady(core)))
            result = core.pace.aggregate(updates, version, weights, cap, steady(core), norm_kept(core.codec), clips)
            core.store.apply(result.delta)
            core.server_step = result.step
        except NonFinite as exc:  # validated updates summing to Inf: refuse the aggregate, keep the model
            commits = sum(len(u.devices) for u in updates)
            core.events.error("aggregate of %d commits refused: %s", commits, exc)
            core.traffic.rejected[RejectReason.NON_FINITE.value] += commits
            continue
        for device, verdict in judged.items():  # what was taken, as it was taken, is the fleet's history
            if not verdict.refused:
                norm = current[device][0] if device in current else stated[device][0]
                core.bounds.remember(device, norm * verdict.scale, verdict.steps, version)
        core.traffic.applied += len(kept) + len(taken_from_sites)
        if core.pace.rounds:
            core.membership.round_closed(now - core.round.opened)
        core.round.opened = now
        core.unbroadcast += 1
        last = last_version(core)
        if last or core.unbroadcast >= core.pace.broadcast_every(len(core.barrier_set())):
            out += core.broadcast_version(now)
        else:
            out += core.barrier(now)
    return out


def last_version(core: ServerCore) -> bool:
    """Whether the newest version is the job's last: the ``rounds``-th, or without ``rounds``, one
    made ``patience`` broadcasts after the best evaluated so far (the held-out metric stopped
    improving; not for a job of a set ``duration_s``), or the ``max_rounds``-th."""
    config, version = core.config, core.store.version
    if config.rounds is not None:
        return version >= config.rounds
    if config.duration_s is not None:  # a job of a set duration ends by the clock (or at max_rounds)
        return version >= config.max_rounds
    best = core.report.best
    since = version - (best.version if best is not None else 0)
    broadcasts = since / core.pace.broadcast_every(len(core.barrier_set()))
    return version >= config.max_rounds or broadcasts >= config.patience


def refuse_outlier(core: ServerCore, device: str, seq: int) -> Publish:
    detail = "its update is far shorter than the other devices' (ps_service.robust): not applied"
    [notice] = core.reject(device, Rejection(RejectReason.OUTLIER, detail, seq))
    return notice


def sizes(core: ServerCore, updates: list[Update]) -> dict[str, int]:
    """The data size each device of an aggregate is weighted by: its claim, bounded by ``weight_cap``."""
    return bounded_sizes(claimed_sizes(updates, core.registry.sizes()), weight_cap(core))


def steps_ceiling(core: ServerCore) -> float:
    """The most local steps a device's update counts as: what the server lets any device hold
    uncommitted (``max_uncommitted_factor`` x the largest push_every in force)."""
    push_every = max([core.frequency.push_every(d) for d in core.registry.active()], default=core.config.push_every)
    return float(core.config.max_uncommitted_factor * max(push_every, core.config.push_every))


def weight_cap(core: ServerCore) -> float:
    """The most data size a device is weighted by now (ps_service.robust ``size_cap``), computed again
    only when a device came, went or declared another size (it is asked at every commit)."""
    generation, cap = core.weight_cap_cache
    if generation != core.registry.generation:
        cap = size_cap(core.registry.sizes(), core.config.samples_factor, core.config.max_device_samples)
        core.weight_cap_cache = (core.registry.generation, cap)
    return cap


def broadcast(core: ServerCore, now: float) -> list[Publish]:
    """Publish the newest version (and, at the last one, finish): parameters, changed controls,
    the barrier and the metrics (evaluating when due)."""
    core.unbroadcast = 0
    messages, per_device = core.broadcaster.publish(core.store)
    core.last_broadcast = messages
    core.traffic.bytes_down += per_device * len(core.registry.active())
    reporting.evaluate(core, now)  # when due: whether this version is the best decides whether the job goes on
    if last_version(core):
        core.round.state = JobState.FINISHED
    for device in core.registry.active():  # devices waiting for parameters train again from here
        if core.pace.configure(device).wait_for_params:
            core.frequency.balancer.on_ready(device, now)
    metrics = reporting.metrics(core, now)  # evaluates, and the policy observes the evaluation
    changed = [] if core.finished else core.reassign()
    if core.pace.rounds and not core.finished:  # the new round waits only for those it should
        core.membership.release(core.frequency.released(sorted(core.registry.active())))
    out = [*messages, *changed, *core.barrier(now), metrics]
    if core.finished:
        core.events.info("job %s finished at version %d", core.config.job, core.store.version)
    return out
