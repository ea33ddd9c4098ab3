"""What a job reports: traffic counts, rejection notices, the best version and the metrics history.

``Report`` holds them; ``ps_service.server.readout`` builds the metrics and status a job publishes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from learning.model import Params
from ps_service.door import Refusal
from ps_service.evaluator import Evaluation
from ps_service.registry import DeviceRecord
from ps_service.validation import Rejection
from schemas.events import Events
from schemas.messages import Metrics, Notice, RejectReason
from schemas.topics import Publish, Topics


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

    def refused(self, device: str, refusal: Refusal, record: DeviceRecord | None, now: float) -> list[Publish]:
        """A commit the door refused, as every receiver reports it: a flood that muted its device logged,
        then counted, and noticed unless it is a redelivered copy (``silent``)."""
        rejection = refusal.rejection
        if refusal.muted is not None:
            self.events.warning(
                "device %s floods (%s): not listening to its commits for %g s",
                device,
                rejection.detail.partition(":")[0],
                refusal.muted,
            )
        if refusal.silent:
            return self.count(rejection)
        return self.reject(device, rejection, record, now if rejection.reason is RejectReason.RATE_LIMITED else None)

    def record(self, metrics: Metrics) -> None:
        """Keep ``metrics`` in the history: one record per version, and the final one."""
        if not self.history or self.history[-1].version != metrics.version or metrics.finished:
            self.history.append(metrics)
            self.history_json.append(metrics.to_bytes())
