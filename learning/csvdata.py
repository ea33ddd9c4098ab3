"""Sensor readings from a CSV file: a label column, feature columns, and optionally a column
naming the device (gateway) each row was recorded on.

Every fault is a ``DataError`` whose one line names the file, the line and the column. Features
are scaled to [0, 1] by each column's minimum and maximum over the file (``Scaling``, which is
saved beside the shards so that a gateway scales new readings the same way).
"""

from __future__ import annotations

import csv
import difflib
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from learning.data import DataError, Dataset

__all__ = ["CsvData", "DataError", "Scaling", "Table", "load_csv", "read_number", "read_table"]


@dataclass(frozen=True)
class Scaling:
    """x_scaled = (x - low) / span, per feature (span 1 for a constant column)."""

    features: list[str]
    low: list[float]
    span: list[float]

    def apply(self, x: np.ndarray) -> np.ndarray:
        """Raw readings (n, features) scaled as the training data was."""
        scaled: np.ndarray = ((x - np.asarray(self.low)) / np.asarray(self.span)).astype(np.float32)
        return scaled

    def to_json(self) -> dict[str, list[Any]]:
        return {"features": self.features, "low": self.low, "span": self.span}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Scaling:
        """The scaling a JSON object holds (``features``, ``low``, ``span``); KeyError, TypeError or
        ValueError where it does not."""
        return Scaling(
            [str(f) for f in data["features"]], [float(v) for v in data["low"]], [float(v) for v in data["span"]]
        )

    @staticmethod
    def load(path: str | Path) -> Scaling:
        """The scaling in a JSON file that holds ``features``, ``low`` and ``span``: the columns.json of
        ``edgeps data --csv``, or a saved model's card (edgeps.deploy)."""
        try:
            return Scaling.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{path}: no scaling (features, low, span) readable: {exc}") from None


