"""A device's step time, measured locally and reported to the server only when it matters."""

from __future__ import annotations

from schemas.messages import STATUS_INTERVAL_S

SPEED_SAMPLES = 3  # local steps timed before a device first reports its speed


class SpeedMeter:
    """Smooths the time of local steps (0.8 old + 0.2 new) and says when to report it: after the
    first ``SPEED_SAMPLES`` steps, then whenever the smoothed time drifts by a quarter from the
    last report, at most once per ``STATUS_INTERVAL_S`` of timed steps."""

    def __init__(self) -> None:
        self.reported: float | None = None  # the step time last reported (seconds)
        self._steps = 0
        self._since_report_s = 0.0
        self._mean: float | None = None

    def observe(self, seconds: float) -> float | None:
        """One local step took ``seconds``: the step time to report now, else None."""
        if not seconds > 0:
            return None
        self._steps += 1
        self._since_report_s += seconds
        self._mean = mean = seconds if self._mean is None else 0.8 * self._mean + 0.2 * seconds
        if self._steps < SPEED_SAMPLES:
            return None
        if self.reported is not None and abs(mean - self.reported) <= 0.25 * self.reported:
            return None
        if self.reported is not None and self._since_report_s < STATUS_INTERVAL_S:
            return None
        self.reported = round(max(mean, 1e-6), 6)
        self._since_report_s = 0.0
        return self.reported
