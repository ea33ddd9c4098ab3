"""Firmware images of the C device SDK that join a job: ports/cortex-m/main.c in its NETWORK
mode, with a device's job, id, credentials, seed and data written in at build time, for a board
of ``BOARDS`` (a Cortex-M4F, mps2-an386; an RV32IMAC without an FPU, QEMU's riscv32 virt), run
under QEMU with its UART joined to the broker's TCP port, as a gateway's modem in transparent
mode would be. ``build_image`` is the one recipe (``edgeps firmware build``, the demo's
``--firmware-devices`` and ``edgeps bench embedded`` use it)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from edgeps.sdk.build import arena_bytes, image_size, make, receive_bytes
from edgeps.sdk.qemu import _c_array

#: board -> (make target, QEMU and its machine flags, the status's backend name)
BOARDS = {
    "mps2-an386": ("m4-net", ["qemu-system-arm", "-M", "mps2-an386"], "firmware-m4"),
    "riscv32-virt": ("rv32-net", ["qemu-system-riscv32", "-M", "virt", "-bios", "none"], "firmware-rv32"),
}
#: board -> the tools building and running its image need, and their Debian packages (the host's
#: make and cc build the arena's sizer, epsf)
TOOLS = {
    "mps2-an386": {
        "make": "make",
        "cc": "gcc",
        "arm-none-eabi-gcc": "gcc-arm-none-eabi libnewlib-arm-none-eabi",
        "qemu-system-arm": "qemu-system-arm",
    },
    "riscv32-virt": {
        "make": "make",
        "cc": "gcc",
        "riscv64-unknown-elf-gcc": "gcc-riscv64-unknown-elf picolibc-riscv64-unknown-elf",
        "qemu-system-riscv32": "qemu-system-misc",
    },
}


def check_tools(board: str) -> None:
    """ValueError in one line naming what to install if this machine cannot build or run ``board``'s image."""
    missing = {tool: package for tool, package in TOOLS[board].items() if shutil.which(tool) is None}
    if missing:
        raise ValueError(
            f"firmware for {board} needs {', '.join(missing)} (apt-get install {' '.join(missing.values())})"
        )


STACK_BYTES = 3072  # the networked image's stack: its peak was 1,744 bytes in a job (the MQTT client's frames on top)
#: the part's RAM an image is linked for (what does not fit is a link error): 128 KiB, or 160 KiB
#: when the commit codec is biased (its residual for error feedback is one more copy of the model)
RAM_PART_BYTES, RAM_PART_BIASED_BYTES = 128 * 1024, 160 * 1024


def _c_string(text: str | None) -> str:
    if text is None:
        return "NULL"
    if any(c in text for c in '"\\\n') or not text.isascii():
        raise ValueError(f"{text!r}: the firmware takes plain ASCII without quotes or backslashes")
    return f'"{text}"'


def ram_part_bytes(codec: str) -> int:
    """The RAM of the part an image committing in ``codec`` is linked for."""
    from schemas.codecs import make_codec

    return RAM_PART_BIASED_BYTES if make_codec(codec).biased else RAM_PART_BYTES


