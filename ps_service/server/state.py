"""What a checkpoint holds of a server job, and how a job becomes what one describes.

Everything by name, in JSON values, numpy arrays (tensors) and bytes (payloads); times are
ages in seconds, so that a restored server runs on any clock. ps_service/io/checkpoint.py
writes and reads it; the metrics history travels apart (``Report.history_json``).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np

from ps_service.broadcast import Broadcaster
from ps_service.evaluator import Evaluation
from ps_service.paces import make_pace
from ps_service.reporting import Best, Traffic
from ps_service.round import JobState
from ps_service.stepguard import StepGuard
from ps_service.store import ParameterStore
from ps_service.update import from_state
from schemas.messages import Metrics
from schemas.topics import Publish

if TYPE_CHECKING:
    from ps_service.server.job import Job


def to_state(job: Job, now: float) -> dict[str, Any]:
    """Everything ``job`` knows but its configuration and metrics history."""
    traffic, clock = job.report.traffic, job.round
    evaluation, best = job.report.evaluation, job.report.best
    return {
        "run": job.run,
        "store": job.store.to_state(),
        "broadcaster": job.broadcaster.to_state(),
        "codec": job.codec,
        "previous_codec": job.previous_codec,
        "pace": {"spec": job.pace.name, "buffer": [u.to_state() for u in job.pace.buffered()]},
        "registry": job.registry.to_state(now),
        "membership": job.membership.to_state(),
        "bound": job.bounds.to_state(),
        "frequency": job.frequency.to_state(now),
        "evaluation": None if evaluation is None else [evaluation[0], evaluation[1].values, evaluation[1].loss],
        "best": None if best is None else [best.version, best.evaluation.values, best.evaluation.loss, best.params],
        "traffic": {
            "commits": traffic.commits,
            "applied": traffic.applied,
            "bytes_up": traffic.bytes_up,
            "bytes_down": traffic.bytes_down,
            "rejected": dict(sorted(traffic.rejected.items())),
            "sites": job.report.sites,
        },
        "paused": clock.state is JobState.PAUSED,
        "finished": clock.state is JobState.FINISHED,
        "quorum": clock.quorum,
        "unbroadcast": job.unbroadcast,
        "server_step": job.server_step,
        "step_guard": [job.step_guard.trust, job.step_guard.last_loss],
        "last_broadcast": [
            {"topic": m.topic, "payload": m.payload, "qos": m.qos, "retain": m.retain} for m in job.last_broadcast
        ],
        "started_age_s": now - clock.started,
        "round_age_s": now - clock.opened,
        "metrics_age_s": now - job.report.metrics_at,
    }


def load_state(job: Job, state: dict[str, Any], history: list[Metrics], now: float) -> None:
    """Make ``job`` (built with the same configuration) the server ``to_state`` described."""
    job.run = int(state["run"])
    job.store = ParameterStore.from_state(state["store"])
    job.broadcaster = Broadcaster(job.topics, job.config.pull_codec, run=job.run)
    job.broadcaster.load_state(state["broadcaster"], job.store)
    job.codec, job.previous_codec = str(state["codec"]), str(state["previous_codec"])
    job.door.release_updates(job.pace.take_all())
    job.pace = make_pace(str(state["pace"]["spec"]))
    for update in state["pace"]["buffer"]:
        contribution = from_state(update)
        job.pace.add(contribution)
        job.door.hold_updates([contribution])
    job.registry.load_state(state["registry"], now)
    job.membership.load_state(state["membership"])
    job.bounds.load_state(state["bound"])
    job.frequency.load_state(state["frequency"], now, job.config.push_every)
    report, evaluation, t = job.report, state["evaluation"], state["traffic"]
    if evaluation is not None:  # [version, {metric: value}, loss]; checkpoints before v1.2 hold the accuracy
        values = evaluation[1] if isinstance(evaluation[1], dict) else {"accuracy": evaluation[1]}
        values = {str(k): float(v) for k, v in values.items()}
        report.evaluation = (int(evaluation[0]), Evaluation(values, float(evaluation[2])))
    best = state.get("best")  # checkpoints before the best model was kept have none
    report.best = None
    if best is not None:
        values = {str(k): float(v) for k, v in best[1].items()}
        params = {str(name): np.asarray(t, np.float32) for name, t in best[3].items()}
        report.best = Best(int(best[0]), Evaluation(values, float(best[2])), params)
    report.traffic = Traffic(
        int(t["commits"]),
        int(t["applied"]),
        int(t["bytes_up"]),
        int(t["bytes_down"]),
        Counter({str(k): int(v) for k, v in t["rejected"].items()}),
    )
    report.sites = {str(s): {str(r): int(n) for r, n in c.items()} for s, c in t.get("sites", {}).items()}
    report.metrics_at = now - float(state["metrics_age_s"])
    report.history = list(history)
    report.history_json = [m.to_bytes() for m in history]
    state_ = JobState.FINISHED if state["finished"] else JobState.PAUSED if state["paused"] else JobState.RUNNING
    job.round.state, job.round.quorum = state_, bool(state["quorum"])
    job.round.started = now - float(state["started_age_s"])
    job.round.opened = now - float(state["round_age_s"])
    job.unbroadcast, job.server_step = int(state["unbroadcast"]), float(state["server_step"])
    trust, last_loss = state.get("step_guard", [1.0, None])  # checkpoints before the guard: full trust
    job.step_guard = StepGuard(float(trust), None if last_loss is None else float(last_loss))
    job.last_broadcast = [
        Publish(str(m["topic"]), bytes(m["payload"]), int(m["qos"]), bool(m["retain"])) for m in state["last_broadcast"]
    ]
