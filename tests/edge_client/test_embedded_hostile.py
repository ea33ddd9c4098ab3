"""Hostile input to the C device SDK on the host (64-bit), in a 32-bit build (size_t of 32 bits, as
on a microcontroller or a 32-bit gateway) and on the Cortex-M4F image under QEMU: the 105-byte
frame whose arena wrapped in 32-bit arithmetic, NaN, Inf and out-of-range numbers in every
message. Each is refused with a reason and changes nothing; mutations of them crash nothing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from edgeps.sdk.build import STACK_BYTES
from edgeps.sdk.corpus import CORPUS_RUN, corpus_on_qemu, hostile_corpus, wrapping_frame
from tests.edge_client.test_embedded_device import CDevice, data_frame
from tests.helpers import blobs

TOPICS = {
    "ctrl": "edgeps/fz/ctrl/d",
    "params": "edgeps/fz/params",
    "barrier": "edgeps/fz/barrier",
    "notice": "edgeps/fz/notice/d",
}


@pytest.fixture(params=["64-bit", "32-bit"])
def build(request) -> Path:
    return request.getfixturevalue("sdk" if request.param == "64-bit" else "sdk32")


def test_the_105_byte_frame_is_the_one_of_the_issue() -> None:
    frame = wrapping_frame()
    assert len(frame) == 105
    assert 2748 * 78118 + 78118 < 1 << 28  # below the frame reader's bound: only the layout can refuse it


def test_every_hostile_message_is_refused_with_a_reason_and_changes_nothing(build, tmp_path) -> None:
    device = CDevice(build / "epsd", "d", data_frame(blobs(seed=2), tmp_path / "d.bin"), seed=1, job="fz")
    try:
        device.connected()
        cases = hostile_corpus(incarnation=device.state()["incarnation"])
        for i, (kind, payload, expected) in enumerate(cases):
            device.logged.clear()
            device.on_message(TOPICS[kind], payload)
            assert device.verdict == expected, (i, payload[:80], device.logged)
            if expected != "ok":
                assert device.logged and device.logged[-1][0] == expected and device.logged[-1][1], device.logged
            if i == 1:
                model = device.state()
        state = device.state()
        assert state["run"] == CORPUS_RUN and state["server_version"] == model["server_version"] == 0
        assert state["unable"] == "buffer too small"  # the 105-byte frame's model: larger than its arena
    finally:
        device.close()


@pytest.mark.parametrize("bits", [64, 32])
def test_the_arena_of_the_105_byte_frames_model_never_wraps(request, bits) -> None:
    build = request.getfixturevalue("sdk" if bits == 64 else "sdk32")
    out = subprocess.run(
        [str(build / "epsf"), "arena", "2748,78118", "32", "topk:0.000000001"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    p = 2748 * 78118 + 78118
    exact = 4 * (3 * p + 2748 * 78118 + 32 * 2748 + 32)  # local, anchor, replica, work, batch, labels; then the frame
    arena = int(out.split()[0])
    if bits == 32:  # more than size_t holds: saturated, not 7 or any other small number
        assert arena == 2**32 - 1
    else:  # the frame's bytes come on top
        assert arena > exact


def test_the_cortex_m4f_image_refuses_them_too_and_survives_their_mutations(tmp_path) -> None:
    if shutil.which("arm-none-eabi-gcc") is None or shutil.which("qemu-system-arm") is None:
        pytest.fail("needs gcc-arm-none-eabi, libnewlib-arm-none-eabi and qemu-system-arm")
    result = corpus_on_qemu(tmp_path, mutations=200_000)
    assert result["ok"], result["tail"]
    assert result["verdicts"] == result["expected"]
    assert result["fuzzed"] == 200_000
    assert result["stack_peak_bytes"] <= STACK_BYTES * 3 // 4  # a refusal's reason too fits the image's stack
    # the reason, said on the target: its arena, in 32-bit arithmetic, is more than any memory (saturated)
    assert any("larger than this device's memory" in line for line in result["logs"])
