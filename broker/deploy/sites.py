"""Site brokers bridged to a core broker (``edgeps broker init DIR --site NAME=DEV,DEV``).

The usual IoT topology past one machine: devices talk to a Mosquitto on their own site; that
broker holds a bridge (one MQTT connection, its own account on the core, TLS) to the core
broker, where the parameter server and operators are. The bridge carries only what must cross:
up, the site's devices' commits and statuses; down, the job's parameters, deltas, model artifact
and barrier and each site device's control and notices. Everything else (another site's
traffic, metrics, commands and replies) stays where it is.

For each site ``init_secure_broker`` writes ``DIR/sites/{site}/broker/``: the site's
``mosquitto.conf`` (the same deployment profile as the core's, plus the bridge; mode 600, since
it holds the bridge account's password), ``passwd`` and ``acl`` for the site's devices, the
site's certificate from the job's CA, and ``data/``. The core gets one account per site
(``site-{site}``: ``bridge_account``) whose ACL names that site's devices only, so a site can
speak for its own devices and for no one else's.

The bridge's session on the core is persistent (``cleansession false``) and its subscriptions
QoS 1: while the uplink is down the core queues what goes down, the site broker what goes up,
each within its ``max_queued_bytes``. The bridge's state (``1`` connected, ``0`` not) is
retained on the core at ``edgeps/{job}/site/{site}`` (``Topics.site``) for operators.
"""

from __future__ import annotations

from pathlib import Path

from schemas.topics import Topics

BRIDGE_PREFIX = "site-"
AGGREGATOR_PREFIX = "agg-"


def bridge_account(site: str) -> str:
    """The site's bridge account on the core broker (also its client id there)."""
    return f"{BRIDGE_PREFIX}{site}"


def aggregator_account(site: str) -> str:
    """The site aggregator's account on its site broker (``--aggregators``)."""
    return f"{AGGREGATOR_PREFIX}{site}"


def split_address(core: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); ValueError naming ``--core-address`` otherwise."""
    host, _, port = core.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--core-address: {core!r} is not HOST:PORT")
    return host, int(port)


def up_topics(job: str, site: str, devices: list[str], aggregated: bool = False) -> list[str]:
    """What a site forwards to the core: its devices' statuses, and their commits or, where the
    site runs an aggregator (``aggregated``), its site commits instead."""
    t = Topics(job)
    statuses = [t.status(device) for device in devices]
    return [t.part(site), *statuses] if aggregated else [*(t.grad(device) for device in devices), *statuses]


def down_topics(job: str, devices: list[str]) -> list[str]:
    """What the core forwards to a site: the job's broadcasts and its devices' controls and notices."""
    t = Topics(job)
    return [t.params, t.delta, t.model, t.barrier] + [
        topic for device in devices for topic in (t.ctrl(device), t.notice(device))
    ]


def core_acl(job: str, site: str, devices: list[str], aggregated: bool = False) -> str:
    """The core broker's ACL block for the site's bridge account."""
    lines = [f"user {bridge_account(site)}", f"topic write {Topics(job).site(site)}"]
    lines += [f"topic write {topic}" for topic in up_topics(job, site, devices, aggregated)]
    lines += [f"topic read {topic}" for topic in down_topics(job, devices)]
    return "\n".join(lines) + "\n"


def aggregator_acl(job: str, site: str, account: str | None = None) -> str:
    """The ACL block of the aggregator of ``site`` (its account: ``aggregator_account``): its devices'
    commits, statuses and controls and the job's broadcasts in; its site commits and notices to its
    devices out. Wildcards, as it subscribes: on a site's broker every device is the site's, and an
    ingest worker on the core (``account`` = ``site``, its name) takes a share of every device's
    commits (the topic filter of its shared subscription)."""
    t = Topics(job)
    user = account or aggregator_account(site)
    lines = ["", f"user {user}", f"topic write {t.part(site)}", f"topic write {t.notice('+')}"]
    lines += [f"topic read {topic}" for topic in (t.all_grad, t.all_status, t.ctrl("+"), t.params, t.delta, t.barrier)]
    return "\n".join(lines) + "\n"


def bridge_config(
    job: str, site: str, devices: list[str], core: str, password: str, ca: Path, aggregated: bool = False
) -> str:
    """The site broker's bridge section: to ``core`` (HOST:PORT, TLS verified against ``ca``)."""
    host, port = split_address(core)
    account = bridge_account(site)
    lines = [
        "",
        f"# The bridge to the core broker: one connection, account {account!r}, TLS.",
        f"connection {account}",
        f"address {host}:{port}",
        "bridge_protocol_version mqttv311",
        f"remote_clientid {account}",
        f"remote_username {account}",
        f"remote_password {password}",
        f"bridge_cafile {ca}",
        "bridge_insecure false",
        "bridge_tls_version tlsv1.2",
        "cleansession false",  # the core keeps what goes down while the uplink is away
        "try_private true",
        "restart_timeout 1 30",
        "keepalive_interval 30",
        "notifications true",
        "notifications_local_only false",
        f"notification_topic {Topics(job).site(site)}",
    ]
    lines += [f"topic {topic} out 1" for topic in up_topics(job, site, devices, aggregated)]
    lines += [f"topic {topic} in 1" for topic in down_topics(job, devices)]
    return "\n".join(lines) + "\n"
