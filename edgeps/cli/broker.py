"""``edgeps broker``: a local Mosquitto with the project's config, or ``broker init``: a deployable secure setup."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from edgeps.cli.common import Subparsers, stop_on_signals

if TYPE_CHECKING:
    from broker.deploy.secure import SecureSetup


def cmd_broker(args: argparse.Namespace) -> int:
    from broker.launcher import start_broker

    if args.action == "init":
        return cmd_broker_init(args)
    broker = start_broker(
        port=args.port or 1883,
        host=args.host or "127.0.0.1",
        embedded=True if args.embedded else None,
        workdir=Path(args.data_dir),
        ws_port=args.ws_port,
    )
    print(
        f"{broker.kind} listening on {', '.join(broker.listeners)}; data and log in {broker.workdir}; Ctrl-C stops it"
    )
    stop = stop_on_signals()
    try:
        while not stop.wait(0.5) and broker.process.poll() is None:
            pass
    finally:
        broker.stop()
    return 0


def cmd_broker_init(args: argparse.Namespace) -> int:
    from broker.deploy.secure import init_secure_broker
    from broker.deploy.sites import aggregator_account, bridge_account

    sites = parse_sites(args.site or [])
    if not args.directory or not (args.devices or sites):
        raise ValueError(
            "edgeps broker init DIR --devices dev-00,dev-01,... [--site S=dev-02,dev-03] [--job J] [--operators op]"
        )
    setup = init_secure_broker(
        Path(args.directory),
        job=args.job,
        devices=args.devices.split(",") if args.devices else [],
        operators=args.operators.split(","),
        server=args.server,
        port=args.port or 8883,
        host=args.host or "0.0.0.0",  # a deployment listens on every interface unless told (both listeners)
        hostnames=tuple(args.hostnames.split(",")),
        client_certs=args.client_certs,
        sites=sites,
        core_address=args.core_address,
        aggregators=args.aggregators,
        ingest_workers=args.ingest_workers,
    )
    d, creds = setup.directory, setup.credentials_dir
    print(
        f"wrote {d}/broker (the broker's: config, passwd, acl, certificate, data), {d}/ca (the CA key: keep it "
        f"offline) and {d}/credentials (each account's password, ca.crt) for job {args.job}"
    )
    owned = setup.broker_dir.owner() == "mosquitto"
    owner = "owned by the mosquitto account" if owned else "chown -R it to the broker's account if it runs as one"
    print(f"start the broker:  mosquitto -c {setup.config}   ({d}/broker: {owner})")
    password = creds / f"{setup.server}.password"
    deployment = write_server_options(setup, password)
    print(
        f"server:   edgeps ps --config {deployment} --broker HOST:PORT ...   (the deployment's accounts, devices "
        f"and sites: {', '.join(server_flags(setup, password))})"
    )
    for site, members in setup.sites.items():
        print(
            f"site {site} ({', '.join(members)}): mosquitto -c {setup.site_config(site)}   (its devices connect "
            f"there; it bridges to the core as {bridge_account(site)})"
        )
        if setup.aggregators:
            account = aggregator_account(site)
            print(
                f"  its aggregator: edgeps aggregator --job {args.job} --site {site} --devices {','.join(members)} "
                f"--broker SITE-HOST:PORT --username {account} --password-file {creds}/{account}.password "
                f"--tls-ca {setup.ca_cert}"
            )
    for worker in setup.workers:
        print(
            f"ingest worker: edgeps aggregator --job {args.job} --site {worker} --shared "
            f"--devices {','.join(setup.devices)} --broker HOST:PORT --username {worker} "
            f"--password-file {creds}/{worker}.password --tls-ca {setup.ca_cert}"
        )
    print(
        f"a device: edgeps client --broker HOST:PORT --username DEVICE --password-file {creds}/DEVICE.password "
        f"--tls-ca {setup.ca_cert} --device DEVICE ..."
    )
    return 0


def server_flags(setup: SecureSetup, password: Path) -> list[str]:
    """What the server of ``setup`` must be told of the deployment: its account, the job's devices,
    each aggregated site's devices (a site speaks for those and no others), the ingest workers."""
    flags = [
        f"--job {setup.job}",
        f"--username {setup.server}",
        f"--password-file {password}",
        f"--tls-ca {setup.ca_cert}",
        f"--devices {','.join(setup.devices)}",
    ]
    if setup.aggregators:
        flags += [f"--site {site}={','.join(members)}" for site, members in setup.sites.items()]
    if setup.workers:
        flags += [f"--sites {','.join(setup.workers)}", "--sites-only"]
    return flags


