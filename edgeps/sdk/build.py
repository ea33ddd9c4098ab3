"""The C SDK built and sized from Python: make with its Makefile, an image's size from its link map
(the SDK's own code, libc/libm, the start-up), whether a link forbids the heap, a model's arena."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


RUN, INCARNATION, PUSH_EVERY, LR = 5, 4242, 4, 0.2