def build_image(
    out: Path,
    board: str,
    job: str,
    device: str,
    x: np.ndarray,
    y: np.ndarray,
    sizes: list[int],
    codec: str = "fp32",
    pull_codec: str = "fp32",
    batch: int = 32,
    seed: int = 0,
    username: str | None = None,
    password: str | None = None,
    broker: str = "127.0.0.1:1883",
    keep_alive_s: int = 20,
) -> dict[str, Any]:
    """``device``'s image for ``board`` in ``out``: firmware.elf, firmware.bin and firmware.json (its
    report, returned: flash as code without the device's data, RAM as linked, the arena for the
    model of layer ``sizes``, commits in ``codec`` and batches of ``batch``, the MQTT receive
    buffer for deltas in ``pull_codec``, the stack). ValueError in one line when this machine
    lacks a tool; RuntimeError with the linker's words when the image does not fit its part."""
    check_tools(board)
    make(out / "host", "all")  # epsf sizes the arena (make rebuilds nothing that is built)
    model = "-".join(map(str, sizes))
    arena = arena_bytes(out / "host" / "epsf", model, codec, batch)
    receive = receive_bytes(out / "host" / "epsf", model, pull_codec)
    ram_part = ram_part_bytes(codec)
    elf = build_firmware(
        out / "src",
        job,
        device,
        x,
        y,
        arena,
        seed=seed,
        username=username,
        password=password,
        rx_bytes=receive,
        keep_alive_s=keep_alive_s,
        board=board,
        ram_bytes=ram_part,
    )
    shutil.copy(elf, out / "firmware.elf")
    shutil.copy(f"{elf}.map", out / "firmware.elf.map")
    objcopy = "arm-none-eabi-objcopy" if board == "mps2-an386" else "riscv64-unknown-elf-objcopy"
    subprocess.run([objcopy, "-O", "binary", str(elf), str(out / "firmware.bin")], check=True)
    from schemas.frame import encode_data_frame

    size = image_size(elf)
    code = size["flash_bytes"] - len(encode_data_frame(x, y))  # the data frame is a constant array of main.c
    report = {
        "board": board,
        "job": job,
        "device": device,
        "broker": broker,
        "model": model,
        "codec": codec,
        "pull_codec": pull_codec,
        "flash_bytes": code,
        "data_flash_bytes": size["flash_bytes"] - code,
        "sdk_bytes": size["sdk_bytes"],
        "ram_bytes": size["ram_bytes"],
        "ram_part_bytes": ram_part,
        "arena_bytes": arena,
        "rx_bytes": receive,
        "stack_bytes": STACK_BYTES,
        "samples": len(y),
    }
    (out / "firmware.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def build_firmware(
    out: Path,
    job: str,
    device: str,
    x: np.ndarray,
    y: np.ndarray,
    arena_bytes: int,
    seed: int = 0,
    username: str | None = None,
    password: str | None = None,
    rx_bytes: int = 1024,
    keep_alive_s: int = 20,
    board: str = "mps2-an386",
    ram_bytes: int = RAM_PART_BYTES,
) -> Path:
    """The image of ``device`` of ``job`` for ``board``, its data (x, y) in flash, linked for a part
    of ``ram_bytes``; the ELF's path."""
    from schemas.frame import encode_data_frame

    out.mkdir(parents=True, exist_ok=True)
    (out / "device.h").write_text(
        "\n".join(
            [
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
            ]
        )
    )
    target = BOARDS[board][0]
    make(out / "build", target, NET_DIR=out, ARENA_BYTES=arena_bytes, STACK_BYTES=STACK_BYTES, RAM_BYTES=ram_bytes)
    return out / "build" / f"{target}.elf"


def run_firmware(elf: Path, host: str, port: int, log: Path, board: str = "mps2-an386") -> subprocess.Popen[bytes]:
    """The image under QEMU, its UART a TCP connection to the broker at host:port (connected again
    a second after it breaks, as a modem redials); its console (semihosting) into ``log``."""
    command = [
        *BOARDS[board][1],
        "-display",
        "none",
        "-monitor",
        "none",
        "-semihosting",
        "-chardev",
        f"socket,id=link,host={host},port={port},reconnect=1",
        "-serial",
        "chardev:link",
        "-kernel",
        str(elf),
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)


def splice(a: socket.socket, b: socket.socket) -> None:
    """Copy each socket's bytes to the other on two daemon threads; when either side ends or
    fails, both are closed (a cut of either is a cut of the link)."""
    import contextlib
    import threading

    def pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.close()

    for source, sink in ((a, b), (b, a)):
        threading.Thread(target=pipe, args=(source, sink), daemon=True).start()


class TlsModem:
    """What a cellular or Wi-Fi modem with TLS in transparent mode (SIMCom's and Quectel's SSL
    modes, an ESP-AT module's) does for the image: the plain MQTT bytes of its UART go to the
    broker over TLS, the broker's certificate checked against ``ca`` and its name against ``host``.
    A loopback port for QEMU's UART socket; a TLS connection to the broker for each of its
    connections, both closed together (a cut of either is a cut of the link)."""

    def __init__(self, host: str, port: int, ca: Path) -> None:
        import ssl
        import threading

        self.target = (host, port)
        self.context = ssl.create_default_context(cafile=str(ca))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:

        while True:
            try:
                uart, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                plain = socket.create_connection(self.target, timeout=10)
                broker = self.context.wrap_socket(plain, server_hostname=self.target[0])
                broker.settimeout(None)
            except OSError as exc:  # no broker, or a certificate that does not check: the modem hangs up
                print(f"modem: cannot reach {self.target[0]}:{self.target[1]} over TLS: {exc}", flush=True)
                uart.close()
                continue
            for s in (uart, broker):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            splice(uart, broker)

    def close(self) -> None:
        self.listener.close()


def run_image(folder: Path, host: str, port: int, log: Path, tls_ca: Path | None = None) -> subprocess.Popen[bytes]:
    """The image ``build_image`` wrote into ``folder``, under its board's QEMU, against host:port;
    with ``tls_ca``, through a ``TlsModem`` (which lives as long as this process)."""
    board = json.loads((folder / "firmware.json").read_text())["board"]
    if tls_ca is not None:
        host, port = "127.0.0.1", TlsModem(host, port, tls_ca).port
    return run_firmware(folder / "firmware.elf", host, port, log, board=board)
