"""``edgeps predict``: a saved model (``--save-model``, the demo's) on new readings."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys

from edgeps.cli.common import Subparsers


def cmd_predict(args: argparse.Namespace) -> int:
    from edgeps.deploy import load_model
    from learning.data import load_npz

    model = load_model(args.model, args.route)
    if args.csv:
        x, y = model.read_csv(args.csv)
        source = args.csv
    else:
        data = load_npz(args.data, model.card.classification)  # rows scaled as edgeps data writes them
        target = model.card.target  # and a regression's targets standardised
        x, y, source = data.x, data.y if target is None else target.invert(data.y), args.data
        model.card = dataclasses.replace(model.card, scaling=None)
    predicted = model.predict(x)
    names = model.card.classes
    out = open(args.out, "w", newline="") if args.out else sys.stdout  # noqa: SIM115  (stdout is not ours to close)
    try:
        writer = csv.writer(out)
        writer.writerow(["prediction"])
        for value in predicted:
            writer.writerow([names[int(value)] if names and model.card.classification else value])
    finally:
        if args.out:
            out.close()
    if y is not None:
        values = model.evaluate(x, y)
        shown = ", ".join(f"{name} {value:.4f}" for name, value in values.items())
        where = f"{len(predicted)} rows of {source}, model version {model.card.version} ({args.route})"
        print(f"{where}: {shown}", file=sys.stderr)
    return 0


def add(sub: Subparsers) -> None:
    """The role's subcommand, its options and its function."""
    predict = sub.add_parser("predict", help="predict with a saved model: one row per reading, and its metrics")
    predict.add_argument("--model", required=True, help="model.npz (or model-best.npz), or the folder holding it")
    given = predict.add_mutually_exclusive_group(required=True)
    given.add_argument("--csv", help="raw readings with a header (columns by name, scaled as in training)")
    given.add_argument("--data", help="an .npz of scaled rows (x, y), as edgeps data writes them")
    route = "what runs the model: its tensors in numpy, the .keras model, or the .tflite one"
    predict.add_argument("--route", choices=["numpy", "keras", "tflite"], default="numpy", help=route)
    predict.add_argument("--out", help="write the predictions here as CSV (default: standard output)")
    predict.set_defaults(func=cmd_predict)
