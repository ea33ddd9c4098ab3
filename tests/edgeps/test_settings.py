"""Role configuration: TOML file < EDGEPS_* environment < flags."""

from __future__ import annotations

import pytest

from edgeps.cli import _roles, build_parser, main
from edgeps.settings import apply, layered


@pytest.fixture
def ps():
    return _roles(build_parser())["ps"]


def test_file_then_environment_then_flags(tmp_path, ps, monkeypatch) -> None:
    config = tmp_path / "ps.toml"
    config.write_text('pace = "acbsp"\npush-every = 20\nrounds = 7\nexport-tflite = true\n')
    monkeypatch.setenv("EDGEPS_ROUNDS", "9")
    monkeypatch.setenv("EDGEPS_BALANCE", "release")
    args = apply(ps, ["--rounds", "11"], str(config))
    assert (args.pace, args.push_every, args.rounds, args.balance, args.export_tflite) == (
        "acbsp",
        20,
        11,
        "release",
        True,
    )
    sources = {dest: source for dest, (_, source) in layered(ps, str(config)).items()}
    assert sources["pace"] == str(config) and sources["rounds"] == "EDGEPS_ROUNDS" and sources["lr"] == "default"


def test_bad_files_and_values_are_refused(tmp_path, ps, monkeypatch) -> None:
    config = tmp_path / "ps.toml"
    config.write_text("pase = 'acbsp'\n")
    with pytest.raises(ValueError, match="unknown option 'pase'"):
        layered(ps, str(config))
    monkeypatch.setenv("EDGEPS_BALANCE", "sometimes")
    with pytest.raises(ValueError, match="EDGEPS_BALANCE"):
        layered(ps, None)
    monkeypatch.delenv("EDGEPS_BALANCE")
    monkeypatch.setenv("EDGEPS_PUSH_EVERY", "many")
    with pytest.raises(ValueError):
        layered(ps, None)


def test_config_show_prints_the_effective_values_and_hides_passwords(tmp_path, capsys) -> None:
    config = tmp_path / "client.toml"
    config.write_text('device = "gw-7"\nbackend = "auto"\n')
    assert main(["config", "show", "client", "--config", str(config), "--password", "hunter2", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert f'device = "gw-7"  # {config}' in out and "seed = 3  # flag" in out and 'backend = "auto"' in out
    assert "hunter2" not in out and 'password = "********"' in out


def test_an_aggregators_required_site_may_come_from_its_file_or_the_environment(tmp_path, monkeypatch) -> None:
    """--site is required of the model, not of argparse: a TOML file or EDGEPS_SITE may give it."""
    from edgeps.options import model_values
    from ps_service.site.config import SiteConfig

    aggregator = _roles(build_parser())["aggregator"]
    config = tmp_path / "aggregator.toml"
    config.write_text('site = "north"\njob = "j7"\n')
    assert SiteConfig(**model_values(SiteConfig, apply(aggregator, [], str(config)))).site == "north"
    monkeypatch.setenv("EDGEPS_SITE", "south")
    assert SiteConfig(**model_values(SiteConfig, apply(aggregator, [], None))).site == "south"
    monkeypatch.delenv("EDGEPS_SITE")
    assert main(["aggregator", "--broker", "127.0.0.1:1"]) == 2  # none given: one line, "--site: Field required"
