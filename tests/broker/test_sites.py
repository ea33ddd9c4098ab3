"""``edgeps broker init --site``: what each broker of a bridged topology gets (no broker started;
tests/integration/test_sites.py runs them)."""

from __future__ import annotations

import stat

import pytest

from broker.deploy.secure import init_secure_broker
from broker.deploy.sites import bridge_account
from edgeps.cli.broker import parse_sites
from schemas.topics import Topics

SITES = {"a": ["dev-0", "dev-1"], "b": ["dev-2"]}


def accounts(passwd) -> set[str]:
    return {line.split(":", 1)[0] for line in passwd.read_text().splitlines() if line}


def test_each_broker_holds_only_its_own_accounts(tmp_path) -> None:
    setup = init_secure_broker(tmp_path, "j", devices=["dev-9"], sites=SITES, core_address="core:8883")
    assert accounts(setup.broker_dir / "passwd") == {"ps", "operator", "dev-9", "site-a", "site-b"}
    for site, members in SITES.items():
        place = setup.site_config(site).parent
        assert accounts(place / "passwd") == set(members)
        assert stat.S_IMODE(setup.site_config(site).stat().st_mode) == 0o600  # it holds the bridge's password
        assert stat.S_IMODE(place.stat().st_mode) == 0o700 and stat.S_IMODE(place.parent.stat().st_mode) == 0o755
        config = setup.site_config(site).read_text()
        assert f"remote_password {setup.passwords[bridge_account(site)]}" in config
        assert "address core:8883" in config and "bridge_insecure false" in config
        assert "allow_anonymous false" in config and "use_username_as_clientid true" in config
    # Devices are provisioned as before, wherever they connect; a bridge's password stays in its config.
    assert {p.stem for p in setup.credentials_dir.glob("*.password")} == {
        "ps",
        "operator",
        "dev-9",
        *SITES["a"],
        *SITES["b"],
    }
    assert setup.devices == ["dev-9", "dev-0", "dev-1", "dev-2"]


def test_a_site_forwards_only_its_devices_and_the_jobs_broadcasts(tmp_path) -> None:
    setup = init_secure_broker(tmp_path, "j", devices=[], sites=SITES, core_address="core:8883")
    t = Topics("j")
    lines = [line for line in setup.site_config("b").read_text().splitlines() if line.startswith("topic ")]
    assert lines == [
        f"topic {t.grad('dev-2')} out 1",
        f"topic {t.status('dev-2')} out 1",
        f"topic {t.params} in 1",
        f"topic {t.delta} in 1",
        f"topic {t.model} in 1",
        f"topic {t.barrier} in 1",
        f"topic {t.ctrl('dev-2')} in 1",
        f"topic {t.notice('dev-2')} in 1",
    ]


@pytest.mark.parametrize(
    ("sites", "core"),
    [
        ({"a": []}, "core:8883"),
        ({"a": ["ps"]}, "core:8883"),
        ({"a": ["x"], "b": ["x"]}, "core:8883"),
        ({"a/b": ["x"]}, "core:8883"),
        ({"a": ["x"]}, "core"),
    ],
)
def test_bad_sites_are_refused_before_anything_is_written(tmp_path, sites, core) -> None:
    with pytest.raises(ValueError):
        init_secure_broker(tmp_path / "setup", "j", devices=[], sites=sites, core_address=core)
    assert not (tmp_path / "setup").exists()


def test_site_options_parse_or_name_the_bad_value() -> None:
    assert parse_sites(["a=dev-0,dev-1", "b=dev-2"]) == SITES
    for bad in (["a"], ["=dev-0"], ["a=dev-0", "a=dev-1"]):
        with pytest.raises(ValueError, match="--site"):
            parse_sites(bad)


def test_aggregators_and_ingest_workers_get_their_own_accounts_and_only_their_topics(tmp_path) -> None:
    setup = init_secure_broker(
        tmp_path, "j", devices=["dev-9"], sites=SITES, core_address="core:8883", aggregators=True, ingest_workers=2
    )
    t = Topics("j")
    assert accounts(setup.broker_dir / "passwd") == {
        "ps",
        "operator",
        "dev-9",
        "site-a",
        "site-b",
        "ingest-0",
        "ingest-1",
    }
    core_acl = (setup.broker_dir / "acl").read_text()
    worker = core_acl.split("user ingest-0\n")[1].split("\n\n")[0].splitlines()
    assert f"topic write {t.part('ingest-0')}" in worker and f"topic read {t.all_grad}" in worker
    assert not any(t.cmd in line or t.metrics in line or "part/ingest-1" in line for line in worker)
    bridge = core_acl.split("user site-a\n")[1].split("\n\n")[0]
    assert f"topic write {t.part('a')}" in bridge and t.grad("dev-0") not in bridge  # site commits, not commits
    for site, members in SITES.items():
        place = setup.site_config(site).parent
        assert accounts(place / "passwd") == {*members, f"agg-{site}"}
        assert f"topic {t.part(site)} out 1" in setup.site_config(site).read_text()
        assert f"topic {t.grad(members[0])} out 1" not in setup.site_config(site).read_text()
        assert (setup.credentials_dir / f"agg-{site}.password").exists()
