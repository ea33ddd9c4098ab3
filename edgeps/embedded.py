"""The C device SDK (edge_client/embedded), built and measured from Python: ``make`` with its
Makefile, the Cortex-M4F image's size, a model's arena size, and the scripted exchange on QEMU.
``edgeps bench embedded`` (edgeps/bench/embedded.py) reports them."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SDK = ROOT / "edge_client" / "embedded"
STACK_RESERVE = 8192
BATCH = 32
MODELS = ("64-64-10", "64-32-10")
CODECS = (("fp32", "fp32"), ("sign", "ternary"))  # (commits, pulls) of the real jobs
C_LOSSES = ("cross_entropy", "bce", "mse", "mae")  # what the C trainer (src/mlp.c) computes
ARENA_BYTES = 163840  # the scripted image's static arena: more than the demo model needs with any codec


def make(build: Path, *targets: str, **variables: object) -> None:
    """Build ``targets`` of the SDK's Makefile into ``build``; RuntimeError with make's output."""
    build = build.resolve()  # make runs in the SDK's folder
    command = ["make", "-s", "-C", str(SDK), f"BUILD={build}", *(f"{k}={v}" for k, v in variables.items()), *targets]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building {' '.join(targets)} failed:\n{result.stdout}{result.stderr}")


def build_device(build: Path) -> Path:
    """``edgeps-device`` built into ``build`` (again only if its sources changed); RuntimeError in one
    line if this machine cannot build it."""
    import shutil

    missing = [tool for tool in ("make", "cc") if shutil.which(tool) is None]
    if missing or not Path("/usr/include/mosquitto.h").exists():
        raise RuntimeError("C devices need a C compiler, make and libmosquitto's headers "
                           "(apt-get install gcc make libmosquitto-dev)")  # fmt: skip
    make(build, "edgeps-device")
    return build.resolve() / "edgeps-device"


def image_size(elf: Path) -> dict[str, int]:
    """``arm-none-eabi-size`` of an image: text, data, bss; flash and RAM as the module says."""
    out = subprocess.run(["arm-none-eabi-size", str(elf)], capture_output=True, text=True, check=True).stdout
    text, data, bss = (int(v) for v in out.splitlines()[1].split()[:3])
    return {"text": text, "data": data, "bss": bss, "flash_bytes": text + data, "ram_bytes": data + bss + STACK_RESERVE}


def arena_bytes(epsf: Path, model: str, codec: str = "fp32", pull: str = "fp32", batch: int = BATCH) -> int:
    out = subprocess.run([str(epsf), "arena", model.replace("-", ","), str(batch), codec, pull], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return int(out)


# ---------------------------------------------------------------- QEMU

RUN, INCARNATION, PUSH_EVERY, LR = 5, 4242, 4, 0.2


def _c_array(name: str, data: bytes) -> str:
    rows = ",\n".join(", ".join(f"0x{b:02x}" for b in data[i : i + 24]) for i in range(0, len(data), 24))
    return f"static const uint8_t {name}[] = {{\n{rows}\n}};\n"


def scripted_exchange(workdir: Path) -> dict[str, Any]:
    """Build the scripted image with the Python reference's messages (a Control, the demo model's
    parameters, an int8 delta, digits data), run it under QEMU and check each commit against
    learning.model on the batches the image drew. ``ok`` and the largest difference found."""
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
    control = Control(device="mcu-0", run=RUN, incarnation=INCARNATION, max_uncommitted_steps=8 * PUSH_EVERY,
                      push_every=PUSH_EVERY, lr=LR, batch_size=BATCH, codec="fp32", pull_codec="int8",
                      wait_for_params=False).to_bytes()  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "script.h").write_text("\n".join([
        "/* written by edgeps/embedded.py */",
        f"#define SCRIPT_INCARNATION {INCARNATION}u",
        f"#define DATA_SAMPLES {len(y)}u",
        f"#define DATA_FEATURES {x.shape[1]}u",
        _c_array("CONTROL", control + b"\0"),
        _c_array("PARAMS", encode_frame(Frame(kind=FrameKind.PARAMS, base_version=0, seq=RUN, tensors=params))),
        _c_array("DELTA", delta),
        _c_array("DATA", encode_data_frame(x, y)),
    ]))  # fmt: skip
    make(workdir / "build", "m4-script", SCRIPT_DIR=workdir, ARENA_BYTES=ARENA_BYTES)
    elf = workdir / "build" / "m4-script.elf"
    qemu = ["qemu-system-arm", "-M", "mps2-an386", "-nographic", "-semihosting", "-kernel", str(elf)]
    run = subprocess.run(qemu, capture_output=True, text=True, timeout=300)
    lines = (run.stdout + run.stderr).splitlines()
    if run.returncode != 0 or not lines or lines[-1] != "DONE":
        return {"ok": False, "detail": "\n".join(lines[-5:])[-1000:]}
    drawn = [int(line.split()[1]) for line in lines if line.startswith("IDX ")]
    commits = [decode_frame(bytes.fromhex(line.split()[2])) for line in lines
               if line.startswith("PUB edgeps/emb/grad/mcu-0 ")]  # fmt: skip
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
    return {"ok": ok, "max_abs_difference": worst, "detail": "" if ok else f"headers ok: {headers_ok}"}
