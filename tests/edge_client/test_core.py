from __future__ import annotations

import numpy as np
import pytest

from edge_client.backend import make_trainer
from edge_client.core import DeviceCore
from edge_client.trainer import NumpyTrainer
from learning.data import Dataset
from learning.model import init_mlp
from schemas.codecs.feedback import COMPACT
from schemas.frame import FrameKind
from schemas.messages import Barrier, Notice, RejectReason
from tests.helpers import INCARNATION, RUN, blobs, control_bytes, params_bytes, read_commit, small_device

T = "edgeps/t"


def params_frame(version: int, seed: int = 0, run: int = RUN) -> bytes:
    return params_bytes(version, init_mlp([8, 16, 3], seed), run)


def control(wait: bool, push_every: int = 3, **fields) -> bytes:
    return control_bytes("d1", push_every=push_every, wait_for_params=wait, **fields)


def test_not_ready_until_params_and_control_arrive() -> None:
    device = small_device("d1")
    assert not device.ready
    device.on_message(f"{T}/params", params_frame(0))
    assert not device.ready
    device.on_message(f"{T}/ctrl/d1", control(wait=True))
    assert device.ready
    with pytest.raises(RuntimeError):
        small_device("d2").step()


def test_commit_after_push_every_steps_carries_the_local_delta() -> None:
    device = small_device("d1")
    device.on_message(f"{T}/params", params_frame(4))
    device.on_message(f"{T}/ctrl/d1", control(wait=True, push_every=3))
    start = {k: v.copy() for k, v in device._local.items()}
    assert device.step() == [] and device.step() == []
    (commit,) = device.step()
    assert commit.topic == f"{T}/grad/d1" and commit.qos == 1 and not commit.retain
    frame = read_commit(commit.payload)
    assert (frame.kind, frame.device, frame.seq, frame.base_version) == (FrameKind.COMMIT, "d1", 1, 4)
    assert (frame.steps, frame.samples) == (3, 24)
    assert any(np.abs(v).sum() > 0 for v in frame.tensors.values())
    assert set(frame.tensors) == set(start)


def test_bsp_device_idles_after_commit_until_newer_params() -> None:
    device = small_device("d1")
    device.on_message(f"{T}/params", params_frame(0))
    device.on_message(f"{T}/ctrl/d1", control(wait=True, push_every=1))
    assert len(device.step()) == 1
    assert device.waiting and not device.ready
    device.on_message(f"{T}/params", params_frame(0))  # a duplicate of the old version changes nothing
    assert device.waiting
    device.on_message(f"{T}/params", params_frame(1, seed=5))
    assert device.ready and device.base_version == 1
    np.testing.assert_array_equal(device._local["dense0.w"], init_mlp([8, 16, 3], 5)["dense0.w"])


def test_without_waiting_new_params_are_adopted_with_uncommitted_progress_carried() -> None:
    device = small_device("d1")
    device.on_message(f"{T}/params", params_frame(0))
    device.on_message(f"{T}/ctrl/d1", control(wait=False, push_every=2))
    start = {k: v.copy() for k, v in device._local.items()}
    device.step()
    progress = {k: device._local[k] - start[k] for k in start}
    new = init_mlp([8, 16, 3], 5)
    device.on_message(f"{T}/params", params_frame(1, seed=5))
    assert device.ready and device.base_version == 1  # no idling, no lost work
    for k in new:
        np.testing.assert_allclose(device._local[k], new[k] + progress[k], rtol=1e-6, atol=1e-7)
    before_second = {k: v.copy() for k, v in device._local.items()}
    (commit,) = device.step()
    frame = read_commit(commit.payload)
    assert (frame.base_version, frame.steps) == (1, 2)
    for k in new:  # the commit carries both steps' progress, measured on the new base
        second = device._local[k] - before_second[k]
        np.testing.assert_allclose(frame.tensors[k], progress[k] + second, rtol=1e-5, atol=1e-6)
    assert device.ready  # and keeps training after the commit


