"""Layered configuration for every role (``ps``, ``client``, ``ctl``, ``demo``, ...): a TOML file
(``--config FILE``, keys named like the options: ``pace = "acbsp"``, ``push-every = 20``), then
``EDGEPS_<OPTION>`` environment variables (``EDGEPS_PUSH_EVERY=20``), then flags, each overriding
the one before. ``edgeps config show ROLE ...`` prints the result and where each value came from."""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SKIP = {"help", "config", "func", "command", "verbose"}


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in SKIP and a.option_strings}


def _by_flag(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each long option's name without its dashes (``devices``, ``sites-only``) -> its dest."""
    return {o[2:]: a.dest for a in parser._actions if a.dest not in SKIP for o in a.option_strings if o[:2] == "--"}


def _convert(action: argparse.Action, raw: Any, where: str) -> Any:
    if isinstance(action, argparse._StoreTrueAction):
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in ("1", "true", "yes", "on"):
            return True
        if str(raw).lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{where}: expected true or false, got {raw!r}")
    convert = action.type if callable(action.type) else None  # argparse also allows a registered name
    value = convert(raw) if convert is not None and isinstance(raw, str) else raw
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: {value!r} is not one of {list(action.choices)}")
    return value


def layered(
    parser: argparse.ArgumentParser, config: str | None, environ: Mapping[str, str] = os.environ
) -> dict[str, tuple[Any, str]]:
    """{option: (value, source)} from the TOML file and the environment (defaults otherwise)."""
    options = _options(parser)
    values = {dest: (action.default, "default") for dest, action in options.items()}
    if config:
        path = Path(config)
        with path.open("rb") as file:
            table = tomllib.load(file)
        flags = _by_flag(parser)
        for key, raw in table.items():
            dest = flags.get(key, key.replace("-", "_"))
            if dest not in options:
                raise ValueError(f"{path}: unknown option {key!r} for {parser.prog}")
            values[dest] = (_convert(options[dest], raw, f"{path}: {key}"), str(path))
    for dest, action in options.items():
        name = f"EDGEPS_{dest.upper()}"
        if name in environ:
            values[dest] = (_convert(action, environ[name], name), name)
    return values


def apply(parser: argparse.ArgumentParser, argv: list[str], config: str | None) -> argparse.Namespace:
    """Parse ``argv`` with the file and environment as defaults under the flags."""
    parser.set_defaults(**{dest: value for dest, (value, _) in layered(parser, config).items()})
    return parser.parse_args(argv)


def show(parser: argparse.ArgumentParser, argv: list[str], config: str | None) -> str:
    """The effective configuration of a role as TOML, each line commented with its source."""
    values = layered(parser, config)
    parsed = apply(parser, argv, config)
    lines = [f"# edgeps {parser.prog.split()[-1]}: effective configuration (flags > environment > file > defaults)"]
    for dest in sorted(values):
        value, source = values[dest]
        final = getattr(parsed, dest)
        if final != value:
            source = "flag"
        if final is None:
            lines.append(f"# {dest.replace('_', '-')} is not set")
            continue
        if dest == "password":
            final = "********"
        rendered = str(final).lower() if isinstance(final, bool) else repr(final) if isinstance(final, str) else final
        rendered = f'"{final}"' if isinstance(final, str) else rendered
        lines.append(f"{dest.replace('_', '-')} = {rendered}  # {source}")
    return "\n".join(lines)
