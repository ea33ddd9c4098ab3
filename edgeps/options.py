"""Command-line options derived from the pydantic models that hold them: one schema per set of
options (``ServerConfig``, ``DeviceConfig``, ``DemoSettings``), from which the flags, their
types, defaults and help, the TOML file and ``EDGEPS_*`` layering (edgeps/settings.py, which
works on the flags) and ``edgeps config show`` all follow.

A field ``push_every`` is the flag ``--push-every`` (``json_schema_extra={"flag": "duration"}``
names another). An optional number whose default is not None takes 0 for "none" (``--max-commit-
rate 0``: no limit). A ``frozenset[str]`` is a comma-separated list. ``bool`` is a switch.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from ps_service.config import nest_fields, nested_model

__all__ = ["add_model_options", "flag", "model_values", "nest_fields", "to_flags", "validation_line"]


def _extra(info: FieldInfo) -> dict[str, Any]:
    extra = info.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def flag(name: str, info: FieldInfo) -> str:
    """The option that sets field ``name``."""
    return "--" + str(_extra(info).get("flag", name)).replace("_", "-")


def _base(annotation: Any) -> tuple[Any, bool]:
    """(the annotation without None, whether None is allowed)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return (args[0] if len(args) == 1 else annotation), len(args) < len(typing.get_args(annotation))
    return annotation, False


def _number(kind: type) -> Any:
    """``int`` or ``float`` of ASCII text only (Python reads ``٣`` as 3, which no other tool does)."""

    def number(text: str) -> Any:
        if not text.isascii():
            raise ValueError(f"{text!r} is not an ASCII number")
        return kind(text)

    number.__name__ = kind.__name__  # argparse names the type in its error messages
    return number


def _parser(annotation: Any, optional: bool, default: Any) -> Any:
    """The argparse ``type`` of a field: text to the field's value."""
    base, _ = _base(annotation)
    if typing.get_origin(base) is frozenset:
        return lambda text: frozenset(x for x in text.split(",") if x) or None
    if base in (int, float) and optional and default is not None:
        read = _number(base)

        def number_or_none(text: str) -> Any:
            value = read(text)
            return None if value == 0 else value

        number_or_none.__name__ = base.__name__
        return number_or_none
    if base in (int, float):
        return _number(base)
    return base if base is str else None


def add_model_options(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    skip: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """An option for every field of ``model`` but ``skip``, its dest the field's name; ``defaults``
    replace the model's for this command."""
    defaults = defaults or {}
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        nested = nested_model(info)
        if nested is not None:
            add_model_options(parser, nested, skip, defaults)
            continue
        default = defaults.get(name, info.default)
        base, optional = _base(info.annotation)
        help_text = info.description or ""
        if base is bool:
            parser.add_argument(flag(name, info), dest=name, action="store_true", default=default, help=help_text)
            continue
        if "(default" not in help_text and "required" not in help_text:
            help_text += " (default: none)" if default is None else f" (default: {default})"
        metavar = _extra(info).get("metavar") or flag(name, info)[2:].replace("-", "_").upper()
        if typing.get_origin(base) is dict:  # repeated NAME=A,B (the model parses them)
            parser.add_argument(
                flag(name, info), dest=name, action="append", default=default, metavar=metavar, help=help_text
            )
            continue
        if typing.get_origin(base) is Literal:
            choices = typing.get_args(base)
            parser.add_argument(flag(name, info), dest=name, default=default, choices=choices, help=help_text)
            continue
        kind = _parser(info.annotation, optional, default)
        if info.is_required() and name not in defaults:  # required of the model, which says so when it is
            # missing: argparse's required=True would refuse it before a --config file or EDGEPS_* gave it
            help_text = help_text.replace(" (default: PydanticUndefined)", " (required)")
            parser.add_argument(flag(name, info), dest=name, default=None, type=kind, metavar=metavar, help=help_text)
            continue
        parser.add_argument(flag(name, info), dest=name, default=default, type=kind, metavar=metavar, help=help_text)


def model_values(model: type[BaseModel], args: argparse.Namespace, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The values ``args`` holds for the fields of ``model`` (those added by ``add_model_options``),
    a nested model's flat (its holder's validator nests them: ``nest_fields``)."""
    values: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        nested = nested_model(info)
        if nested is not None and name not in skip:
            values.update(model_values(nested, args, skip))
        elif name not in skip and hasattr(args, name):
            if getattr(args, name) is None and info.is_required():
                continue  # not given: the model says it is required
            values[name] = getattr(args, name)
    return values


def to_flags(config: BaseModel, skip: Iterable[str] = (), defaults: Mapping[str, Any] | None = None) -> list[str]:
    """The flags that give a command ``config`` again (for a child process): every field not at
    the command's default (``defaults``, else the model's), but ``skip``."""
    out: list[str] = []
    defaults = defaults or {}
    for name, info in type(config).model_fields.items():
        value = getattr(config, name)
        if isinstance(value, BaseModel) and nested_model(info) is not None:
            out += to_flags(value, skip, defaults)
            continue
        if name in skip or value == defaults.get(name, info.default):
            continue
        if isinstance(value, bool):
            out += [flag(name, info)] if value else []
        elif value is None:
            out += [flag(name, info), "0"]  # an optional number whose default is not None
        elif isinstance(value, frozenset):
            out += [flag(name, info), ",".join(sorted(value))]
        elif isinstance(value, dict):
            for key, members in sorted(value.items()):
                out += [flag(name, info), f"{key}={','.join(sorted(members))}"]
        else:
            out += [flag(name, info), str(value)]
    return out


def validation_line(error: ValidationError, models: Iterable[type[BaseModel]] = ()) -> str:
    """A pydantic error about options as one line naming the option and its value: ``--codec 'bogus':
    unknown codec 'bogus'; known: ...`` (the first error, and how many more). ``models`` say which
    field is which flag (a field's ``flag`` extra); others are ``--field-name``."""
    flags = {name: flag(name, info) for model in models for name, info in model.model_fields.items()}
    errors = error.errors()
    first = errors[0]
    fields = [str(part) for part in first["loc"] if isinstance(part, str)]
    message = str(first["msg"]).removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if not fields:  # a check across fields: its message says which
        return message + more
    option = flags.get(fields[-1], "--" + fields[-1].replace("_", "-"))
    value = first.get("input")
    shown = "" if isinstance(value, dict) else f" {value!r}"
    return f"{option}{shown}: {message}{more}"
