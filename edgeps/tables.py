"""Tables for people: drawn by rich on a terminal, aligned plain text otherwise (a log, CI, a pipe).
Every bench's result and the job report are one."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class Table:
    """``rows`` of cells (text) under ``columns``; the first column left-aligned, the others right;
    lines ``before`` and ``after`` it. Without ``header``, a list of name-value pairs."""

    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    header: bool = True

    def add(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def __str__(self) -> str:
        shown = [self.columns, *self.rows] if self.header else self.rows
        widths = [max((len(r[i]) for r in shown if i < len(r)), default=0) for i in range(len(self.columns))]

        def line(cells: list[str]) -> str:
            padded = zip(cells, widths, strict=True)
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(padded))

        lines = list(self.before)
        if self.header:
            head = line(self.columns)
            lines += [head, "-" * len(head)]
        lines += [line(r).rstrip() for r in self.rows]
        return "\n".join([*lines, *self.after])

    def print(self, file: TextIO | None = None) -> None:
        """On a terminal, rich's table; else the plain text."""
        file = file or sys.stdout
        if not file.isatty():
            print(self, file=file, flush=True)
            return
        from rich.console import Console
        from rich.table import Table as RichTable

        console = Console(file=file)
        for text in self.before:
            console.print(text, markup=False, highlight=False)
        table = RichTable(header_style="bold") if self.header else RichTable.grid(padding=(0, 2))
        for i, column in enumerate(self.columns):
            table.add_column(column, justify="left" if i == 0 else "right")
        for row in self.rows:
            table.add_row(*row)
        console.print(table)
        for text in self.after:
            console.print(text, markup=False, highlight=False)
