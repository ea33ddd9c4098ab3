"""``edgeps aggregator``: a site's aggregator, beside its site broker (docs/SCALING.md)."""

from __future__ import annotations

import argparse
import logging

from edgeps.cli.common import Subparsers, address, broker_args, stop_on_signals

log = logging.getLogger("edgeps.aggregator")


def cmd_aggregator(args: argparse.Namespace) -> int:
    from broker.client import connect
    from edgeps.options import model_values
    from ps_service.io.mqtt import serve_site
    from ps_service.site.aggregator import SiteAggregator
    from ps_service.site.config import SiteConfig

    config = SiteConfig(**model_values(SiteConfig, args))  # refused before anything connects
    aggregator = SiteAggregator(config)
    broker = address(args)
    stop = stop_on_signals()
    # a stable client id and a persistent session: what this process held goes to the next one
    transport = connect(broker, f"edgeps-agg-{config.job}-{config.site}", aggregator.subscriptions())
    log.info(
        "site %s of job %s: aggregating on %s:%d, site commits to %s",
        config.site,
        config.job,
        broker.host,
        broker.port,
        aggregator.topics.part(config.site),
    )
    try:
        serve_site(aggregator, transport, stop)
    finally:
        transport.close(timeout=1.0)  # SIGTERM: gone within 2 s; what it did not acknowledge comes back
    return 0


def add(sub: Subparsers) -> None:
    """The role's subcommand, its options and its function."""
    from edgeps.options import add_model_options
    from ps_service.site.config import SiteConfig

    parser = sub.add_parser("aggregator", help="sum a site's commits into site commits (beside its site broker)")
    broker_args(parser)
    add_model_options(parser, SiteConfig)
    parser.set_defaults(func=cmd_aggregator)
