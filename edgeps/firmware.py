"""Firmware images of the C device SDK that join a job (issue 30, in progress): ports/cortex-m/
main.c in its NETWORK mode, with a device's job, id, credentials, seed and data written in at
build time, for a board of ``BOARDS`` (a Cortex-M4F, mps2-an386; an RV32IMAC without an FPU,
QEMU's riscv32 virt), run under QEMU with its UART joined to the broker's TCP port, as a
gateway's modem in transparent mode would be."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np

from edgeps.embedded import _c_array, make

#: board -> (make target, QEMU and its machine flags, the status's backend name)
BOARDS = {
    "mps2-an386": ("m4-net", ["qemu-system-arm", "-M", "mps2-an386"], "firmware-m4"),
    "riscv32-virt": ("rv32-net", ["qemu-system-riscv32", "-M", "virt", "-bios", "none"], "firmware-rv32"),
}
#: board -> the tools building and running its image need, and their Debian packages (the host's
#: make and cc build the arena's sizer, epsf)
TOOLS = {
    "mps2-an386": {"make": "make", "cc": "gcc", "arm-none-eabi-gcc": "gcc-arm-none-eabi libnewlib-arm-none-eabi",
                   "qemu-system-arm": "qemu-system-arm"},
    "riscv32-virt": {"make": "make", "cc": "gcc", "riscv64-unknown-elf-gcc": "gcc-riscv64-unknown-elf "
                     "picolibc-riscv64-unknown-elf", "qemu-system-riscv32": "qemu-system-misc"},
}  # fmt: skip


def check_tools(board: str) -> None:
    """ValueError in one line naming what to install if this machine cannot build or run ``board``'s image."""
    missing = {tool: package for tool, package in TOOLS[board].items() if shutil.which(tool) is None}
    if missing:
        raise ValueError(f"firmware for {board} needs {', '.join(missing)} "
                         f"(apt-get install {' '.join(missing.values())})")  # fmt: skip


RX_BYTES = 24 * 1024  # one inbound message: the demo model's fp32 parameter frame is 19.5 KB
STACK_BYTES = 3072  # the networked image's stack: its peak was 1,744 bytes in a job (the MQTT client's frames on top)


def _c_string(text: str | None) -> str:
    if text is None:
        return "NULL"
    if any(c in text for c in '"\\\n') or not text.isascii():
        raise ValueError(f"{text!r}: the firmware takes plain ASCII without quotes or backslashes")
    return f'"{text}"'


def build_firmware(
    out: Path, job: str, device: str, x: np.ndarray, y: np.ndarray, arena_bytes: int, seed: int = 0,
    username: str | None = None, password: str | None = None, rx_bytes: int = RX_BYTES, keep_alive_s: int = 20,
    board: str = "mps2-an386",
) -> Path:  # fmt: skip
    """The image of ``device`` of ``job`` for ``board``, its data (x, y) in flash; the ELF's path."""
    from schemas.frame import encode_data_frame

    out.mkdir(parents=True, exist_ok=True)
    (out / "device.h").write_text("\n".join([
        "/* written by edgeps/firmware.py: one device's configuration */",
        f"#define DEVICE_JOB {_c_string(job)}",
        f"#define DEVICE_ID {_c_string(device)}",
        f"#define DEVICE_CLIENT_ID {_c_string(f'edgeps-dev-{job}-{device}')}",
        f"#define DEVICE_USERNAME {_c_string(username)}",
        f"#define DEVICE_PASSWORD {_c_string(password)}",
        f"#define DEVICE_SEED {int(seed)}u",
        f"#define DATA_SAMPLES {len(y)}u",
        f"#define DATA_FEATURES {x.shape[1]}u",
        f"#define RX_BYTES {int(rx_bytes)}u",
        f"#define DEVICE_KEEP_ALIVE_S {int(keep_alive_s)}",
        _c_array("DATA", encode_data_frame(x, y)),
    ]))  # fmt: skip
    target = BOARDS[board][0]
    make(out / "build", target, NET_DIR=out, ARENA_BYTES=arena_bytes, STACK_BYTES=STACK_BYTES)
    return out / "build" / f"{target}.elf"


def run_firmware(elf: Path, host: str, port: int, log: Path, board: str = "mps2-an386") -> subprocess.Popen[bytes]:
    """The image under QEMU, its UART a TCP connection to the broker at host:port (connected again
    a second after it breaks, as a modem redials); its console (semihosting) into ``log``."""
    command = [*BOARDS[board][1], "-display", "none", "-monitor", "none", "-semihosting",
               "-chardev", f"socket,id=link,host={host},port={port},reconnect=1", "-serial", "chardev:link",
               "-kernel", str(elf)]  # fmt: skip
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