def write_server_options(setup: SecureSetup, password: Path) -> Path:
    """``DIR/server.toml``: ``server_flags`` as the server's options file (``edgeps ps --config``)."""
    lines = [
        "# edgeps ps: the deployment `edgeps broker init` wrote (accounts, devices, sites); add --broker",
        f'job = "{setup.job}"',
        f'username = "{setup.server}"',
        f'password-file = "{password}"',
        f'tls-ca = "{setup.ca_cert}"',
        f'devices = "{",".join(setup.devices)}"',
    ]
    if setup.aggregators:
        entries = ", ".join(f'"{site}={",".join(members)}"' for site, members in setup.sites.items())
        lines.append(f"site = [{entries}]")
    if setup.workers:
        lines += [f'sites = "{",".join(setup.workers)}"', "sites-only = true"]
    path = setup.directory / "server.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def parse_sites(values: list[str]) -> dict[str, list[str]]:
    """``--site NAME=DEV,DEV`` values as {site: devices}; ValueError, naming the value, otherwise."""
    sites: dict[str, list[str]] = {}
    for value in values:
        name, _, devices = value.partition("=")
        if not name or not devices or name in sites:
            raise ValueError(f"--site {value!r}: give each site once, as NAME=DEV,DEV,...")
        sites[name] = devices.split(",")
    return sites


def add(sub: Subparsers) -> None:
    """The role's subcommand, its options and its function."""
    broker = sub.add_parser("broker", help="start Mosquitto with the project's config (or the embedded broker)")
    broker.add_argument("--host", help="address to listen on (run: 127.0.0.1; init: 0.0.0.0, both listeners)")
    broker.add_argument("--port", type=int, help="MQTT port to listen on (run: 1883; init: 8883)")
    broker.add_argument("--embedded", action="store_true", help="force the embedded amqtt broker")
    broker.add_argument("--ws-port", type=int, default=9001, help="MQTT over WebSockets (the dashboard), on --host")
    broker.add_argument(
        "--data-dir", default="edgeps-broker", help="persistence (sessions, queued and retained messages) and log"
    )
    broker.add_argument(
        "action",
        nargs="?",
        default="run",
        choices=["run", "init"],
        help="init DIR: write a deployable setup (accounts, ACLs, TLS) instead of starting the local broker",
    )
    broker.add_argument("directory", nargs="?", help="init: where to write it")
    broker.add_argument("--job", default="demo", help="init: the job the accounts are for")
    broker.add_argument("--devices", help="init: comma-separated device ids (one account each)")
    broker.add_argument("--operators", default="operator", help="init: comma-separated operator accounts")
    broker.add_argument("--server", default="ps", help="init: the parameter server's account")
    broker.add_argument("--hostnames", default="localhost,127.0.0.1", help="init: names in the broker's certificate")
    broker.add_argument("--client-certs", action="store_true", help="init: issue and require client certificates")
    broker.add_argument(
        "--site",
        action="append",
        metavar="NAME=DEV,DEV",
        help="init: a site broker for these devices, bridged to this one (repeatable; docs/SCALING.md)",
    )
    broker.add_argument(
        "--core-address",
        metavar="HOST:PORT",
        help="init: where site brokers reach this one (default: the first of --hostnames, and the port)",
    )
    broker.add_argument(
        "--aggregators",
        action="store_true",
        help="init: each site runs `edgeps aggregator` "
        "(an account on its broker); its site commits cross to the core instead of its devices' "
        "commits",
    )
    broker.add_argument(
        "--ingest-workers",
        type=int,
        default=0,
        metavar="K",
        help="init: K accounts ingest-0.. for `edgeps aggregator --shared` on this broker (docs/SCALING.md)",
    )
    broker.set_defaults(func=cmd_broker)
