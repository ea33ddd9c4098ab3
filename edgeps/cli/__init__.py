"""The ``edgeps`` command: one module per role (ps, aggregator, client, broker, ctl, data, demo, bench, report,
predict, firmware), each adding its subcommand; ``main`` layers a role's TOML file and environment under its flags."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time

from edgeps import __version__
from edgeps.cli import aggregator, bench_args, broker, client, ctl, data, demo, firmware, predict, ps, report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgeps", description="MQTT parameter-server training for edge devices")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs, and tracebacks with errors")
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default=os.environ.get("EDGEPS_LOG_LEVEL", "info"),
        help="least severe log records shown (also EDGEPS_LOG_LEVEL; -v: debug)",
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=os.environ.get("EDGEPS_LOG_FORMAT", "text"),
        help="json: one JSON object a line, for Loki or ELK (also EDGEPS_LOG_FORMAT; the demo's processes inherit it)",
    )
    parser.add_argument("--version", action="version", version=f"edgeps {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for role in (demo, ps, aggregator, client, broker, ctl):
        role.add(sub)
    for name in LAYERED:
        _roles(parser)[name].add_argument("--config", help="a TOML file of this role's options (docs: edgeps config)")
    config = sub.add_parser("config", help="show a role's effective configuration (file, environment, flags)")
    config.add_argument("what", choices=["show"])
    config.add_argument("role", help=f"one of {', '.join(LAYERED)}")
    config.add_argument("rest", nargs=argparse.REMAINDER, help="--config FILE and flags, as the role takes them")
    config.set_defaults(func=cmd_config)
    bench_args.add(sub)
    data.add(sub)
    firmware.add(sub)
    predict.add(sub)
    report.add(sub)
    _show_defaults(parser)
    return parser


NO_DEFAULT: tuple[object, ...] = (None, False, [], "", argparse.SUPPRESS)
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (ISO 8601, UTC), level, logger, message, and the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's help names its default (as argparse's ArgumentDefaultsHelpFormatter would, but
    once, and not for switches or options without one)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_defaults(sub)
        elif (
            action.help and "default" not in action.help and action.default not in (None, False, [], "", "==SUPPRESS==")
        ):
            action.help += " (default: %(default)s)"


LAYERED = ("demo", "ps", "aggregator", "client", "ctl", "broker")  # roles that read --config and EDGEPS_* variables


def _roles(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def cmd_config(args: argparse.Namespace) -> int:
    from edgeps.settings import show

    role = _roles(build_parser()).get(args.role)
    if args.role not in LAYERED or role is None:
        raise ValueError(f"config show takes one of {', '.join(LAYERED)}")
    config = None
    rest = list(args.rest)
    if "--config" in rest:
        config = rest[rest.index("--config") + 1]
    print(show(role, rest, config))
    return 0


#: Environment variables by which a user sets the BLAS threads themselves (one_blas_thread leaves them be).
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def one_blas_thread() -> None:
    """One BLAS thread per edgeps process, unless the environment sets a count. A job's matrices are
    small (a batch of 32, a held-out set of hundreds) and its processes (server, broker, devices)
    share the cores: OpenBLAS's threads then spin for work, and the server's evaluation took 7x the
    CPU (0.5 ms against 0.07 ms a version) and its share of a version 7 ms against 4
    (docs/PERFORMANCE.md)."""
    if any(name in os.environ for name in BLAS_THREAD_VARIABLES):
        return
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")


def main(argv: list[str] | None = None) -> int:
    from edgeps.settings import apply

    one_blas_thread()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in LAYERED:  # the role's file and environment go under its flags
        try:
            apply(_roles(parser)[args.command], argv[argv.index(args.command) + 1 :], args.config)
        except (ValueError, OSError) as exc:
            parser.error(str(exc))
        args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if args.log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=logging.DEBUG if args.verbose else args.log_level.upper(), handlers=[handler])
    if args.log_format == "json":  # children (the demo's) log the same way
        os.environ["EDGEPS_LOG_FORMAT"] = "json"
    started = time.monotonic()
    log = logging.getLogger("edgeps")
    try:
        code: int = args.func(args)
        return code
    except KeyboardInterrupt:
        log.error("interrupted (after %.1f s)", time.monotonic() - started)
        return 130
    # A user's error (a bad option or file, a broker not there): one line, the traceback only with -v.
    except (ValueError, OSError, OverflowError, RuntimeError) as exc:  # CodecError, CheckpointError, TaskError too
        log.error("%s (after %.1f s)", _one_line(exc), time.monotonic() - started, exc_info=args.verbose)
        return 2
    except Exception as exc:  # not a user's error: still one line, the traceback with -v
        log.error(
            "unexpected %s: %s (a bug; -v shows where)", type(exc).__name__, _one_line(exc), exc_info=args.verbose
        )
        return 1


def _one_line(exc: BaseException) -> str:
    """What went wrong, in one line (a pydantic error names the option and its value)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        from edge_client.config import DeviceConfig
        from edgeps.localjob import DemoSettings
        from edgeps.options import validation_line
        from learning.spec import ModelSpec
        from ps_service.config import ServerConfig

        return validation_line(exc, (ServerConfig, ModelSpec, DeviceConfig, DemoSettings))
    text = str(exc).strip() or type(exc).__name__
    return " ".join(line.strip() for line in text.splitlines())
