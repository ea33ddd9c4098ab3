"""What the roles share: broker options, the job's options, the broker address, signals."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from typing import TypeAlias

from broker.client import BrokerAddress


def broker_args(parser: argparse.ArgumentParser) -> None:
    """Where the broker is and how to log in (each also from EDGEPS_<OPTION>, as every option)."""
    parser.add_argument(
        "--broker", default="127.0.0.1:1883", help="HOST:PORT of the MQTT broker (default: %(default)s)"
    )
    parser.add_argument("--username", help="the account's name")
    parser.add_argument("--password", help="the account's password (better: --password-file)")
    parser.add_argument("--password-file", help="read the password from this file")
    parser.add_argument("--tls-ca", help="CA certificate: use TLS")
    parser.add_argument("--tls-cert", help="client certificate")
    parser.add_argument("--tls-key", help="client certificate's key")


def job_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (), **defaults: object) -> None:
    """The job's options (ServerConfig) and the model's (ModelSpec), derived from them."""
    from edgeps.options import add_model_options
    from learning.spec import ModelSpec
    from ps_service.config import ServerConfig

    add_model_options(parser, ServerConfig, skip=skip, defaults=defaults)
    add_model_options(parser, ModelSpec)


def address(args: argparse.Namespace) -> BrokerAddress:
    password = args.password
    if args.password_file:
        password = Path(args.password_file).read_text().strip()
    tls = {"tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key}
    return BrokerAddress.parse(args.broker, args.username, password, **tls)


def stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def writable(path: str | None, flag: str) -> None:
    """ValueError in one line unless a file can be written at ``path`` when the job ends (its folder
    exists and is writable, the path is not a folder): checked before a device is waited for."""
    import os
    from pathlib import Path

    if path is None:
        return
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ValueError(f"{flag} {path}: a folder, not a file")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: no folder {folder} to write it in (make it first)")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: folder {folder} is not writable")


#: What a role's ``add`` registers its subcommand on.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