def test_ssp_device_blocks_beyond_the_staleness_bound() -> None:
    device = small_device("d1")
    device.on_message(f"{T}/params", params_frame(0))
    device.on_message(f"{T}/ctrl/d1", control(wait=False, push_every=1, staleness_bound=2))
    for _ in range(3):
        device.step()
    assert device.seq == 3 and device.blocked and not device.ready  # 3 ahead of clock 0 > 2
    barrier = Barrier(run=RUN, round=3, version=3, pace="ssp:2", state="running", slowest_clock=1)
    device.on_message(f"{T}/barrier", barrier.to_bytes())
    assert device.ready


def test_sequence_numbers_increase_by_one() -> None:
    device = small_device("d1")
    device.on_message(f"{T}/params", params_frame(0))
    device.on_message(f"{T}/ctrl/d1", control(wait=False, push_every=1))
    seqs = [read_commit(device.step()[0].payload).seq for _ in range(4)]
    assert seqs == [1, 2, 3, 4]


def test_finished_barrier_stops_the_device() -> None:
    device = small_device("d1")
    device.on_message(f"{T}/ctrl/d1", control(wait=True))
    other_run = Barrier(run=RUN + 1, round=3, version=3, pace="bsp", state="finished").to_bytes()
    device.on_message(f"{T}/barrier", other_run)
    assert not device.finished  # a retained barrier left by an earlier run of the job
    barrier = Barrier(run=RUN, round=3, version=3, pace="bsp", state="finished").to_bytes()
    device.on_message(f"{T}/barrier", barrier)
    assert device.finished


def test_bad_inbound_messages_are_ignored_and_notices_kept() -> None:
    device = small_device("d1")
    for topic in (f"{T}/params", f"{T}/ctrl/d1", f"{T}/barrier", f"{T}/notice/d1", "x/y"):
        device.on_message(topic, b"\x00junk")
    assert device.control is None and device.server_version == -1
    notice = Notice(device="d1", seq=2, reason=RejectReason.NON_FINITE, detail="nan")
    device.on_message(f"{T}/notice/d1", notice.to_bytes())
    assert device.notices == [notice]


def test_status_messages() -> None:
    device = DeviceCore("t", "d1", blobs(), make_trainer("numpy")[0])
    hello, will = device.status("online"), device.status("offline")
    assert hello.retain and will.retain and hello.topic == will.topic == f"{T}/status/d1"
    with pytest.raises(ValueError):
        make_trainer("nope")


def test_acbsp_device_commits_once_per_version_and_carries_the_rest() -> None:
    device = small_device("d1")
    device.on_message(f"{T}/params", params_frame(0))
    device.on_message(f"{T}/ctrl/d1", control(wait=False, push_every=2, one_commit_per_version=True))
    device.step()
    assert len(device.step()) == 1  # the commit on version 0
    for _ in range(5):  # keeps training, never idle, but holds further commits
        assert device.ready and device.step() == []
    assert device.holding and device.steps == 5
    device.on_message(f"{T}/params", params_frame(1, seed=5))
    (commit,) = device.step()  # the carried 5 steps plus this one go out on version 1
    frame = read_commit(commit.payload)
    assert (frame.base_version, frame.steps, frame.seq) == (1, 6, 2)


def test_commits_use_the_control_codec_and_keep_what_it_dropped() -> None:
    device = small_device("d1")
    device.on_message(f"{T}/params", params_frame(0))
    device.on_message(f"{T}/ctrl/d1", control(wait=False, push_every=1, codec="sign"))
    before = {k: v.copy() for k, v in device._local.items()}
    (commit,) = device.step()
    frame = read_commit(commit.payload)
    assert frame.codec == "sign"
    sent = np.concatenate([values.ravel() for values in frame.tensors.values()])  # in the model's order
    true_delta = np.concatenate([(device._local[name] - before[name]).ravel() for name in frame.tensors])
    held = device.feedback.residual[COMPACT]  # a compact commit's residual: one vector, as its payload
    np.testing.assert_allclose(sent + held, true_delta, atol=1e-6)  # sent + held back = the true delta
    assert len(commit.payload) < 0.25 * len(params_frame(0))  # a tiny model: headers weigh in


