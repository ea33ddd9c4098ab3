"""What a job reports: traffic counts, rejection notices, evaluations, metrics and status.

``Report`` holds the counts and the metrics history; ``metrics`` and ``status`` read a core.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from learning.model import Params
from ps_service.evaluator import Evaluation
from ps_service.registry import DeviceRecord
from ps_service.validation import Rejection
from schemas.events import Events
from schemas.messages import Metrics, Notice, RejectReason
from schemas.topics import Publish, Topics

if TYPE_CHECKING:
    from ps_service.core import ServerCore


@dataclass(frozen=True)
class Best:
    """The best version evaluated so far by the job's metric, and its parameters (a copy)."""

    version: int
    evaluation: Evaluation
    params: Params


@dataclass
class Traffic:
    commits: int = 0
    applied: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    rejected: Counter[str] = field(default_factory=Counter)


class Report:
    """A job's counts, its latest evaluation and its metrics history (one record per version)."""

    def __init__(self, topics: Topics, now: float, events: Events) -> None:
        self.topics, self.events = topics, events
        self.traffic = Traffic()
        self.history: list[Metrics] = []
        self.history_json: list[bytes] = []  # the same records, serialised once (for checkpoints)
        self.evaluation: tuple[int, Evaluation] | None = None  # (version, its evaluation)
        self.best: Best | None = None  # the best version evaluated so far, kept beside the last
        self.metrics_at = now  # when metrics last went out
        self.sites: dict[str, dict[str, int]] = {}  # each site's refusals as it last reported them

    def site_refusals(self, site: str, refused: dict[str, int]) -> None:
        """What ``site``'s aggregator says it refused so far (by reason), added to the job's counts:
        the increase since its last report (a restarted aggregator counts from 0 again)."""
        last = self.sites.get(site, {})
        for reason, count in refused.items():
            before = last.get(reason, 0)
            new = count - before if count >= before else count
            self.traffic.rejected[reason] += new
            self.traffic.commits += new
        self.sites[site] = dict(refused)

    def count(self, rejection: Rejection) -> list[Publish]:
        """Count a rejection that gets no notice."""
        self.traffic.rejected[rejection.reason.value] += 1
        return []

    def reject(
        self,
        sender: str,
        rejection: Rejection,
        record: DeviceRecord | None,
        now: float | None,
        notify: bool = True,
    ) -> list[Publish]:
        """Count a rejection and notice ``sender`` (a device) of it; a flood (``rate_limited``, with
        ``now``) gets one notice (and one log line) a second, not one per message. Logged for the
        first 100 of a reason, then every 1000th. ``notify`` False: a sender with no notice topic
        (a site), counted and logged the same way."""
        self.count(rejection)
        count = self.traffic.rejected[rejection.reason.value]
        if rejection.reason is RejectReason.RATE_LIMITED and now is not None and record is not None:
            if record.noticed_at is not None and now - record.noticed_at < 1.0:
                return []
            record.noticed_at = now
        if count <= 100 or count % 1000 == 0 or rejection.reason is RejectReason.RATE_LIMITED:
            self.events.warning("rejected message from %s: %s: %s", sender, rejection.reason.value, rejection.detail)
        if not notify:
            return []
        notice = Notice(device=sender, seq=rejection.seq, reason=rejection.reason, detail=rejection.detail[:512])
        return [Publish(self.topics.notice(sender), notice.to_bytes(), qos=1)]

    def record(self, metrics: Metrics) -> None:
        """Keep ``metrics`` in the history: one record per version, and the final one."""
        if not self.history or self.history[-1].version != metrics.version or metrics.finished:
            self.history.append(metrics)
            self.history_json.append(metrics.to_bytes())


def _push_every(core: ServerCore) -> dict[str, int]:
    """Each online device's push_every, by device id."""
    return {d: core.frequency.push_every(d) for d in sorted(core.registry.active())}


