from __future__ import annotations

import json

from edgeps.bench.pace import format_pace_table, run_bench_pace
from edgeps.cli import main
from edgeps.scenario import Scenario


def test_bench_pace_writes_table_plot_and_json(tmp_path, capsys) -> None:
    scenario = Scenario(devices=4, duration_s=2.0, hidden=(16,), sample_s=0.5, target=0.5)
    run_bench_pace(
        scenario, ["bsp", "acbsp"], real=False, json_path=str(tmp_path / "b.json"), plot_path=tmp_path / "b.png"
    )
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["scenario"]["devices"] == 4
    keys = {
        "pace",
        "time_to_target",
        "best_accuracy",
        "final_accuracy",
        "idle_fraction",
        "commits",
        "bytes_up",
        "bytes_down",
    }
    assert [r["pace"] for r in report["runs"]] == ["bsp", "acbsp"]
    assert all(keys <= set(r) for r in report["runs"])
    assert (tmp_path / "b.png").stat().st_size > 10_000
    assert "acbsp" in capsys.readouterr().out


def test_table_marks_unreached_targets() -> None:
    runs = [
        {
            "pace": "bsp",
            "time_to_target": 4.0,
            "best_accuracy": 0.9,
            "final_accuracy": 0.9,
            "idle_fraction": 0.5,
            "commits": 1,
            "bytes_up": 1,
            "bytes_down": 1,
        },
        {
            "pace": "asp",
            "time_to_target": None,
            "best_accuracy": 0.8,
            "final_accuracy": 0.8,
            "idle_fraction": 0.0,
            "commits": 1,
            "bytes_up": 1,
            "bytes_down": 1,
        },
    ]
    table = str(format_pace_table(runs, "virtual s"))
    assert "never" in table and "1.00x" in table


def test_cli_refuses_an_unknown_pace_before_running(capsys) -> None:
    assert main(["bench", "pace", "--paces", "bsp,warp"]) == 2


def test_bench_codec_reports_every_codec_against_copy(tmp_path) -> None:
    assert main(["bench", "codec", "--sizes", "4096", "--repeats", "1", "--json", str(tmp_path / "c.json")]) == 0
    rows = json.loads((tmp_path / "c.json").read_text())["codecs"]
    assert [r["codec"] for r in rows] == ["fp32", "fp16", "int8", "sign", "ternary", "qsgd:16", "topk:0.01"]
    fp32 = rows[0]
    assert fp32["ratio"] == 1.0 and fp32["rel_error"] == 0.0
    assert all(r["encode_vs_copy"] > 0 and r["decode_vs_copy"] > 0 for r in rows)
    assert next(r for r in rows if r["codec"] == "topk:0.01")["ratio"] > 50


def test_bench_pace_sweeps_push_and_pull_codecs(tmp_path) -> None:
    scenario = Scenario(devices=3, duration_s=1.0, hidden=(16,), sample_s=0.5, target=0.5)
    report = run_bench_pace(
        scenario, ["acbsp"], real=False, json_path=None, plot_path=tmp_path / "c.png", codecs=["fp32", "sign/ternary"]
    )
    runs = report["runs"]
    assert [(r["run"], r["codec"], r["pull_codec"]) for r in runs] == [
        ("acbsp fp32", "fp32", "fp32"),
        ("acbsp sign/ternary", "sign", "ternary"),
    ]
    assert runs[1]["bytes_up"] * 10 < runs[0]["bytes_up"]
    assert runs[1]["bytes_down"] < runs[0]["bytes_down"]  # 1 s: the joins' full snapshots dominate


def test_bench_freq_writes_table_plot_and_json(tmp_path, capsys) -> None:
    from edgeps.bench.freq import run_bench_freq

    scenario = Scenario(devices=4, duration_s=2.0, hidden=(16,), sample_s=0.5, target=0.5, push_every_max=20)
    run_bench_freq(scenario, json_path=str(tmp_path / "f.json"), plot_path=tmp_path / "f.png")
    report = json.loads((tmp_path / "f.json").read_text())
    keys = {"policy", "commits_to_target", "bytes_to_target", "time_to_target", "best_accuracy"}
    assert [r["policy"] for r in report["runs"]][:3] == ["fixed", "adacomm", "trend"]
    assert all(keys <= set(r) for r in report["runs"])
    fixed = report["runs"][0]
    assert fixed["commits_to_target"] is None or 0 < fixed["commits_to_target"] <= fixed["commits"]
    assert (tmp_path / "f.png").stat().st_size > 10_000
    assert "commits to target" in capsys.readouterr().out