def test_a_device_reports_its_speed_after_a_few_steps_and_again_only_when_it_drifts() -> None:
    from edge_client.speed import SPEED_SAMPLES
    from schemas.messages import DeviceStatus

    device = small_device("d")
    reports = [device.timed_step(0.02) for _ in range(SPEED_SAMPLES + 5)]
    assert [len(r) for r in reports] == [0] * (SPEED_SAMPLES - 1) + [1] + [0] * 5
    status = DeviceStatus.from_bytes(reports[SPEED_SAMPLES - 1][0].payload)
    assert status.state == "online" and status.step_s == pytest.approx(0.02)
    assert reports[SPEED_SAMPLES - 1][0].retain
    slower = [device.timed_step(0.05) for _ in range(20)]  # the device slows down (thermal throttling, say)
    assert 1 <= sum(len(r) for r in slower) <= 4  # a few reports as the smoothed time moves, not one per step
    assert device.speed.reported == pytest.approx(0.05, rel=0.25)
    assert device.timed_step(0.0) == [] and device.timed_step(float("nan")) == []


def test_a_model_the_data_does_not_fit_ends_the_device_with_one_line_instead_of_a_numpy_error() -> None:
    device = small_device("d1")  # blobs: 8 features, 3 classes
    device.on_message(f"{T}/ctrl/d1", control(wait=False, push_every=2))
    device.on_message(f"{T}/params", params_bytes(0, init_mlp([6, 16, 3], seed=0)))
    assert device.finished and not device.ready and device.replica is None
    assert device.fatal == "the job's model takes 6 features; this device's data has 8"
    assert [e.message for e in device.events.take()][-1] == device.fatal
    fewer = small_device("d1")  # parameters first, the Control after: judged once both are held
    fewer.on_message(f"{T}/params", params_bytes(0, init_mlp([8, 16, 2], seed=0)))  # labels 0..2, two outputs
    assert fewer.fatal is None
    fewer.on_message(f"{T}/ctrl/d1", control(wait=False))
    assert fewer.fatal == "the job's model (2 outputs, loss cross_entropy): label 2 (row 2) is not a class of 0..1"
    fits = small_device("d1")
    fits.on_message(f"{T}/ctrl/d1", control(wait=False))
    fits.on_message(f"{T}/params", params_bytes(0, init_mlp([8, 16, 3], seed=0)))
    assert fits.fatal is None and fits.replica is not None
    # Judged once per model and loss, not at every version; a model of other shapes is judged again.
    fits.on_message(f"{T}/params", params_bytes(1, init_mlp([8, 16, 3], seed=1)))
    assert fits.fatal is None and fits.server_version == 1
    fits.on_message(f"{T}/params", params_bytes(2, init_mlp([8, 16, 2], seed=0)))
    assert fits.fatal == "the job's model (2 outputs, loss cross_entropy): label 2 (row 2) is not a class of 0..1"


def test_a_device_whose_csv_columns_differ_from_the_jobs_does_not_train() -> None:
    """Rows read with other columns, another order or another scaling mean other things: the device
    says so in one line (its status's error) instead of training on them."""
    ours, theirs = "0123456789abcdef", "fedcba9876543210"
    same = DeviceCore("t", "d1", blobs(seed=1), NumpyTrainer(), seed=0, incarnation=INCARNATION, columns=ours)
    same.on_message(f"{T}/ctrl/d1", control(wait=False, columns=ours))
    assert same.fatal is None
    other = DeviceCore("t", "d1", blobs(seed=1), NumpyTrainer(), seed=0, incarnation=INCARNATION, columns=theirs)
    other.on_message(f"{T}/ctrl/d1", control(wait=False, columns=ours))
    assert other.finished and other.fatal == (
        f"this device's CSV columns, scaling or class names (fingerprint {theirs}) differ from the job's ({ours}): "
        "read the CSV with load_csv(..., scaling=the job's columns.json)"
    )
    unknown = small_device("d1")  # an .npz shard names no columns: nothing to compare
    unknown.on_message(f"{T}/ctrl/d1", control(wait=False, columns=ours))
    assert unknown.fatal is None


