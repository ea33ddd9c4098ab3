"""The C device SDK (edge_client/embedded), built and measured from Python: ``make`` with its
Makefile, the Cortex-M4F image's size (from its link map: the SDK's own code, libc/libm, the
start-up), a model's arena size, the scripted exchange on QEMU (with its instruction counts and
stack peak) and the hostile corpus on QEMU. ``edgeps bench embedded`` (edgeps/bench/embedded.py)
reports them."""

from __future__ import annotations

import re
import struct
import subprocess
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SDK = ROOT / "edge_client" / "embedded"
RAM_BYTES = 128 * 1024  # the part the image is linked for (an STM32F4-class Cortex-M4F)
STACK_BYTES = 2048  # the image's stack: the measured peak (``stack_peak_bytes``) with room for a port's calls
SDK_OBJECTS = ("frame.o", "codec.o", "mlp.o", "json.o", "device.o")
BOARD_OBJECTS = ("board.o", "console.o")  # semihosting (and, on RV32, the reset code beside it): QEMU's console
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
        raise RuntimeError(
            "C devices need a C compiler, make and libmosquitto's headers (apt-get install gcc make libmosquitto-dev)"
        )
    make(build, "edgeps-device")
    return build.resolve() / "edgeps-device"


def image_size(elf: Path) -> dict[str, int]:
    """``arm-none-eabi-size`` of an image (text, data, bss: the stack and the static arena are in
    bss), and its link map's flash by who brought it: ``sdk_bytes`` (src/*.c), ``libc_bytes``
    (libc, libm, libgcc), ``startup_bytes`` (the vector table, reset and main), ``board_bytes``
    (semihosting). ``flash_bytes`` is text + data less semihosting; ``ram_bytes`` data + bss."""
    riscv = int.from_bytes(elf.read_bytes()[18:20], "little") == 243  # ELF e_machine: EM_RISCV, else EM_ARM
    size = "riscv64-unknown-elf-size" if riscv else "arm-none-eabi-size"
    out = subprocess.run([size, str(elf)], capture_output=True, text=True, check=True).stdout
    text, data, bss = (int(v) for v in out.splitlines()[1].split()[:3])
    share = flash_by_origin(Path(f"{elf}.map"))
    return {
        "text": text,
        "data": data,
        "bss": bss,
        "flash_bytes": text + data - share["board"],
        "ram_bytes": data + bss,
        "sdk_bytes": share["sdk"],
        "libc_bytes": share["libc"],
        "startup_bytes": share["startup"],
        "board_bytes": share["board"],
    }


_INPUT = re.compile(
    r"^ (\.(?:text|rodata|srodata|data|sdata|ARM\.exidx)\S*)\s*\n?\s+0x[0-9a-f]+\s+0x([0-9a-f]+)\s+(\S+)", re.M
)


def flash_by_origin(map_file: Path) -> Counter[str]:
    """The flash each origin's input sections take in a GNU ld map: sdk, libc, startup, board."""
    text = map_file.read_text()
    text = text[text.index("Linker script and memory map") :]
    share: Counter[str] = Counter()
    for _, size, origin in _INPUT.findall(text):
        name = origin.rsplit("/", 1)[-1]
        kind = (
            "sdk"
            if name in SDK_OBJECTS
            else "board"
            if name in BOARD_OBJECTS
            else "libc"
            if ".a(" in name
            else "startup"
        )
        share[kind] += int(size, 16)
    return share


def heap_forbidden(build: Path, workdir: Path) -> bool:
    """Whether a Cortex-M program that calls malloc fails to link as the images are linked (and one
    that does not, links): the proof that the images use no heap."""
    workdir.mkdir(parents=True, exist_ok=True)
    asks = workdir / "asks.c"
    asks.write_text("#include <stdlib.h>\nint main(void) { volatile char *p = malloc(16); p[0] = 1; return p[0]; }\n")
    try:
        make(build, "m4-heap", PROGRAM=asks)
        return False
    except RuntimeError as exc:
        if "__wrap_malloc" not in str(exc):
            raise
    make(build, "m4")  # the device itself links under the same rule
    return True