@dataclass(frozen=True)
class CsvData:
    """The rows as a Dataset (features scaled), and what they came with."""

    data: Dataset
    classes: list[str]  # the label of each class index, as the file wrote it (none for a regression)
    scaling: Scaling
    devices: list[str] | None  # each row's device, with a device column
    label: str = ""  # the label column's name

    @property
    def fingerprint(self) -> str:
        """16 hex digits that name the feature columns, their order, their scaling and the class names
        in index order: two devices whose rows mean the same have the same (the job's Control carries
        the fleet's)."""
        scaling = self.scaling
        text = json.dumps(
            [scaling.features, [float(v) for v in scaling.low], [float(v) for v in scaling.span], self.classes]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def meta(self) -> dict[str, object]:
        """What a gateway needs to read new rows as the shards were made: the label column, the
        feature columns, their scaling and the class names."""
        return {"label": self.label, "classes": self.classes, **self.scaling.to_json()}

    def save_meta(self, path: Path) -> None:
        """``meta()`` as JSON (``edgeps data --csv`` writes it as columns.json)."""
        path.write_text(json.dumps(self.meta(), indent=2) + "\n")


def read_number(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise DataError(f"{where}: {text.strip()!r} is not a number") from None
    if not math.isfinite(value):
        raise DataError(f"{where}: {text.strip()!r} is not a finite number")
    return value


def load_csv(
    path: str | Path,
    label: str,
    features: list[str] | None = None,
    device_column: str | None = None,
    classes: int | list[str] | None = None,
    regression: bool = False,
    scaling: Scaling | str | Path | None = None,
) -> CsvData:
    """Read ``path``: ``label`` holds each row's class (non-negative integers, or names, numbered in
    sorted order), or with ``regression`` its target value (a real number), ``features`` the inputs
    (default: every other column but ``device_column``). With ``classes``, a label outside
    0..classes-1 is an error; ``classes`` as a list of names numbers them in that order (the fleet's),
    and a label that is none of them is an error. Features are scaled by their minimum and maximum
    over the file, or with ``scaling`` (a Scaling, or a JSON file ``Scaling.load`` reads: then also
    its ``classes``, unless given) as the fleet's are: its columns, found by name in any order, and
    its numbers; a gateway's own file read so means what the other devices' rows mean."""
    if scaling is not None and not isinstance(scaling, Scaling):
        if classes is None and not regression:
            classes = _fleet_classes(scaling)
        scaling = Scaling.load(scaling)
    if scaling is not None:
        features = list(scaling.features)
    table = read_table(path, [label, *(features or []), *([device_column] if device_column else [])])
    if features is None:
        features = [h for h in table.header if h not in (label, device_column)]
    if not features:
        raise DataError(f"{table.path}: no feature columns besides {label!r}")
    if not table.rows:
        raise DataError(f"{table.path}: no data rows")
    x = table.numbers(features)
    labels = table.texts(label, "label")
    devices = [text for _, text in table.texts(device_column, "device")] if device_column else []
    if regression:
        targets = [read_number(text, f"{table.path} line {number}, column {label!r}") for number, text in labels]
        y = np.array(targets, np.float32)
        names: list[str] = []
    else:
        y, names = _classes(table.path, label, labels, classes)
    if scaling is None:
        low, high = x.min(axis=0), x.max(axis=0)
        span = np.where(high > low, high - low, 1.0)
        scaling = Scaling(features, low.tolist(), span.tolist())
    return CsvData(Dataset(scaling.apply(x), y), names, scaling, devices if device_column else None, label)


@dataclass(frozen=True)
class Table:
    """A CSV file's header and its rows that are not blank, each with its line number."""

    path: Path
    header: list[str]
    rows: list[tuple[int, list[str]]]

    def numbers(self, columns: list[str]) -> np.ndarray:
        """The ``columns`` of every row as finite numbers (n, len(columns)); DataError naming the line
        and column of the first that is not, or of a row with another number of fields."""
        at = {h: i for i, h in enumerate(self.header)}
        x = np.empty((len(self.rows), len(columns)), np.float64)
        for r, (number, row) in enumerate(self.rows):
            if len(row) != len(self.header):
                raise DataError(f"{self.path} line {number}: {len(row)} fields, the header has {len(self.header)}")
            for c, column in enumerate(columns):
                x[r, c] = read_number(row[at[column]], f"{self.path} line {number}, column {column!r}")
        return x

    def texts(self, column: str, what: str) -> list[tuple[int, str]]:
        """(line number, text) of ``column`` in every row; DataError naming the line of an empty one."""
        at = self.header.index(column)
        out = []
        for number, row in self.rows:
            text = row[at].strip()
            if not text:
                raise DataError(f"{self.path} line {number}, column {column!r}: missing {what}")
            out.append((number, text))
        return out


def read_table(path: str | Path, columns: list[str]) -> Table:
    """``path``'s header and rows; DataError in one line if it cannot be read, is empty, or lacks one of
    ``columns`` (naming the nearest match)."""
    path = Path(path)
    try:
        with path.open(newline="") as file:
            reader = csv.reader(file)
            header = next(reader, None)
            if header is None:
                raise DataError(f"{path}: empty file (expected a header line)")
            header = [h.strip() for h in header]
            rows = [(number, row) for number, row in enumerate(reader, start=2) if any(c.strip() for c in row)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{path}: {exc}") from None
    for column in columns:
        if column not in header:
            raise DataError(f"{path}: no column {column!r}{nearest_column(column, header)}")
    return Table(path, header, rows)


def nearest_column(column: str, header: list[str]) -> str:
    """What a missing column's name is most likely a typo of, or (a short header) the columns."""
    folded = {h.casefold(): h for h in header}
    close = difflib.get_close_matches(column.casefold(), list(folded), n=1, cutoff=0.6)
    prefixed = [
        h for h in folded if h and column and (h.startswith(column.casefold()) or column.casefold().startswith(h))
    ]
    close = close or prefixed[:1]
    if close:
        return f"; did you mean {folded[close[0]]!r}?"
    shown = ", ".join(header[:12]) + (f", ... ({len(header)} columns)" if len(header) > 12 else "")
    return f" (columns: {shown})"


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _fleet_classes(path: str | Path) -> list[str] | None:
    """The class names a columns.json (or a model card) lists, or None where it lists none."""
    try:
        named = json.loads(Path(path).read_text()).get("classes")
    except (OSError, ValueError, AttributeError):
        return None  # Scaling.load says what is wrong with the file
    return [str(name) for name in named] if isinstance(named, list) and named else None


def _classes(
    path: Path, column: str, labels: list[tuple[int, str]], classes: int | list[str] | None
) -> tuple[np.ndarray, list[str]]:
    """Class indices for the labels: integers as written, or names in sorted order. Labels that are
    numbers but not all whole numbers from 0 are refused (a stray row, or a regression's target read
    as classes), so that no number silently becomes a class name. A list of ``classes`` names them:
    each label is one of them, numbered in that order."""
    if isinstance(classes, list):
        index = {name: i for i, name in enumerate(classes)}
        for number, text in labels:
            if text not in index:
                shown = ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else "")
                raise DataError(
                    f"{path} line {number}, column {column!r}: {text!r} is not one of the classes ({shown})"
                )
        return np.array([index[text] for _, text in labels], np.int64), list(classes)
    numeric = [(number, text) for number, text in labels if _is_number(text)]
    if numeric and len(numeric) < len(labels):  # numbers and names mixed: name the fewer
        named = [(number, text) for number, text in labels if not _is_number(text)]
        number, text = min(numeric, named, key=len)[0]
        kind = "a number among class names" if len(numeric) <= len(named) else "a name among class numbers"
        raise DataError(f"{path} line {number}, column {column!r}: label {text!r} is {kind}")
    odd = next(((number, text) for number, text in numeric if not text.isdigit()), None)
    if odd is not None:
        where = f"{path} line {odd[0]}, column {column!r}"
        raise DataError(
            f"{where}: label {odd[1]!r} is not a class number (0, 1, ...); for a real-valued target "
            "pass regression=True"
        )
    if all(text.isdigit() for _, text in labels):
        y = np.array([int(text) for _, text in labels], np.int64)
        count = classes if classes is not None else int(y.max()) + 1
        for number, text in labels:
            if int(text) >= count:
                raise DataError(
                    f"{path} line {number}, column {column!r}: {text} is outside the {count} classes (0..{count - 1})"
                )
        return y, [str(i) for i in range(count)]
    names = sorted({text for _, text in labels})
    if classes is not None and len(names) > classes:
        raise DataError(
            f"{path}, column {column!r}: {len(names)} class names ({', '.join(names[:8])}...) for {classes} classes"
        )
    index = {name: i for i, name in enumerate(names)}
    return np.array([index[text] for _, text in labels], np.int64), names
