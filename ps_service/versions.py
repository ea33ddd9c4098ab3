"""From buffered updates to published versions: outliers refused, data-size weights, the
pace's aggregate applied to the store, and the broadcast of the new parameters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ps_service import reporting
from ps_service.aggregate import Clip, norm_kept, norms_hold
from ps_service.robust import data_sizes, per_device
from ps_service.round import JobState
from ps_service.store import NonFinite
from ps_service.update import Contribution, Update
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
        version = core.store.version
        direct = [u for u in taken if isinstance(u, Update)]
        current = per_device(direct, version)
        limits = core.bounds.limits(version, core.store.norm(), current)
        judged = {device: limits.judge(norm, steps) for device, (norm, steps) in current.items()}
        refused = {device for device, verdict in judged.items() if verdict.refused}
        kept = [u for u in direct if u.device not in refused]
        updates: list[Contribution] = [*kept, *(u for u in taken if not isinstance(u, Update))]
        out += [refuse_outlier(core, u) for u in direct if u.device in refused]
        if not updates:
            continue
        clips = {d: Clip(v.scale, v.steps) for d, v in judged.items() if not v.refused}
        try:
            weights = sizes(core, kept)
            result = core.pace.aggregate(
                updates, version, weights, core.config.extrapolation, steady(core), norm_kept(core.codec), clips
            )
            core.store.apply(result.delta)
            core.server_step = result.step
            for device, clip in clips.items():
                core.bounds.remember(device, current[device][0] * clip.scale, clip.steps, version)
        except NonFinite as exc:  # validated updates summing to Inf: refuse the aggregate, keep the model
            commits = sum(len(u.devices) for u in updates)
            core.events.error("aggregate of %d commits refused: %s", commits, exc)
            core.traffic.rejected[RejectReason.NON_FINITE.value] += commits
            continue
        core.traffic.applied += sum(len(u.devices) for u in updates)
        if core.pace.rounds:
            core.membership.round_closed(now - core.round.opened)
        core.round.opened = now
        core.unbroadcast += 1
        last = core.store.version >= core.config.rounds
        if last or core.unbroadcast >= core.pace.broadcast_every(len(core.barrier_set())):
            out += core.broadcast_version(now)
        else:
            out += core.barrier(now)
    return out


def refuse_outlier(core: ServerCore, update: Update) -> Publish:
    detail = "its update is far from the other devices' (ps_service.robust): not applied"
    [notice] = core.reject(update.device, Rejection(RejectReason.OUTLIER, detail, update.seq))
    return notice


def sizes(core: ServerCore, updates: list[Update]) -> dict[str, int]:
    """The data size each device of an aggregate is weighted by (ps_service.robust ``data_sizes``)."""
    return data_sizes(updates, core.registry.sizes(), core.config.samples_factor, core.config.max_device_samples)


def broadcast(core: ServerCore, now: float) -> list[Publish]:
    """Publish the newest version (and, at the last one, finish): parameters, changed controls,
    the barrier and the metrics (evaluating when due)."""
    core.unbroadcast = 0
    messages, per_device = core.broadcaster.publish(core.store)
    core.last_broadcast = messages
    core.traffic.bytes_down += per_device * len(core.registry.active())
    if core.store.version >= core.config.rounds:
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
