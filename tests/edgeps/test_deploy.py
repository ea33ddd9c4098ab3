"""A saved model read back: its card, raw readings scaled as in training, and one line for bad input."""

from __future__ import annotations

import numpy as np
import pytest

from edgeps import ModelSpec, Task, load_csv
from edgeps.deploy import best_path, load_model
from learning.data import DataError
from learning.model import forward

ROWS = "gateway,temp,hum,label\n" + "".join(
    f"gw-{i % 2},{20 + i % 7},{40 + i % 5},{'walk' if i % 3 else 'idle'}\n" for i in range(30)
)


def saved(tmp_path):
    csv = tmp_path / "rows.csv"
    csv.write_text(ROWS)
    task = Task(model=ModelSpec(hidden="4"), data=lambda: load_csv(csv, "label", device_column="gateway"))
    data, _ = task.dataset()
    params = task.init(data, seed=0)
    written = task.save_model(params, tmp_path / "model.npz", task.card(version=7))
    return task, params, written


def test_a_saved_model_scales_raw_readings_and_predicts_as_the_server_measured(tmp_path) -> None:
    task, params, written = saved(tmp_path)
    assert [p.name for p in written] == ["model.npz", "model.json"] and best_path(written[0]).name == "model-best.npz"
    model = load_model(tmp_path)  # the folder, or the file
    assert model.card.version == 7 and model.card.classes == ["idle", "walk"] and model.card.label == "label"
    reordered = tmp_path / "new.csv"  # the columns in another order, the device column absent
    reordered.write_text(
        "label,hum,temp\n"
        + "".join(f"{r.split(',')[3]},{r.split(',')[2]},{r.split(',')[1]}\n" for r in ROWS.splitlines()[1:])
    )
    x, y = model.read_csv(reordered)
    data, _ = task.dataset()
    np.testing.assert_allclose(model.outputs(x), forward(params, data.x), rtol=1e-6)
    assert y is not None and y.tolist() == data.y.tolist()
    assert model.evaluate(x, y)["accuracy"] == pytest.approx(float((model.predict(x) == data.y).mean()))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("temp,humidity\n1,2\n", r"no column 'hum'; did you mean 'humidity'\?"),
        ("temp,hum,label\n1,2,run\n", r"line 2, column 'label': 'run' is not one of the model's classes"),
        ("temp,hum\n1,warm\n", r"line 2, column 'hum': 'warm' is not a number"),
    ],
)
def test_readings_the_model_cannot_take_are_one_line(tmp_path, text, message) -> None:
    saved(tmp_path)
    (tmp_path / "bad.csv").write_text(text)
    with pytest.raises(DataError, match=message):
        load_model(tmp_path / "model.npz").read_csv(tmp_path / "bad.csv")
    with pytest.raises(DataError, match="no model card"):
        load_model(tmp_path / "elsewhere.npz")
