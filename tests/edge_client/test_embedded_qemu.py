"""The device core cross-compiled for a Cortex-M4F (arm-none-eabi-gcc, hard float) and run under
QEMU (mps2-an386, semihosting): a scripted exchange exported by the Python reference (a Control,
the demo model's parameters, an int8 delta, digits data), checked step by step against
learning.model on the batches the image says it drew."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from learning.data import load_digits
from learning.model import init_mlp, loss_and_grads
from schemas.frame import Frame, FrameKind, decode_frame, encode_data_frame, encode_frame
from schemas.messages import Control

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "edge_client" / "embedded"
RUN, INCARNATION, PUSH_EVERY, BATCH, LR = 5, 4242, 4, 8, 0.2


def c_array(name: str, data: bytes) -> str:
    rows = ",\n".join(", ".join(f"0x{b:02x}" for b in data[i : i + 24]) for i in range(0, len(data), 24))
    return f"static const uint8_t {name}[] = {{\n{rows}\n}};\n"


def script(params, delta: bytes, x: np.ndarray, y: np.ndarray) -> str:
    control = Control(device="mcu-0", run=RUN, incarnation=INCARNATION, max_uncommitted_steps=8 * PUSH_EVERY,
                      push_every=PUSH_EVERY, lr=LR, batch_size=BATCH, codec="fp32", pull_codec="int8",
                      wait_for_params=False).to_bytes()  # fmt: skip
    return "\n".join([
        "/* written by tests/edge_client/test_embedded_qemu.py */",
        f"#define SCRIPT_INCARNATION {INCARNATION}u",
        f"#define DATA_SAMPLES {len(y)}u",
        f"#define DATA_FEATURES {x.shape[1]}u",
        c_array("CONTROL", control + b"\0"),
        c_array("PARAMS", encode_frame(Frame(kind=FrameKind.PARAMS, base_version=0, seq=RUN, tensors=params))),
        c_array("DELTA", delta),
        c_array("DATA", encode_data_frame(x, y)),
    ])  # fmt: skip


@pytest.fixture(scope="module")
def toolchain() -> None:
    missing = [tool for tool in ("arm-none-eabi-gcc", "qemu-system-arm") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the Cortex-M test needs {missing} (apt-get install gcc-arm-none-eabi libnewlib-arm-none-eabi "
                    "qemu-system-arm)")  # fmt: skip


def test_the_cortex_m4f_image_trains_and_commits_as_the_reference(toolchain, tmp_path) -> None:
    digits = load_digits()
    x, y = digits.x[:120], digits.y[:120]
    params = init_mlp([64, 64, 10], seed=0)
    rng = np.random.default_rng(1)
    change = {name: (rng.standard_normal(v.shape) * 0.01).astype(np.float32) for name, v in params.items()}
    delta = encode_frame(Frame(kind=FrameKind.DELTA, base_version=1, seq=0, tensors=change, codec="int8"))
    (tmp_path / "script.h").write_text(script(params, delta, x, y))
    build = tmp_path / "build"
    subprocess.run(["make", "-s", "-C", str(SDK), f"BUILD={build}", f"SCRIPT_DIR={tmp_path}", "m4-script"], check=True)
    run = subprocess.run(["qemu-system-arm", "-M", "mps2-an386", "-nographic", "-semihosting", "-kernel",
                          str(build / "m4-script.elf")], capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and lines[-1] == "DONE", run.stdout[-2000:]
    drawn = [int(line.split()[1]) for line in lines if line.startswith("IDX ")]
    commits = [decode_frame(bytes.fromhex(line.split()[2])) for line in lines
               if line.startswith("PUB edgeps/emb/grad/mcu-0 ")]  # fmt: skip
    assert len(commits) == 2 and len(drawn) == 2 * PUSH_EVERY * BATCH
    arena = int(next(line.split()[1] for line in lines if line.startswith("ARENA ")))
    assert 0 < arena <= 163840

    # The same exchange in Python, on the batches the image drew.
    local = {name: v.copy() for name, v in params.items()}
    anchor = {name: v.copy() for name, v in params.items()}
    batches = iter(np.array(drawn).reshape(-1, BATCH))
    expected = []
    for phase in range(2):
        if phase == 1:  # the delta arrives: the replica of version 1 (float32 addition), adopted
            replica = {name: params[name] + decode_frame(delta).tensors[name] for name in params}
            local = {name: replica[name] + (local[name] - anchor[name]) for name in params}
            anchor = {name: v.copy() for name, v in replica.items()}
        for _ in range(PUSH_EVERY):
            batch = next(batches)
            _, grads = loss_and_grads(local, x[batch], y[batch])
            local = {name: local[name] - np.float32(LR) * grads[name] for name in params}
        expected.append({name: local[name] - anchor[name] for name in params})
        anchor = {name: v.copy() for name, v in local.items()}
    for seq, (commit, tensors) in enumerate(zip(commits, expected, strict=True), start=1):
        assert (commit.seq, commit.base_version, commit.steps, commit.samples) == (seq, seq - 1, PUSH_EVERY,
                                                                                   PUSH_EVERY * BATCH)  # fmt: skip
        assert commit.device == "mcu-0" and list(commit.tensors) == list(params)
        for name, values in tensors.items():
            np.testing.assert_allclose(commit.tensors[name], values, rtol=0, atol=1e-5, err_msg=name)
