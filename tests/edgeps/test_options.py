"""The flags of edgeps ps and edgeps demo, derived from ServerConfig, ModelSpec and DemoSettings."""

from __future__ import annotations

import pytest

from edgeps.cli import build_parser
from edgeps.localjob import DemoSettings
from edgeps.options import model_values, to_flags
from ps_service.config import PROCESS_DEFAULTS, ServerConfig, flat_names


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_every_job_option_is_a_flag_of_ps_with_the_models_default_and_help() -> None:
    ps = next(a for a in build_parser()._actions if a.dest == "command").choices["ps"]
    flags = {a.dest: a for a in ps._actions}
    for name in flat_names(ServerConfig) - {"door"}:  # the door's options are given flat
        assert name in flags and flags[name].help, name  # documented
    assert flags["push_every"].default == ServerConfig().push_every
    assert flags["metrics_interval_s"].default == 1.0  # ps publishes metrics every second unless told
    assert flags["balance"].choices == ("off", "steps", "release")


def test_flags_become_a_validated_server_config() -> None:
    args = parse(
        "ps",
        "--pace",
        "ssp:2",
        "--devices",
        "a,b",
        "--max-commit-rate",
        "0",
        "--metrics-interval",
        "0",
        "--duration",
        "30",
        "--round-deadline",
        "2.5",
    )
    config = ServerConfig(**model_values(ServerConfig, args))
    assert config.pace == "ssp:2" and config.allowed_devices == frozenset({"a", "b"})
    assert config.door.max_commit_rate is None and config.metrics_interval_s is None  # 0: none
    assert config.duration_s == 30 and config.round_deadline_s == 2.5
    with pytest.raises(ValueError, match="unknown pace"):
        ServerConfig(**model_values(ServerConfig, parse("ps", "--pace", "foo")))


def test_a_config_turned_into_flags_parses_back_to_itself() -> None:
    config = ServerConfig(
        job="j",
        pace="acbsp",
        rounds=7,
        codec="topk:0.05",
        max_commit_rate=None,
        allowed_devices=frozenset({"d2", "d1"}),
        extrapolation=2.0,
        duration_s=9.5,
        site_devices=["sa=d1,d2", "sb=d3"],
        max_held_commits=4,
    )
    args = parse("ps", *to_flags(config, defaults=PROCESS_DEFAULTS))
    assert ServerConfig(**model_values(ServerConfig, args)) == config


def test_demo_settings_hold_the_job_and_the_model() -> None:
    args = parse("demo", "--pace", "acbsp", "--rounds", "12", "--devices", "3", "--hidden", "32,16", "--seed", "4")
    settings = DemoSettings(
        server=ServerConfig(**model_values(ServerConfig, args)),
        **model_values(DemoSettings, args, skip=("server", "model", "timeout_s", "slowdowns", "step_time")),
    )
    assert settings.server.pace == "acbsp" and settings.server.rounds == 12 and settings.devices == 3
    assert settings.seed == 4 and DemoSettings(rounds=12, hidden="32").model.layers == [32]
    with pytest.raises(ValueError, match="positive integers"):
        DemoSettings(hidden="64,x")


def test_flat_fields_go_to_the_job_unless_the_holder_has_them_itself() -> None:
    from edgeps.scenario import Scenario

    scenario = Scenario(duration_s=2.0, push_every=20, devices=4)
    assert scenario.duration_s == 2.0 and scenario.server.duration_s is None  # the run's length, not the job's
    assert scenario.server.push_every == 20 and scenario.server.round_deadline_s == 5.0 and scenario.devices == 4
    assert Scenario.model_validate({**scenario.model_dump(), "lr": 0.1}).server.push_every == 20
