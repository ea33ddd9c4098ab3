"""The scripted exchange on QEMU: a firmware image fed a job's messages over semihosting, with its
instruction counts (``-icount``) and stack peak."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from edgeps.sdk.build import ARENA_BYTES, BATCH, INCARNATION, LR, PUSH_EVERY, RUN, make


def _c_array(name: str, data: bytes) -> str:
    rows = ",\n".join(", ".join(f"0x{b:02x}" for b in data[i : i + 24]) for i in range(0, len(data), 24))
    return f"static const uint8_t {name}[] = {{\n{rows}\n}};\n"


#: board -> the scripted image's make target and QEMU with its machine flags
SCRIPT_BOARDS = {
    "mps2-an386": ("m4-script", ["qemu-system-arm", "-M", "mps2-an386"]),
    "riscv32-virt": ("rv32-script", ["qemu-system-riscv32", "-M", "virt", "-bios", "none"]),
}


def scripted_exchange(workdir: Path, board: str = "mps2-an386") -> dict[str, Any]:
    """Build the scripted image for ``board`` with the Python reference's messages (a Control, the
    demo model's parameters, an int8 delta, digits data), run it under QEMU and check each commit
    against learning.model on the batches the image drew. ``ok`` and the largest difference found,
    the instructions of receiving the parameter frame (64 bytes at a time, straight into the
    arena) and of one local step."""
    from learning.data import load_digits
    from learning.model import init_mlp, loss_and_grads
    from schemas.frame import Frame, FrameKind, decode_frame, encode_data_frame, encode_frame
    from schemas.messages import Control

    digits = load_digits()
    x, y = digits.x[:120], digits.y[:120]
    params = init_mlp([64, 64, 10], seed=0)
    rng = np.random.default_rng(1)
    change = {name: (rng.standard_normal(v.shape) * 0.01).astype(np.float32) for name, v in params.items()}
    delta = encode_frame(Frame(kind=FrameKind.DELTA, base_version=1, seq=0, tensors=change, codec="int8"))
    control = Control(
        device="mcu-0",
        run=RUN,
        incarnation=INCARNATION,
        max_uncommitted_steps=8 * PUSH_EVERY,
        push_every=PUSH_EVERY,
        lr=LR,
        batch_size=BATCH,
        codec="fp32",
        pull_codec="int8",
        wait_for_params=False,
    ).to_bytes()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "script.h").write_text(
        "\n".join(
            [
                "/* written by edgeps/sdk */",
                f"#define SCRIPT_INCARNATION {INCARNATION}u",
                f"#define DATA_SAMPLES {len(y)}u",
                f"#define DATA_FEATURES {x.shape[1]}u",
                _c_array("CONTROL", control + b"\0"),
                _c_array("PARAMS", encode_frame(Frame(kind=FrameKind.PARAMS, base_version=0, seq=RUN, tensors=params))),
                _c_array("DELTA", delta),
                _c_array("DATA", encode_data_frame(x, y)),
            ]
        )
    )
    # the script's data and the larger arena need more RAM than the part: linked for QEMU's 4 MiB
    target, _ = SCRIPT_BOARDS[board]
    make(workdir / "build", target, SCRIPT_DIR=workdir, ARENA_BYTES=ARENA_BYTES, RAM_BYTES=4 << 20, FLASH_BYTES=4 << 20)
    lines = run_qemu(workdir / "build" / f"{target}.elf", board=board)
    if not lines or lines[-1] != "DONE":
        return {"ok": False, "detail": "\n".join(lines[-5:])[-1000:]}
    keys = ("PARAMS_INSTRUCTIONS", "STEP_INSTRUCTIONS", "STACK")
    figures = {key.lower(): int(line.split()[1]) for line in lines for key in keys if line.startswith(key + " ")}
    drawn = [int(line.split()[1]) for line in lines if line.startswith("IDX ")]  # in the order drawn
    shapes = {name: v.shape for name, v in params.items()}  # a compact commit (top-k) names no tensors
    commits = [
        decode_frame(bytes.fromhex(line.split()[2]), shapes=shapes)
        for line in lines
        if line.startswith("PUB edgeps/emb/grad/mcu-0 ")
    ]
    if len(commits) != 2 or len(drawn) != 2 * PUSH_EVERY * BATCH:
        return {"ok": False, "detail": f"{len(commits)} commits, {len(drawn)} samples drawn"}
    local = {name: v.copy() for name, v in params.items()}
    anchor = {name: v.copy() for name, v in params.items()}
    batches = iter(np.array(drawn).reshape(-1, BATCH))
    worst, headers_ok = 0.0, True
    for phase, commit in enumerate(commits):
        if phase == 1:  # the delta arrives: the replica of version 1 (float32 addition), adopted
            replica = {name: params[name] + decode_frame(delta).tensors[name] for name in params}
            local = {name: replica[name] + (local[name] - anchor[name]) for name in params}
            anchor = {name: v.copy() for name, v in replica.items()}
        for _ in range(PUSH_EVERY):
            batch = next(batches)
            _, grads = loss_and_grads(local, x[batch], y[batch])
            local = {name: local[name] - np.float32(LR) * grads[name] for name in params}
        headers_ok &= (commit.seq, commit.base_version, commit.steps, commit.samples, list(commit.tensors)) == (
            phase + 1,
            phase,
            PUSH_EVERY,
            PUSH_EVERY * BATCH,
            list(params),
        )
        for name in params:
            worst = max(worst, float(np.max(np.abs(commit.tensors[name] - (local[name] - anchor[name])))))
        anchor = {name: v.copy() for name, v in local.items()}
    ok = headers_ok and worst <= 1e-5
    return {
        "ok": ok,
        "max_abs_difference": worst,
        "detail": "" if ok else f"headers ok: {headers_ok}",
        "params_frame_instructions": figures["params_instructions"],
        "step_instructions": figures["step_instructions"],
        "stack_peak_bytes": figures["stack"],
    }


def run_qemu(elf: Path, timeout: float = 300, board: str = "mps2-an386") -> list[str]:
    """Run an image on QEMU's ``board`` with -icount (every instruction the same virtual time, so
    SysTick or mtime counts instructions); its console lines, and a last line ``EXIT n`` if it did
    not exit 0."""
    qemu = [*SCRIPT_BOARDS[board][1], "-nographic", "-semihosting", "-icount", "shift=0", "-kernel", str(elf)]
    run = subprocess.run(qemu, capture_output=True, text=True, timeout=timeout)
    lines = (run.stdout + run.stderr).splitlines()
    return lines if run.returncode == 0 else [*lines, f"EXIT {run.returncode}"]
