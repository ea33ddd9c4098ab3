"""``edgeps data``: a held-out set and non-IID device shards."""

from __future__ import annotations

import argparse
from pathlib import Path

from edgeps.cli.common import Subparsers


def cmd_data(args: argparse.Namespace) -> int:
    from learning.data import load_digits, load_idx
    from learning.prepare import prepare_device_shards, prepare_shards

    out = Path(args.out)
    if args.task:
        from edgeps.task import load_task

        task = load_task(args.task)
        data, devices = task.dataset()
        print(f"read {len(data)} rows from {args.task}'s data(): {data.x.shape[1]} features")
        if devices is not None:  # split by the gateway each row came from
            paths = prepare_device_shards(data, devices, out, args.seed)
        else:
            paths = prepare_shards(data, out, args.devices, args.alpha, args.seed)
    elif args.csv:
        from learning.csvdata import load_csv

        if not args.label:
            raise ValueError("--csv needs --label, the column holding each row's class")
        features = args.features.split(",") if args.features else None
        table = load_csv(args.csv, args.label, features, args.device_column, args.classes)
        data = table.data
        print(f"read {len(data)} rows of {args.csv}: {data.x.shape[1]} features, {len(table.classes)} classes")
        out.mkdir(parents=True, exist_ok=True)
        table.save_meta(out / "columns.json")
        if table.devices is not None:  # split by the gateway each row came from
            paths = prepare_device_shards(data, table.devices, out, args.seed)
        else:
            paths = prepare_shards(data, out, args.devices, args.alpha, args.seed)
    else:
        if args.npz:
            from learning.data import load_npz

            data = load_npz(args.npz)
        else:
            data = load_idx(args.idx_images, args.idx_labels) if args.idx_images else load_digits()
        paths = prepare_shards(data, out, args.devices, args.alpha, args.seed)
    print(f"wrote {paths.holdout} and {len(paths.devices)} device shards under {args.out}")
    if args.format == "frame":  # what the C device (edgeps-device) reads, beside each .npz
        from learning.data import Dataset
        from schemas.frame import encode_data_frame

        for shard in paths.devices:
            data = Dataset.load(shard)
            shard.with_suffix(".epsf").write_bytes(encode_data_frame(data.x, data.y))
        print("and a data frame (.epsf) beside each device shard, for edgeps-device")
    return 0


def add(sub: Subparsers) -> None:
    """The role's subcommand, its options and its function."""
    data = sub.add_parser("data", help="write a held-out set and non-IID device shards")
    data.add_argument("--out", required=True, help="folder for holdout.npz and the device shards")
    data.add_argument("--devices", type=int, default=8, help="device shards to write (default: %(default)s)")
    data.add_argument(
        "--alpha", type=float, default=0.5, help="Dirichlet non-IID concentration of the shards (default: %(default)s)"
    )
    data.add_argument("--seed", type=int, default=0, help="seed of the split (default: %(default)s)")
    data.add_argument("--task", help="a task file: split its data() (docs/TASKS.md)")
    data.add_argument("--idx-images", help="MNIST-format images file (default dataset: digits)")
    data.add_argument("--idx-labels", help="MNIST-format labels file")
    data.add_argument("--npz", help="an .npz with x (n, features) and y (n,) class numbers from 0")
    data.add_argument("--csv", help="a CSV file with a header line: one row per sample")
    data.add_argument("--label", help="--csv: the column of each row's class (integers from 0, or names)")
    data.add_argument("--features", help="--csv: comma-separated feature columns (default: all others)")
    data.add_argument(
        "--device-column",
        help="--csv: the column naming each row's device: one shard per device instead of a Dirichlet split",
    )
    data.add_argument("--classes", type=int, help="--csv: the number of classes (labels must be below it)")
    data.add_argument(
        "--format",
        choices=["npz", "frame"],
        default="npz",
        help="frame: also a .epsf data frame per device, for the C device (edgeps-device)",
    )
    data.set_defaults(func=cmd_data)
