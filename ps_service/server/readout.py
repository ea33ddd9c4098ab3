"""What a job tells: its evaluation (made afresh when due), its metrics message and the status
reply operators read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ps_service.evaluator import Evaluation
from ps_service.reporting import Best
from schemas.messages import Metrics
from schemas.topics import Publish

if TYPE_CHECKING:
    from ps_service.server.job import Job


def _push_every(job: Job) -> dict[str, int]:
    """Each online device's push_every, by device id."""
    return {d: job.frequency.push_every(d) for d in sorted(job.registry.active())}


def evaluate(job: Job, now: float) -> tuple[int, Evaluation]:
    """(version, evaluation) of the latest evaluation, made afresh every ``eval_every`` versions and
    at the end; the frequency policy observes each one, on its scale (learning.metrics)."""
    report, version = job.report, job.store.version
    latest = report.evaluation
    due = latest is None or version - latest[0] >= job.config.eval_every or job.finished
    if due and (latest is None or latest[0] != version):
        evaluation = job.evaluator(job.store.view())
        report.evaluation = latest = (version, evaluation)
        metric = job.evaluator.metric
        best = report.best
        if best is None or metric.better(evaluation.values[metric.name], best.evaluation.values[metric.name]):
            report.best = Best(version, evaluation, job.store.params())  # a copy: the model moves on
        job.frequency.observe(now - job.round.started, metric.score(evaluation.values[metric.name]), evaluation.loss)
        job.step_guard.observe(evaluation.loss)
    assert latest is not None
    return latest


def metrics(job: Job, now: float) -> Publish:
    """The job's metrics message (evaluating when due), recorded in its history."""
    report, traffic, frequency = job.report, job.report.traffic, job.frequency
    report.metrics_at = now
    evaluated, evaluation = evaluate(job, now)
    metric = job.evaluator.metric.name
    record = Metrics(
        job=job.config.job,
        run=job.run,
        version=job.store.version,
        round=job.store.version,
        pace=job.pace.name,
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
        devices_online=len(job.registry.active()),
        elapsed_s=round(now - job.round.started, 6),
        finished=job.finished,
        evaluated_version=evaluated,
        eval_s=round(job.evaluator.seconds, 6),
        frequency=frequency.policy.name if frequency.frozen is None else "frozen",
        trend=frequency.policy.trend,
        server_step=round(job.server_step, 4),
        push_every=_push_every(job),
        unable=dict(job.registry.unable),
        baseline=job.evaluator.baseline,
    )
    report.record(record)
    return Publish(job.topics.metrics, record.to_bytes(), qos=1)


def status(job: Job, now: float) -> dict[str, Any]:
    """The job's state, for operators (a ``status`` command's reply)."""
    evaluated, evaluation = job.report.evaluation or (0, Evaluation({}, float("nan")))
    metric = job.evaluator.metric.name
    frequency, traffic = job.frequency, job.report.traffic
    return {
        "job": job.config.job,
        "state": job.round.state.value,
        "pace": job.pace.name,
        "version": job.store.version,
        "metric": metric,
        "value": evaluation.values.get(metric, float("nan")),
        "values": evaluation.values,
        "accuracy": evaluation.values.get("accuracy"),
        "loss": evaluation.loss,
        "evaluated_version": evaluated,
        "best_version": None if job.report.best is None else job.report.best.version,
        "best_value": None if job.report.best is None else job.report.best.evaluation.values.get(metric),
        "devices_online": sorted(job.registry.active()),
        "waiting_for": job.waiting_for(),
        "left": sorted(job.membership.left),
        "evicted": sorted(job.registry.evicted),
        "unable": dict(job.registry.unable),
        "codec": job.codec,
        "pull_codec": job.config.pull_codec,
        "frequency": {
            "policy": frequency.policy.name,
            "frozen": frequency.frozen is not None,
            "base": frequency.base,
            "low": frequency.bounds.low,
            "high": frequency.bounds.high,
            "push_every": _push_every(job),
        },
        "commits": traffic.commits,
        "applied": traffic.applied,
        "rejected": dict(traffic.rejected),
        "elapsed_s": round(now - job.round.started, 3),
    }
