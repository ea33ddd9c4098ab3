"""A job's report: written by ps and the demo alike, read back and shown by edgeps report."""

from __future__ import annotations

import json

import pytest

from edgeps.cli import main
from edgeps.report import build_report, format_report, read_metrics, read_report, write_json
from schemas.messages import Metrics


def metrics(version: int, accuracy: float, finished: bool = False, baseline: float | None = None) -> Metrics:
    return Metrics(
        job="j",
        run=1,
        version=version,
        round=version,
        pace="bsp",
        accuracy=accuracy,
        loss=1 - accuracy,
        commits=3 * version,
        applied=3 * version,
        rejected={},
        bytes_up=100 * version,
        bytes_down=200 * version,
        devices_online=3,
        elapsed_s=0.5 * version,
        finished=finished,
        evaluated_version=version,
        baseline={} if baseline is None else {"accuracy": baseline},
    )


def test_a_report_keeps_every_record_and_shows_again(tmp_path, capsys) -> None:
    history = [metrics(0, 0.1), metrics(1, 0.6), metrics(2, 0.8, finished=True)]
    path = tmp_path / "job.json"
    write_json(build_report(history, 4.2, {"pace": "bsp"}), path)
    assert read_metrics(path) == history and read_report(path)["best_accuracy"] == 0.8
    assert main(["report", str(path), "--plot", str(tmp_path / "curve.png")]) == 0
    out = capsys.readouterr().out
    assert "best accuracy   0.8000" in out and "commits         6 (6 applied, 0 rejected)" in out
    assert (tmp_path / "curve.png").stat().st_size > 5_000


def test_an_earlier_metrics_list_still_reads_and_other_files_are_refused(tmp_path) -> None:
    legacy = tmp_path / "metrics.json"
    legacy.write_text(json.dumps([m.model_dump() for m in (metrics(0, 0.2), metrics(1, 0.7))]))
    assert read_report(legacy)["final_accuracy"] == 0.7
    other = tmp_path / "other.json"
    other.write_text('{"a": 1}')
    with pytest.raises(ValueError, match=r"other\.json: not an edgeps report"):
        read_report(other)
    assert main(["report", str(tmp_path / "missing.json")]) == 2  # one line, no traceback


def test_the_report_shows_the_best_and_the_final_model_and_what_learning_nothing_scores(capsys) -> None:
    history = [metrics(0, 0.1, baseline=0.3), metrics(1, 0.9, baseline=0.3), metrics(2, 0.7, True, baseline=0.3)]
    report = build_report(history, 1.0, {})
    assert (report["best"], report["best_version"], report["final"], report["final_version"]) == (0.9, 1, 0.7, 2)
    assert report["baseline"] == 0.3
    format_report(report).print()
    out = capsys.readouterr().out
    assert "best accuracy   0.9000 (version 1)" in out and "final accuracy  0.7000 (version 2)" in out
    assert "trivial accuracy 0.3000 (predicting its most common class)\n" in out
    flat = [metrics(0, 0.3, baseline=0.3), metrics(1, 0.25, True, baseline=0.3)]
    format_report(build_report(flat, 1.0, {})).print()
    assert "the final model is no better; it learned nothing" in capsys.readouterr().out
