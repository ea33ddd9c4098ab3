"""``edgeps data``: a held-out set and non-IID device shards."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_data(args: argparse.Namespace) -> int:
    from learning.data import load_digits, load_idx
    from learning.prepare import prepare_shards

    data = load_idx(args.idx_images, args.idx_labels) if args.idx_images else load_digits()
    paths = prepare_shards(data, Path(args.out), args.devices, args.alpha, args.seed)
    print(f"wrote {paths.holdout} and {len(paths.devices)} device shards under {args.out}")
    if args.format == "frame":  # what the C device (edgeps-device) reads, beside each .npz
        from learning.data import Dataset
        from schemas.frame import encode_data_frame

        for shard in paths.devices:
            data = Dataset.load(shard)
            shard.with_suffix(".epsf").write_bytes(encode_data_frame(data.x, data.y))
        print("and a data frame (.epsf) beside each device shard, for edgeps-device")
    return 0


def add(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The role's subcommand, its options and its function."""
    data = sub.add_parser("data", help="write a held-out set and non-IID device shards")
    data.add_argument("--out", required=True)
    data.add_argument("--devices", type=int, default=8)
    data.add_argument("--alpha", type=float, default=0.5)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--idx-images", help="MNIST-format images file (default dataset: digits)")
    data.add_argument("--idx-labels", help="MNIST-format labels file")
    data.add_argument("--format", choices=["npz", "frame"], default="npz",
                      help="frame: also a .epsf data frame per device, for the C device (edgeps-device)")  # fmt: skip
    data.set_defaults(func=cmd_data)
