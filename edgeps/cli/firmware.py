"""``edgeps firmware``: a firmware image of the C device SDK that joins a job, built with a
device's configuration written in, and run under QEMU as a board would run it (issue 30)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

BOARDS = ("mps2-an386", "riscv32-virt")  # edgeps.firmware.BOARDS


def cmd_build(args: argparse.Namespace) -> int:
    from edgeps.embedded import arena_bytes, image_size, make
    from edgeps.firmware import RX_BYTES, STACK_BYTES, build_firmware, check_tools
    from learning.data import Dataset

    check_tools(args.board)
    out = Path(args.out)
    data = Dataset.load(args.data)
    password = Path(args.password_file).read_text().strip() if args.password_file else None
    make(out / "host", "all")
    arena = arena_bytes(out / "host" / "epsf", args.model.replace(",", "-"), args.codec, args.pull_codec, args.batch)
    elf = build_firmware(out / "src", args.job, args.device, data.x.astype("float32"), data.y.astype("float32"), arena,
                         seed=args.seed, username=args.username, password=password, board=args.board)  # fmt: skip
    shutil.copy(elf, out / "firmware.elf")
    objcopy = "arm-none-eabi-objcopy" if args.board == "mps2-an386" else "riscv64-unknown-elf-objcopy"
    subprocess.run([objcopy, "-O", "binary", str(elf), str(out / "firmware.bin")], check=True)
    size = image_size(elf)
    report = {"board": args.board, "job": args.job, "device": args.device, "broker": args.broker,
              "flash_bytes": size["flash_bytes"], "ram_bytes": size["ram_bytes"], "arena_bytes": arena,
              "rx_bytes": RX_BYTES, "stack_bytes": STACK_BYTES, "samples": len(data)}  # fmt: skip
    (out / "firmware.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{out / 'firmware.elf'} (and firmware.bin) for {args.board}: device {args.device} of job {args.job}, "
          f"{len(data)} samples; flash {size['flash_bytes']:,} bytes, RAM {size['ram_bytes']:,} as linked (arena "
          f"{arena:,}, MQTT receive buffer {RX_BYTES:,}, stack {STACK_BYTES:,})")  # fmt: skip
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from edgeps.firmware import check_tools, run_firmware

    out = Path(args.dir)
    built = json.loads((out / "firmware.json").read_text())
    check_tools(built["board"])
    host, _, port = (args.broker or built["broker"]).rpartition(":")
    log = out / "console.log"
    print(f"running {built['device']} ({built['board']}) under QEMU against {host}:{port}; console: {log}")
    qemu = run_firmware(out / "firmware.elf", host, int(port), log, board=built["board"])
    code = qemu.wait()
    print(log.read_text().rstrip()[-2000:])
    return code


def add(sub: argparse._SubParsersAction) -> None:
    firmware = sub.add_parser("firmware", help="a firmware image of the C SDK that joins a job, run under QEMU")
    actions = firmware.add_subparsers(dest="action", required=True)
    build = actions.add_parser("build", help="the image of one device: ELF, raw .bin and its size (firmware.json)")
    build.add_argument("--board", choices=BOARDS, default=BOARDS[0], help="mps2-an386: a Cortex-M4F; riscv32-virt: "
                       "an RV32IMAC without an FPU (default: %(default)s)")  # fmt: skip
    build.add_argument("--device", required=True, help="its device id")
    build.add_argument("--job", default="demo", help="the job it joins (default: %(default)s)")
    build.add_argument("--data", required=True, help="its shard (.npz of x, y: edgeps data writes them)")
    build.add_argument("--broker", default="127.0.0.1:1883", help="HOST:PORT the image's UART reaches (plain MQTT: "
                       "the firmware has no TLS stack yet; default: %(default)s)")  # fmt: skip
    build.add_argument("--username", help="its broker account (broker init: the device id)")
    build.add_argument("--password-file", help="its password (broker init: CREDENTIALS/DEVICE.password)")
    build.add_argument("--seed", type=int, default=0, help="its batches' and incarnation's seed (default: %(default)s)")
    build.add_argument(
        "--model",
        default="64,64,10",
        help="layer sizes the arena is laid out for: the job's model (default: %(default)s)",
    )
    build.add_argument("--batch", type=int, default=32, help="the largest batch the arena holds (default: %(default)s)")
    build.add_argument(
        "--codec", default="fp32", help="the job's commit codec, which sizes the arena (default: %(default)s)"
    )
    build.add_argument(
        "--pull-codec", default="fp32", help="the job's pull codec, which sizes the arena (default: %(default)s)"
    )
    build.add_argument("--out", required=True, help="folder for firmware.elf, firmware.bin and firmware.json")
    build.set_defaults(func=cmd_build)
    run = actions.add_parser("run", help="run a built image under QEMU, its UART joined to the broker")
    run.add_argument("dir", help="the folder edgeps firmware build wrote")
    run.add_argument("--broker", help="HOST:PORT (default: the one it was built for)")
    run.set_defaults(func=cmd_run)