def test_the_device_trains_the_loss_its_control_names_and_stops_on_one_it_does_not_know() -> None:
    x = np.random.default_rng(0).normal(size=(200, 8)).astype(np.float32)
    targets = Dataset(x, (x @ np.linspace(-1, 1, 8)).astype(np.float32))  # a regression: real-valued targets
    device = DeviceCore("t", "d1", targets, NumpyTrainer(), seed=0, incarnation=INCARNATION)
    device.on_message(f"{T}/params", params_bytes(0, init_mlp([8, 16, 1], seed=0)))
    device.on_message(f"{T}/ctrl/d1", control(wait=False, push_every=50, loss="mse"))
    assert device.fatal is None and device.backend.trainer is not None and device.backend.trainer.loss == "mse"
    losses = []
    for _ in range(50):
        device.step()
        losses.append(device.last_loss)
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])  # mean squared error falls
    other = small_device("d1")
    other.on_message(f"{T}/ctrl/d1", control(wait=False, loss="huber"))
    assert other.fatal == (
        "the job trains with loss 'huber', which the numpy trainer does not know (cross_entropy, bce, mse, mae)"
    )


def test_a_device_whose_training_diverges_stops_with_one_line_instead_of_committing_nan() -> None:
    x = np.random.default_rng(0).normal(0, 30, size=(100, 8)).astype(np.float32)
    data = Dataset(x, (x.sum(axis=1) * 50).astype(np.float32))  # large targets: lr 5 explodes at once
    device = DeviceCore("t", "d1", data, NumpyTrainer(), seed=0, incarnation=INCARNATION)
    device.on_message(f"{T}/params", params_bytes(0, init_mlp([8, 16, 1], seed=0)))
    device.on_message(f"{T}/ctrl/d1", control(wait=False, push_every=1000, loss="mse", lr=5.0))
    sent = []
    while device.ready:
        sent += device.step()
    assert sent == [] and device.finished
    assert device.fatal is not None and device.fatal.startswith("local training diverged (loss ")
    assert device.fatal.endswith("the job's learning rate 5.0 is too high for this model and data")


def test_a_commit_the_device_waits_on_can_be_sent_again_as_the_same_bytes() -> None:
    device = small_device("d1")
    device.on_message(f"{T}/ctrl/d1", control(wait=True, push_every=2))
    device.on_message(f"{T}/params", params_frame(0))
    assert device.resend() == []  # nothing sent yet
    device.step()
    (commit,) = device.step()
    assert device.waiting and device.resend() == [commit]  # the same topic and bytes: the server drops a copy
    device.on_message(f"{T}/params", params_frame(1))  # the version it waited for
    assert not device.waiting and device.resend() == []
    device.step()
    (second,) = device.step()
    refused = Notice(device="d1", seq=read_commit(second.payload).seq, reason=RejectReason.RATE_LIMITED, detail="")
    device.on_message(f"{T}/notice/d1", refused.to_bytes())  # refused: its work goes into the next commit
    assert device.resend() == []


def test_a_waiting_device_says_what_it_waits_for() -> None:
    from edge_client.mqtt import awaited

    device = small_device("d1")
    device.on_message(f"{T}/params", params_frame(0))
    device.on_message(f"{T}/ctrl/d1", control(wait=True, push_every=1))
    device.step()  # its commit: bsp waits for the round
    first = "job t's first version: its start quorum (edgeps ps --min-devices) and the round's commits"
    assert awaited(device) == first
    waiting = Barrier(run=RUN, round=0, version=0, pace="bsp", state="running", waiting_for=["d2", "d3"])
    device.on_message(f"{T}/barrier", waiting.to_bytes())
    assert awaited(device) == "version 1: the round waits for 2 devices (d2, d3)"
    paused = Barrier(run=RUN, round=0, version=0, pace="bsp", state="paused")
    device.on_message(f"{T}/barrier", paused.to_bytes())
    assert awaited(device) == "job t to resume (an operator paused it: edgeps ctl resume)"
    ahead = small_device("d1")
    ahead.on_message(f"{T}/params", params_frame(0))
    ahead.on_message(f"{T}/ctrl/d1", control(wait=False, push_every=1, staleness_bound=2))
    for _ in range(3):
        ahead.step()
    assert awaited(ahead) == "the slowest device: ssp's staleness bound (2 commits) holds this one 3 commits ahead"