def _sizes(epsf: Path, model: str, codec: str, pull: str, batch: int) -> tuple[int, int]:
    out = subprocess.run(
        [str(epsf), "arena", model.replace("-", ","), str(batch), codec, pull],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    arena, receive = out.split()
    return int(arena), int(receive)


def arena_bytes(epsf: Path, model: str, codec: str = "fp32", batch: int = BATCH) -> int:
    """The arena a device needs for ``model`` (layer sizes "64-64-10"), batches of ``batch`` and
    commits in ``codec``: the same for every pull codec (a snapshot streams into its replica)."""
    return _sizes(epsf, model, codec, "fp32", batch)[0]


def receive_bytes(epsf: Path, model: str, pull: str = "fp32") -> int:
    """The receive buffer a port whose snapshots stream into the arena needs besides: the largest
    delta in ``pull`` or a JSON message (1 KiB)."""
    return _sizes(epsf, model, "fp32", pull, BATCH)[1]


# ---------------------------------------------------------------- QEMU

RUN, INCARNATION, PUSH_EVERY, LR = 5, 4242, 4, 0.2


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
                "/* written by edgeps/embedded.py */",
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
    commits = [
        decode_frame(bytes.fromhex(line.split()[2])) for line in lines if line.startswith("PUB edgeps/emb/grad/mcu-0 ")
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


# ---------------------------------------------------------------- hostile input

CORPUS_INCARNATION, CORPUS_RUN = 4242, 7


def raw_frame(
    kind: int,
    codec: int,
    arg: float,
    base: int,
    seq: int,
    records: list[tuple[str, tuple[int, ...], bytes]],
    device: str = "",
) -> bytes:
    """A tensor frame written field by field (docs/PROTOCOL.md §4), with a valid CRC: one that
    declares what no encoder would write (a tensor of 214 M values in 11 bytes of top-k)."""
    body = struct.pack("<4sBBBBfQQII", b"EPSF", 1, kind, codec, 0, arg, base, seq, 0, 0)
    body += struct.pack("<B", len(device)) + device.encode() + struct.pack("<H", len(records))
    for name, dims, payload in records:
        body += struct.pack("<B", len(name)) + name.encode() + struct.pack(f"<B{len(dims)}I", len(dims), *dims)
        body += struct.pack("<I", len(payload)) + payload
    return body + struct.pack("<I", zlib.crc32(body))


def wrapping_frame() -> bytes:
    """The 105-byte parameter frame of issue 29: an MLP 2748 x 78118 in top-k (one value kept per
    tensor) whose arena, in 32-bit arithmetic, wraps to 7 bytes."""
    topk = struct.pack("<IfB", 1, 1.0, 1) + b"\x00\x01"  # k = 1, scale, gap width 1, gap 0, value 1
    return raw_frame(2, 6, 1e-9, 1, CORPUS_RUN, [("dense0.w", (2748, 78118), topk), ("dense0.b", (78118,), topk)])


def hostile_corpus(incarnation: int = CORPUS_INCARNATION) -> list[tuple[str, bytes, str]]:
    """Messages for device ``d`` of job ``fz`` of that incarnation: a valid Control
    and parameters, then hostile ones, each with the status the SDK must answer (its
    eps_status_name), and last a valid Control again. Every hostile one changes nothing."""
    from learning.model import init_mlp
    from schemas.frame import Frame, FrameKind, encode_frame

    def control(**fields: object) -> str:
        body = {
            "device": "d",
            "run": CORPUS_RUN,
            "incarnation": incarnation,
            "seq_base": 0,
            "max_uncommitted_steps": 8,
            "push_every": 2,
            "lr": 0.1,
            "batch_size": 4,
            "codec": "fp32",
            "pull_codec": "fp32",
            "wait_for_params": True,
            "one_commit_per_version": False,
            "staleness_bound": None,
        } | fields
        return "{" + ",".join(f'"{k}":{_json(v)}' for k, v in body.items()) + "}"

    params = encode_frame(
        Frame(kind=FrameKind.PARAMS, base_version=0, seq=CORPUS_RUN, tensors=init_mlp([8, 4, 3], seed=0))
    )
    bad = "bad message field"
    cases: list[tuple[str, bytes, str]] = [("ctrl", control().encode(), "ok"), ("params", params, "ok")]
    cases += [("params", wrapping_frame(), "buffer too small")]  # refused by its layout, whatever size_t is
    beyond = raw_frame(2, 0, 0.0, 2**63, CORPUS_RUN, [("dense0.w", (8, 4), bytes(128))])
    cases += [("params", beyond, "bad message field")]  # a version no JSON reader holds exactly
    for field, value in [
        ("run", "-nan"),
        ("run", "NaN"),
        ("lr", "1e39"),
        ("lr", "Infinity"),
        ("lr", "-0.1"),
        ("lr", "1e-400"),
        ("lr", '"0.1"'),
        ("push_every", "4294967297"),
        ("push_every", "0"),
        ("push_every", "2.0"),
        ("batch_size", "65537"),
        ("max_uncommitted_steps", "10000001"),
        ("staleness_bound", "-1"),
        ("seq_base", "9007199254740992"),
        ("incarnation", f"{incarnation}.5"),
        ("run", "1e3"),
        ("wait_for_params", "1"),
        ("codec", "7"),
    ]:
        cases.append(("ctrl", control(**{field: _Raw(value)}).encode(), bad))
    for body in [
        '{"run":7,"slowest_clock":-1,"state":"running"}',
        '{"run":7,"slowest_clock":1e308}',
        '{"run":-nan,"state":"finished"}',
        '{"run":7,"state":"finished",}',
    ]:
        cases.append(("barrier", body.encode(), bad))
    cases += [
        ("notice", b'{"device":"d","seq":NaN,"reason":"evicted"}', bad),
        ("notice", b'{"device":"d","seq":1,"reason":"evicted","x":tru}', bad),
    ]
    cases.append(("ctrl", control(lr=0.05).encode(), "ok"))
    return cases


class _Raw(str):
    """A JSON value written as is (a hostile number)."""


def _json(value: object) -> str:
    import json

    return str(value) if isinstance(value, _Raw) else json.dumps(value)


def corpus_header(workdir: Path, mutations: int) -> Path:
    """corpus.h for the image's CORPUS mode: the hostile corpus, and how many mutations to feed."""
    cases = hostile_corpus()
    largest = max(len(payload) for _, payload, _ in cases)
    lines = [
        "/* written by edgeps/embedded.py */",
        f"#define CORPUS_INCARNATION {CORPUS_INCARNATION}u",
        f"#define CORPUS_MUTATIONS {mutations}u",
        f"#define CORPUS_MAX_BYTES {largest}u",
    ]
    for i, (_, payload, _) in enumerate(cases):
        lines.append(_c_array(f"C{i}", payload))
    topics = {
        "ctrl": "edgeps/fz/ctrl/d",
        "params": "edgeps/fz/params",
        "barrier": "edgeps/fz/barrier",
        "notice": "edgeps/fz/notice/d",
    }
    entries = ", ".join(f'{{"{topics[t]}", C{i}, sizeof C{i}}}' for i, (t, _, _) in enumerate(cases))
    lines.append(
        f"static const struct {{ const char *topic; const uint8_t *data; uint32_t len; }} MESSAGES[] = {{{entries}}};"
    )
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "corpus.h").write_text("\n".join(lines) + "\n")
    return workdir


def corpus_on_qemu(workdir: Path, mutations: int = 20000) -> dict[str, Any]:
    """The hostile corpus fed to the Cortex-M4F image under QEMU, then ``mutations`` mutated copies:
    each message's verdict (eps_status_name), what the corpus expects, how many mutations ran."""
    corpus_header(workdir, mutations)
    make(workdir / "build", "m4-corpus", CORPUS_DIR=workdir, ARENA_BYTES=65536)
    lines = run_qemu(workdir / "build" / "m4-corpus.elf")
    verdicts = [line.split(" ", 2)[2] for line in lines if line.startswith("V ")]
    fuzzed = [int(line.split()[1]) for line in lines if line.startswith("FUZZED ")]
    stack = [int(line.split()[1]) for line in lines if line.startswith("STACK ")]
    return {
        "ok": lines[-1:] == ["DONE"],
        "verdicts": verdicts,
        "expected": [c[2] for c in hostile_corpus()],
        "fuzzed": fuzzed[0] if fuzzed else 0,
        "logs": [line for line in lines if line.startswith("LOG ")],
        "stack_peak_bytes": stack[0] if stack else None,
        "tail": lines[-3:],
    }
