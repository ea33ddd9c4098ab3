"""What a checkpoint holds of a server core, and how a core becomes what one describes.

Everything by name, in JSON values, numpy arrays (tensors) and bytes (payloads); times are
ages in seconds, so that a restored server runs on any clock. ps_service/checkpoint.py
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
    from ps_service.core import ServerCore


def to_state(core: ServerCore, now: float) -> dict[str, Any]:
    """Everything ``core`` knows but its configuration and metrics history."""
    traffic, clock = core.report.traffic, core.round
    evaluation, best = core.report.evaluation, core.report.best
    return {
        "run": core.run,
        "store": core.store.to_state(),
        "broadcaster": core.broadcaster.to_state(),
        "codec": core.codec,
        "previous_codec": core.previous_codec,
        "pace": {"spec": core.pace.name, "buffer": [u.to_state() for u in core.pace.buffered()]},
        "registry": core.registry.to_state(now),
        "membership": core.membership.to_state(),
        "bound": core.bounds.to_state(),
        "frequency": core.frequency.to_state(now),
        "evaluation": None if evaluation is None else [evaluation[0], evaluation[1].values, evaluation[1].loss],
        "best": None if best is None else [best.version, best.evaluation.values, best.evaluation.loss, best.params],
        "traffic": {
            "commits": traffic.commits,
            "applied": traffic.applied,
            "bytes_up": traffic.bytes_up,
            "bytes_down": traffic.bytes_down,
            "rejected": dict(sorted(traffic.rejected.items())),
            "sites": core.report.sites,
        },
        "paused": clock.state is JobState.PAUSED,
        "finished": clock.state is JobState.FINISHED,
        "quorum": clock.quorum,
        "unbroadcast": core.unbroadcast,
        "server_step": core.server_step,
        "step_guard": [core.step_guard.trust, core.step_guard.last_loss],
        "last_broadcast": [
            {"topic": m.topic, "payload": m.payload, "qos": m.qos, "retain": m.retain} for m in core.last_broadcast
        ],
        "started_age_s": now - clock.started,
        "round_age_s": now - clock.opened,
        "metrics_age_s": now - core.report.metrics_at,
    }


def load_state(core: ServerCore, state: dict[str, Any], history: list[Metrics], now: float) -> None:
    """Make ``core`` (built with the same configuration) the server ``to_state`` described."""
    core.run = int(state["run"])
    core.store = ParameterStore.from_state(state["store"])
    core.broadcaster = Broadcaster(core.topics, core.config.pull_codec, run=core.run)
    core.broadcaster.load_state(state["broadcaster"], core.store)
    core.codec, core.previous_codec = str(state["codec"]), str(state["previous_codec"])
    core.door.release_updates(core.pace.take_all())
    core.pace = make_pace(str(state["pace"]["spec"]))
    for update in state["pace"]["buffer"]:
        contribution = from_state(update)
        core.pace.add(contribution)
        core.door.hold_updates([contribution])
    core.registry.load_state(state["registry"], now)
    core.membership.load_state(state["membership"])
    core.bounds.load_state(state["bound"])
    core.frequency.load_state(state["frequency"], now, core.config.push_every)
    report, evaluation, t = core.report, state["evaluation"], state["traffic"]
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
    core.round.state, core.round.quorum = state_, bool(state["quorum"])
    core.round.started = now - float(state["started_age_s"])
    core.round.opened = now - float(state["round_age_s"])
    core.unbroadcast, core.server_step = int(state["unbroadcast"]), float(state["server_step"])
    trust, last_loss = state.get("step_guard", [1.0, None])  # checkpoints before the guard: full trust
    core.step_guard = StepGuard(float(trust), None if last_loss is None else float(last_loss))
    core.last_broadcast = [
        Publish(str(m["topic"]), bytes(m["payload"]), int(m["qos"]), bool(m["retain"])) for m in state["last_broadcast"]
    ]
