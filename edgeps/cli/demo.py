"""``edgeps demo``: a broker, the server and N devices on loopback, and the report."""

from __future__ import annotations

import argparse
import signal

from edgeps.cli.common import Subparsers, job_args
from ps_service.config import PROCESS_DEFAULTS


def cmd_demo(args: argparse.Namespace) -> int:
    from edgeps.demo import run_demo
    from edgeps.localjob import DemoSettings
    from edgeps.options import model_values
    from learning.spec import ModelSpec
    from ps_service.config import ServerConfig

    server = ServerConfig(**model_values(ServerConfig, args))
    model = ModelSpec(**model_values(ModelSpec, args))
    settings = DemoSettings(server=server, model=model, **model_values(DemoSettings, args, skip=DEMO_API_ONLY))

    def terminated(signum: int, frame: object) -> None:  # as Ctrl-C: every process the demo started is stopped
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminated)
    report = run_demo(settings, json_path=args.json)
    return 0 if report["rounds"] > 0 else 1


#: DemoSettings fields that are not flags of ``edgeps demo`` (the job and model have their own; the
#: rest are for benches that emulate device classes).


#: DemoSettings fields that are not flags of ``edgeps demo`` (the job and model have their own; the
#: rest are for benches that emulate device classes).
DEMO_API_ONLY = ("server", "model", "timeout_s", "slowdowns", "step_time")


def add(sub: Subparsers) -> None:
    """The role's subcommand, its options and its function."""
    demo = sub.add_parser("demo", help="broker + server + N devices on loopback; prints a report")
    job_args(demo, skip=("allowed_devices", "min_devices"), **PROCESS_DEFAULTS)
    from edgeps.localjob import DemoSettings
    from edgeps.options import add_model_options

    add_model_options(demo, DemoSettings, skip=DEMO_API_ONLY)
    demo.add_argument("--json", help="also write the report as JSON here")
    demo.set_defaults(func=cmd_demo)