def test_bench_pace_over_seeds_reports_means_of_the_per_seed_runs(tmp_path, capsys) -> None:
    scenario = Scenario(devices=4, duration_s=1.5, hidden=(16,), sample_s=0.5, target=0.5, seed=3)
    run_bench_pace(scenario, ["bsp", "acbsp"], False, str(tmp_path / "s.json"), tmp_path / "s.png", seeds=2)
    report = json.loads((tmp_path / "s.json").read_text())
    assert [(r["pace"], r["seed"]) for r in report["runs"]] == [("bsp", 3), ("acbsp", 3), ("bsp", 4), ("acbsp", 4)]
    for mean in report["means"]:
        mine = [r for r in report["runs"] if r["pace"] == mean["pace"]]
        assert mean["seeds"] == 2 and mean["best_per_seed"] == [r["best_accuracy"] for r in mine]
        assert abs(mean["best_accuracy"] - sum(mean["best_per_seed"]) / 2) < 1e-9
        assert abs(mean["plateau_accuracy"] - sum(r["plateau_accuracy"] for r in mine) / 2) < 1e-9
        for run in mine:
            low = run["lowest_after_target"]
            assert low is None or low <= run["best_accuracy"]
    assert (tmp_path / "s.png").stat().st_size > 10_000
    assert "means over seeds 3..4" in capsys.readouterr().out


def test_cli_refuses_seeds_with_real_runs(caplog) -> None:
    assert main(["bench", "pace", "--seeds", "2", "--real"]) == 2
    assert "--seeds runs in the simulator" in caplog.text


def test_bench_scale_fits_exponents_and_draws_both_sweeps(tmp_path) -> None:
    from edgeps.bench.scale import bench_scale, exponent

    assert exponent([1, 10, 100], [3, 30, 300]) == 1.0 and exponent([1, 10], [5, 5]) == 0.0
    report = bench_scale(fleets=(4, 16), models=((16,), (64,)), rounds=2, out=tmp_path, say=lambda *a, **k: None)
    assert [r["devices"] for r in report["fleet"]] == [4, 16] and all(r["versions"] == 2 for r in report["fleet"])
    # Each device sends a commit and receives the parameters every round: bytes grow with the fleet, about linearly.
    assert 0.8 <= report["fleet_exponents"]["bytes_per_round"] <= 1.2
    assert report["model"][1]["params"] > report["model"][0]["params"]
    assert report["model_exponents"]["checkpoint_bytes"] > 0.5  # the checkpoint holds the model
    assert (tmp_path / "scale-fleet.png").stat().st_size > 10_000 and (tmp_path / "scale-model.png").exists()


def test_bench_sites_compares_the_same_job_flat_and_over_aggregators(tmp_path, capsys) -> None:
    out = tmp_path / "sites.json"
    assert main(["bench", "sites", "--devices", "12", "--sites", "3", "--rounds", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    flat, summed = report["flat"], report["with_sites"]
    assert flat["versions"] == summed["versions"] == 2 and flat["applied"] == summed["applied"] == 24
    assert flat["messages_per_round"] == 12 and summed["messages_per_round"] == 3  # a site commit a site a round
    assert report["ratios"]["bytes_up_per_round"] < 0.5 and summed["accuracy"] == flat["accuracy"]  # bsp: same job
    assert "bytes up into the core" in capsys.readouterr().out


def test_bench_shards_cuts_each_shards_bytes_and_takes_every_commit(tmp_path) -> None:
    out = tmp_path / "shards.json"
    assert main(["bench", "shards", "--shards", "1,2", "--devices", "4", "--rounds", "2", "--json", str(out)]) == 0
    rows = {(r["params"], r["shards"]): r for r in json.loads(out.read_text())["rows"]}
    for params in {p for p, _ in rows}:
        one, two = rows[params, 1], rows[params, 2]
        assert two["bytes_per_shard"] < 0.55 * one["bytes_per_shard"]  # half the values, and a header each
        assert one["bytes_total"] <= two["bytes_total"] < 1.05 * one["bytes_total"]
        assert one["speedup"] == 1.0 and two["round_cpu_s"] > 0


def test_bench_tasks_trains_the_centralised_reference_and_shows_the_gap() -> None:
    from edgeps import ModelSpec, Task
    from edgeps.bench.tasks import centralised, format_tasks
    from tests.helpers import blobs

    data = blobs(n=300)
    task = Task(model=ModelSpec(hidden="8"), data=lambda: (data.x, data.y))
    reference = centralised(task, max_epochs=30, patience=5)
    assert reference["best"] > 0.9 and 1 <= reference["epochs"] <= 30 and reference["lr"] in (0.2, 0.05)
    run = {"best": 0.9, "best_version": 40, "final": 0.85, "rounds": 140, "wall_s": 3.0}

    def entry(name: str, metric: str, higher: bool, reference: float) -> dict:
        return {
            "task": name,
            "metric": metric,
            "higher_is_better": higher,
            "centralised": {"best": reference},
            "runs": {"fp32": run},
        }

    report = {"codecs": ["fp32"], "tasks": [entry("mine", "accuracy", True, 0.92), entry("reg", "rmse", False, 0.5)]}
    text = str(format_tasks(report))
    assert "-2.0 pt" in text and "1.80x" in text
