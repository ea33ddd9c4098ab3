"""``edgeps ctl``: an operator's command to a job and its reply, or the job's metrics as they come."""

from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from edgeps.cli.common import Subparsers, address, broker_args, stop_on_signals, writable


def cmd_ctl(args: argparse.Namespace) -> int:
    """Operator commands on the job's command topic, and a live view of its metrics (edgeps.operator)."""
    from edgeps.operator import request, watch

    if args.action == "watch":
        for m in watch(address(args), args.job, stop_on_signals()):
            push = sorted(set(m.push_every.values()))
            print(
                f"v{m.version:>6}  {m.metric} {m.value or 0.0:.4f}  loss {m.loss:.4f}  commits {m.commits:>7}  "
                f"applied {m.applied:>7}  rejected {sum(m.rejected.values()):>5}  online {m.devices_online:>4}  "
                f"push_every {push}  {m.elapsed_s:8.1f} s",
                flush=True,
            )
        return 0
    fields: dict[str, Any] = {"cmd": args.action.replace("-", "_"), "reason": args.reason}
    if args.action in ("set-codec", "set-pace", "evict"):
        if not args.value:
            raise ValueError(f"{args.action} needs a value: edgeps ctl {args.action} VALUE")
        fields[{"set-codec": "codec", "set-pace": "pace", "evict": "device"}[args.action]] = args.value
        if args.action == "set-pace":  # checked here, not left to time out at a server that refuses it
            from ps_service.paces import make_pace

            try:
                make_pace(args.value)
            except ValueError as exc:
                raise ValueError(f"set-pace {args.value!r}: {exc}") from None
    if args.action == "set-frequency":
        fields |= {"policy": args.policy, "low": args.low, "high": args.high}
    if args.action == "model":
        fields["which"] = args.which
        out = Path(args.out or f"model-{args.which}.npz")
        writable(str(out), "--out")
    try:
        reply = request(address(args), args.job, fields, args.timeout)
    except TimeoutError as exc:
        raise ConnectionError(str(exc)) from None
    except ValidationError as exc:  # the value of the action, not an option: say it that way
        message = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
        raise ValueError(f"{args.action}{'' if args.value is None else f' {args.value!r}'}: {message}") from None
    if reply.status is not None:
        print(json.dumps(reply.status, indent=2))
    elif reply.ok and reply.model is not None:
        out.write_bytes(base64.b64decode(reply.model))
        print(f"ok: {reply.detail}, saved to {out}")
    else:
        print(f"{'ok' if reply.ok else 'refused'}: {reply.cmd}: {reply.detail}")
    return 0 if reply.ok else 1


def add(sub: Subparsers) -> None:
    """The role's subcommand, its options and its function."""
    ctl = sub.add_parser("ctl", help="operator: send a command to a job, or watch its metrics")
    broker_args(ctl)
    ctl.add_argument(
        "action",
        choices=[
            "status",
            "pause",
            "resume",
            "stop",
            "set-pace",
            "set-codec",
            "set-frequency",
            "freeze-frequency",
            "unfreeze-frequency",
            "evict",
            "model",
            "watch",
        ],
    )
    ctl.add_argument(
        "value", nargs="?", help="set-codec: the codec (sign); set-pace: the pace (acbsp); evict: the device"
    )
    ctl.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server's reply")
    ctl.add_argument("--job", default="demo", help="the job's name")
    ctl.add_argument("--policy", help="set-frequency: fixed, adacomm or trend")
    ctl.add_argument("--low", type=int, help="set-frequency: lowest push_every")
    ctl.add_argument("--high", type=int, help="set-frequency: highest push_every")
    ctl.add_argument(
        "--which",
        choices=["last", "best"],
        default="last",
        help="model: the last version, or the best by the job's metric",
    )
    ctl.add_argument("--out", help="model: where to write the .npz (default: model-WHICH.npz)")
    ctl.add_argument("--reason", default="", help="recorded in the server's log")
    ctl.set_defaults(func=cmd_ctl)