def evaluate(core: ServerCore, now: float) -> tuple[int, Evaluation]:
    """(version, evaluation) of the latest evaluation, made afresh every ``eval_every`` versions and
    at the end; the frequency policy observes each one, on its scale (learning.metrics)."""
    report, version = core.report, core.store.version
    latest = report.evaluation
    due = latest is None or version - latest[0] >= core.config.eval_every or core.finished
    if due and (latest is None or latest[0] != version):
        evaluation = core.evaluator(core.store.view())
        report.evaluation = latest = (version, evaluation)
        metric = core.evaluator.metric
        best = report.best
        if best is None or metric.better(evaluation.values[metric.name], best.evaluation.values[metric.name]):
            report.best = Best(version, evaluation, core.store.params())  # a copy: the model moves on
        core.frequency.observe(now - core.round.started, metric.score(evaluation.values[metric.name]), evaluation.loss)
        core.step_guard.observe(evaluation.loss)
    assert latest is not None
    return latest


def metrics(core: ServerCore, now: float) -> Publish:
    """The job's metrics message (evaluating when due), recorded in its history."""
    report, traffic, frequency = core.report, core.report.traffic, core.frequency
    report.metrics_at = now
    evaluated, evaluation = evaluate(core, now)
    metric = core.evaluator.metric.name
    record = Metrics(
        job=core.config.job,
        run=core.run,
        version=core.store.version,
        round=core.store.version,
        pace=core.pace.name,
        metric=metric,
        value=evaluation.values[metric],
        values=evaluation.values,
        accuracy=evaluation.values.get("accuracy"),
        loss=evaluation.loss,
        commits=traffic.commits,
        applied=traffic.applied,
        rejected=dict(traffic.rejected),
        bytes_up=traffic.bytes_up,
        bytes_down=traffic.bytes_down,
        devices_online=len(core.registry.active()),
        elapsed_s=round(now - core.round.started, 6),
        finished=core.finished,
        evaluated_version=evaluated,
        eval_s=round(core.evaluator.seconds, 6),
        frequency=frequency.policy.name if frequency.frozen is None else "frozen",
        trend=frequency.policy.trend,
        server_step=round(core.server_step, 4),
        push_every=_push_every(core),
        unable=dict(core.registry.unable),
        baseline=core.evaluator.baseline,
    )
    report.record(record)
    return Publish(core.topics.metrics, record.to_bytes(), qos=1)


def status(core: ServerCore, now: float) -> dict[str, Any]:
    """The job's state, for operators (a ``status`` command's reply)."""
    evaluated, evaluation = core.report.evaluation or (0, Evaluation({}, float("nan")))
    metric = core.evaluator.metric.name
    frequency, traffic = core.frequency, core.report.traffic
    return {
        "job": core.config.job,
        "state": core.round.state.value,
        "pace": core.pace.name,
        "version": core.store.version,
        "metric": metric,
        "value": evaluation.values.get(metric, float("nan")),
        "values": evaluation.values,
        "accuracy": evaluation.values.get("accuracy"),
        "loss": evaluation.loss,
        "evaluated_version": evaluated,
        "best_version": None if core.report.best is None else core.report.best.version,
        "best_value": None if core.report.best is None else core.report.best.evaluation.values.get(metric),
        "devices_online": sorted(core.registry.active()),
        "waiting_for": core.waiting_for(),
        "left": sorted(core.membership.left),
        "evicted": sorted(core.registry.evicted),
        "unable": dict(core.registry.unable),
        "codec": core.codec,
        "pull_codec": core.config.pull_codec,
        "frequency": {
            "policy": frequency.policy.name,
            "frozen": frequency.frozen is not None,
            "base": frequency.base,
            "low": frequency.bounds.low,
            "high": frequency.bounds.high,
            "push_every": _push_every(core),
        },
        "commits": traffic.commits,
        "applied": traffic.applied,
        "rejected": dict(traffic.rejected),
        "elapsed_s": round(now - core.round.started, 3),
    }
