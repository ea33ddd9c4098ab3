"""A job's progress for a person: a rich progress bar on a terminal, plain lines otherwise (a log,
CI, a pipe), every tenth of the job (a job that runs until its metric stops improving: every 25
versions)."""

from __future__ import annotations

import sys
from typing import TextIO

from schemas.messages import Metrics


class JobProgress:
    """Shows each metrics record of a job of ``rounds`` versions (None: until its metric stops
    improving) and ``devices`` devices."""

    def __init__(self, rounds: int | None, devices: int, stream: TextIO | None = None, quiet: bool = False) -> None:
        self.rounds, self.devices, self.quiet = rounds, devices, quiet
        self.stream = stream or sys.stdout
        self.bar = None
        if self.stream.isatty() and not quiet:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("round"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=Console(file=self.stream),
            )
            self.task = self.bar.add_task("job", total=rounds, info="starting")
            self.bar.start()
        self.waiting_shown = -1

    def update(self, m: Metrics) -> None:
        if self.quiet:
            return
        waiting = m.version == 0 and m.devices_online < self.devices and not m.finished
        info = (
            f"waiting for {self.devices} devices ({m.devices_online} online)"
            if waiting
            else f"{m.metric} {m.value or 0.0:.4f}  loss {m.loss:.4f}  commits {m.commits}  {m.elapsed_s:.1f} s"
        )
        if self.bar is not None:
            self.bar.update(self.task, completed=m.version, info=info)
            return
        if waiting:  # once per change of the count
            if m.devices_online != self.waiting_shown:
                self.waiting_shown = m.devices_online
                print(info, file=self.stream, flush=True)
        elif m.finished or m.version % (max(1, self.rounds // 10) if self.rounds else 25) == 0:
            of = f"/{self.rounds}" if self.rounds else ""
            print(f"round {m.version:>4}{of}  {info}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
