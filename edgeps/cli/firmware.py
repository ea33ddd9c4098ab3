"""``edgeps firmware``: a firmware image of the C device SDK that joins a job, built with a
device's configuration written in, and run under QEMU as a board would run it (issue 30)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edgeps.cli.common import Subparsers

BOARDS = ("mps2-an386", "riscv32-virt")  # edgeps.firmware.BOARDS


def cmd_build(args: argparse.Namespace) -> int:
    from edgeps.firmware import build_image
    from learning.data import Dataset

    out = Path(args.out)
    data = Dataset.load(args.data)
    password = Path(args.password_file).read_text().strip() if args.password_file else None
    sizes = [int(n) for n in args.model.split(",")]
    built = build_image(
        out,
        args.board,
        args.job,
        args.device,
        data.x.astype("float32"),
        data.y.astype("float32"),
        sizes,
        args.codec,
        args.pull_codec,
        args.batch,
        seed=args.seed,
        username=args.username,
        password=password,
        broker=args.broker,
    )
    code, flash_data, part = built["flash_bytes"], built["data_flash_bytes"], built["ram_part_bytes"] // 1024
    print(
        f"{out / 'firmware.elf'} (and firmware.bin) for {args.board}: device {args.device} of job {args.job}, "
        f"{len(data)} samples; flash {code:,} bytes of code (+ {flash_data:,} of data), RAM {built['ram_bytes']:,} "
        f"as linked for a {part} KiB part (arena {built['arena_bytes']:,}, MQTT receive buffer "
        f"{built['rx_bytes']:,}, stack {built['stack_bytes']:,})"
    )
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from edgeps.firmware import check_tools, run_image

    out = Path(args.dir)
    built = json.loads((out / "firmware.json").read_text())
    check_tools(built["board"])
    host, _, port = (args.broker or built["broker"]).rpartition(":")
    log = out / "console.log"
    print(f"running {built['device']} ({built['board']}) under QEMU against {host}:{port}; console: {log}")
    tls_ca = Path(args.tls_ca) if args.tls_ca else None
    code = run_image(out, host, int(port), log, tls_ca).wait()
    print(log.read_text().rstrip()[-2000:])
    return code


def add(sub: Subparsers) -> None:
    firmware = sub.add_parser("firmware", help="a firmware image of the C SDK that joins a job, run under QEMU")
    actions = firmware.add_subparsers(dest="action", required=True)
    build = actions.add_parser("build", help="the image of one device: ELF, raw .bin and its size (firmware.json)")
    build.add_argument(
        "--board",
        choices=BOARDS,
        default=BOARDS[0],
        help="mps2-an386: a Cortex-M4F; riscv32-virt: an RV32IMAC without an FPU (default: %(default)s)",
    )
    build.add_argument("--device", required=True, help="its device id")
    build.add_argument("--job", default="demo", help="the job it joins (default: %(default)s)")
    build.add_argument("--data", required=True, help="its shard (.npz of x, y: edgeps data writes them)")
    build.add_argument(
        "--broker",
        default="127.0.0.1:1883",
        help="HOST:PORT the image's UART reaches (its MQTT is "
        "plain: TLS is the modem's, edgeps firmware run --tls-ca; default: %(default)s)",
    )
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
        "--pull-codec",
        default="fp32",
        help="the job's pull codec, which sizes the MQTT receive buffer (default: %(default)s)",
    )
    build.add_argument("--out", required=True, help="folder for firmware.elf, firmware.bin and firmware.json")
    build.set_defaults(func=cmd_build)
    run = actions.add_parser("run", help="run a built image under QEMU, its UART joined to the broker")
    run.add_argument("dir", help="the folder edgeps firmware build wrote")
    run.add_argument("--broker", help="HOST:PORT (default: the one it was built for)")
    run.add_argument(
        "--tls-ca",
        help="reach the broker over TLS, as a modem with TLS in transparent mode does (the "
        "image speaks plain MQTT on its UART): the CA that signed the broker's certificate (broker "
        "init: CREDENTIALS/ca.crt)",
    )
    run.set_defaults(func=cmd_run)
