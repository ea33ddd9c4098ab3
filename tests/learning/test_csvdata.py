"""Sensor readings from CSV: what is read, how it is split, and one line for every bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from learning.csvdata import DataError, load_csv
from learning.data import Dataset
from learning.prepare import prepare_device_shards

GOOD = """gateway,temp,humidity,label
gw-a,21.5,40,idle
gw-a,25.0,55,walk
gw-b,30.5,60,run
gw-b,22.0,42,idle
gw-a,28.0,58,run
gw-b,26.5,50,walk
"""


def write(tmp_path, text: str, name: str = "readings.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_rows_become_a_scaled_dataset_with_named_classes(tmp_path) -> None:
    table = load_csv(write(tmp_path, GOOD), "label", device_column="gateway")
    assert table.classes == ["idle", "run", "walk"] and table.scaling.features == ["temp", "humidity"]
    assert table.data.y.tolist() == [0, 2, 1, 0, 1, 2]
    assert table.data.x.dtype == np.float32 and table.data.x.min() == 0.0 and table.data.x.max() == 1.0
    np.testing.assert_allclose(table.scaling.apply(np.array([[21.5, 40.0]])), [[0.0, 0.0]])
    assert table.devices == ["gw-a", "gw-a", "gw-b", "gw-b", "gw-a", "gw-b"]
    numbered = load_csv(write(tmp_path, "a,b,y\n1,2,0\n3,4,2\n"), "y", features=["b"])
    assert numbered.classes == ["0", "1", "2"] and numbered.data.x.shape == (2, 1)


def test_data_split_by_gateway_gives_one_shard_per_device(tmp_path) -> None:
    rows = "gateway,temp,label\n" + "".join(f"gw-{i % 3},{i},{i % 2}\n" for i in range(60))
    table = load_csv(write(tmp_path, rows), "label", device_column="gateway")
    assert table.devices is not None
    paths = prepare_device_shards(table.data, table.devices, tmp_path / "shards", seed=0)
    assert [p.name for p in paths.devices] == ["gw-0.npz", "gw-1.npz", "gw-2.npz"]
    sizes = [len(Dataset.load(p)) for p in paths.devices] + [len(Dataset.load(paths.holdout))]
    assert sum(sizes) == 60 and len(Dataset.load(paths.holdout)) == 12  # every row once; 20% held out
    with pytest.raises(ValueError, match="not device ids"):
        prepare_device_shards(table.data, ["gw/0"] * 60, tmp_path / "bad", seed=0)


@pytest.mark.parametrize(
    ("text", "kwargs", "message"),
    [
        ("temp,label\n1,0\n", {"label": "y"}, "no column 'y' (columns: temp, label)"),
        ("temp,label\n1,0\nwarm,1\n", {"label": "label"}, "line 3, column 'temp': 'warm' is not a number"),
        ("temp,label\n1,0\nnan,1\n", {"label": "label"}, "line 3, column 'temp': 'nan' is not a finite number"),
        ("temp,label\n1,0\n,1\n", {"label": "label"}, "line 3, column 'temp': '' is not a number"),
        ("temp,label\n1,0\n2,\n", {"label": "label"}, "line 3, column 'label': missing label"),
        (
            "temp,label\n1,0\n2,5\n",
            {"label": "label", "classes": 3},
            "line 3, column 'label': 5 is outside the 3 classes",
        ),
        ("temp,label\n1,0\n2\n", {"label": "label"}, "line 3: 1 fields, the header has 2"),
        ("temp,label\n", {"label": "label"}, "no data rows"),
        ("", {"label": "label"}, "empty file"),
        ("label\n1\n", {"label": "label"}, "no feature columns"),
    ],
)
def test_every_bad_input_is_one_line_naming_file_line_and_column(tmp_path, text, kwargs, message) -> None:
    path = write(tmp_path, text)
    with pytest.raises(DataError) as caught:
        load_csv(path, **kwargs)
    assert message in str(caught.value) and str(path) in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.integration  # starts the edgeps command
def test_edgeps_data_reads_a_csv_and_refuses_a_bad_one_in_one_line(tmp_path) -> None:
    rows = "gateway,temp,hum,label\n" + "".join(f"gw-{i % 2},{20 + i % 7},{40 + i % 5},{i % 3}\n" for i in range(40))
    good = write(tmp_path, rows)
    run = [
        sys.executable,
        "-m",
        "edgeps.cli",
        "data",
        "--csv",
        str(good),
        "--label",
        "label",
        "--device-column",
        "gateway",
        "--out",
        str(tmp_path / "out"),
    ]
    done = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "columns.json",
        "gw-0.npz",
        "gw-1.npz",
        "holdout.npz",
    ]
    assert json.loads((tmp_path / "out" / "columns.json").read_text())["features"] == ["temp", "hum"]
    bad = write(tmp_path, rows.replace("gw-1,21,41,1", "gw-1,21,fourty,1"), "bad.csv")
    done = subprocess.run([*run[:5], str(bad), *run[6:]], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{bad} line 3, column 'hum': 'fourty' is not a number" in done.stderr.strip().splitlines()[-1]


def test_a_gateways_own_file_read_with_the_fleets_scaling_means_what_the_fleets_rows_mean(tmp_path) -> None:
    fleet = load_csv(write(tmp_path, GOOD), "label", device_column="gateway")
    fleet.save_meta(tmp_path / "columns.json")
    mine = "label,humidity,temp\nidle,42,22.0\nrun,58,29.0\n"  # its columns in another order, no gateway column
    own = load_csv(write(tmp_path, mine, "mine.csv"), "label", scaling=tmp_path / "columns.json")
    np.testing.assert_allclose(own.data.x, fleet.scaling.apply(np.array([[22.0, 42.0], [29.0, 58.0]])))
    assert own.fingerprint == fleet.fingerprint and own.classes == fleet.classes
    alone = load_csv(write(tmp_path, mine, "alone.csv"), "label", features=["temp", "humidity"])  # its own min and max
    assert alone.fingerprint != fleet.fingerprint
    # A gateway that saw two of the activities: its names are numbered as the fleet's, not 0 and 1.
    seen = load_csv(
        write(tmp_path, "label,humidity,temp\nwalk,42,22\nrun,58,29\n", "two.csv"),
        "label",
        scaling=tmp_path / "columns.json",
    )
    assert seen.data.y.tolist() == [2, 1] and seen.fingerprint == fleet.fingerprint
    unnumbered = load_csv(
        write(tmp_path, "label,humidity,temp\nwalk,42,22\nrun,58,29\n", "own.csv"), "label", scaling=fleet.scaling
    )  # a Scaling without class names: its own numbering
    assert unnumbered.data.y.tolist() == [1, 0] and unnumbered.fingerprint != fleet.fingerprint
    with pytest.raises(DataError, match=r"line 2, column 'label': 'jog' is not one of the classes \(idle, run, walk\)"):
        load_csv(
            write(tmp_path, "label,humidity,temp\njog,42,22\n", "jog.csv"), "label", scaling=tmp_path / "columns.json"
        )
    renamed = "label,humid,temp\nidle,40,21.5\n"
    with pytest.raises(DataError, match=r"no column 'humidity'; did you mean 'humid'\?"):
        load_csv(write(tmp_path, renamed, "renamed.csv"), "label", scaling=fleet.scaling)
