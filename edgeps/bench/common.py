"""What the benches share: scenario variants, time formatting, progress, and a bench's ending
(the table printed, the report written as JSON)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgeps.report import write_json
from edgeps.scenario import Scenario
from edgeps.tables import Table

#: How a bench reports progress: print-like (``end`` and ``flush`` keywords).
Say = Callable[..., None]


def time_calls(obj: object, method: str, spent: Callable[[tuple[Any, ...], float], None]) -> None:
    """Wrap ``obj.method`` so that each call hands ``spent`` its positional arguments and the
    process time (CPU seconds of this process) the call took: a core's own cost, measured where the
    simulator calls it."""
    inner = getattr(obj, method)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            spent(args, time.process_time() - started)

    setattr(obj, method, timed)


def rss_mib(pid: int) -> float | None:
    """A running process's resident memory (VmRSS), MiB; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(status.split("VmRSS:")[1].split()[0]) / 1024 if "VmRSS:" in status else None


def fmt_time(value: float | None) -> str:
    """A time to target in seconds, or ``never``."""
    return "never" if value is None else f"{value:.2f}"


def indent(say: Say, text: str, **kw: Any) -> None:
    """Progress lines of one seed, indented under it (continuations of a line stay as they are)."""
    say("  " + text if text.startswith("[") else text, **kw)


def real_scenario(base: Scenario) -> Scenario:
    """The default real-run fleet: 8 devices, 2 of them 4x slower, 5 ms per reference step."""
    return replace_scenario(base, devices=8, step_s=0.005, duration_s=12.0, round_deadline_s=5.0)


def replace_scenario(base: Scenario, **changes: Any) -> Scenario:
    """``base`` with ``changes``, validated."""
    return Scenario.model_validate({**base.model_dump(), **changes})


def show(report: dict[str, Any], table: Table, json_path: str | Path | None) -> dict[str, Any]:
    """A bench's end: its ``table`` after a blank line (rich on a terminal), and the ``report`` as JSON
    at ``json_path`` if given; returns the report."""
    print()
    table.print()
    if json_path:
        write_json(report, json_path)
    return report
