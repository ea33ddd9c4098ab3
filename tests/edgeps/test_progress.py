"""The demo's progress: plain lines off a terminal, rich's progress bar on one."""

from __future__ import annotations

import io

from edgeps.progress import JobProgress
from schemas.messages import Metrics


def record(version: int, online: int = 4, finished: bool = False) -> Metrics:
    return Metrics(
        job="j",
        version=version,
        round=version,
        pace="bsp",
        metric="accuracy",
        value=0.5 + version / 100,
        accuracy=0.5,
        loss=1.0,
        commits=4 * version,
        applied=4 * version,
        rejected={},
        bytes_up=0,
        bytes_down=0,
        devices_online=online,
        elapsed_s=version / 10,
        finished=finished,
    )


def test_off_a_terminal_a_line_per_tenth_and_the_wait_once_per_count() -> None:
    out = io.StringIO()
    progress = JobProgress(20, 4, out)
    for online in (0, 0, 2, 4):
        progress.update(record(0, online))
    for version in range(1, 21):
        progress.update(record(version, finished=version == 20))
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["waiting for 4 devices (0 online)", "waiting for 4 devices (2 online)"]
    assert lines[2] == "round    0/20  accuracy 0.5000  loss 1.0000  commits 0  0.0 s"
    assert len(lines) == 3 + 10 and lines[-1].startswith("round   20/20  accuracy 0.7000")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_a_rich_progress_bar() -> None:
    out = Terminal()
    progress = JobProgress(20, 4, out)
    progress.update(record(0, online=1))
    progress.update(record(20, finished=True))
    progress.close()
    assert "20/20" in out.getvalue() and "accuracy 0.7000" in out.getvalue() and "\x1b[" in out.getvalue()
    quiet = Terminal()
    JobProgress(20, 4, quiet, quiet=True).update(record(3))
    assert quiet.getvalue() == ""


def test_tables_are_plain_text_off_a_terminal_and_rich_on_one() -> None:
    from edgeps.tables import Table

    table = Table(["run", "best acc", "commits"], after=["note"])
    table.add("bsp", "0.9499", 800)
    table.add("acbsp-long", "0.9721", 1234)
    assert str(table).splitlines() == [
        "run         best acc  commits",
        "-----------------------------",
        "bsp           0.9499      800",
        "acbsp-long    0.9721     1234",
        "note",
    ]
    plain = io.StringIO()
    table.print(plain)
    assert plain.getvalue() == str(table) + "\n"
    terminal = Terminal()
    table.print(terminal)
    drawn = terminal.getvalue()
    assert "acbsp-long" in drawn and "0.9721" in drawn and "\x1b[" in drawn and "-----" not in drawn
