"""The one ``key=value`` dialect of every command: a command's options are a dataclass, each ``key=value`` token sets
one field, converted from the field's type; an unknown key, a bad value or a missing one is one line naming the fix.

``run`` keys go to Hydra, which speaks the same dialect; the other commands parse theirs here. A field converts
with its ``metadata["parse"]`` when it has one (for values such as ``4096x4096,4096x14336``), else by its type:
``str``, ``int``, ``float``, ``bool`` (true/false), ``Path``, ``Literal`` choices, ``list[...]`` (comma-separated) and
any of these ``| None`` (``null`` or an empty value gives None).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from compress.base.errors import CompressError, unknown_key_error

T = TypeVar("T")
HELP = {"-h", "--help", "help"}
NULL = ("", "null", "none")
BOOLEANS = {"true": True, "false": False}


def wants_help(argv: list[str]) -> bool:
    return bool(HELP & set(argv))


def usage(options_type: type, synopsis: str) -> str:
    """The synopsis and every key with its default, for ``--help``."""
    lines = [f"usage: {synopsis}", "", "keys:"]
    for option in dataclasses.fields(options_type):
        if option.default is not dataclasses.MISSING:
            default = "null" if option.default is None else show_value(option.default)
        elif option.default_factory is not dataclasses.MISSING:
            default = show_value(option.default_factory())
        else:
            default = "(required)"
        lines.append(f"  {option.name}={default}")
    return "\n".join(lines)


def show_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return ",".join(show_value(item) for item in value)
    return str(value)


def parse_options(
    options_type: type[T], argv: list[str], synopsis: str, passthrough: str | None = None
) -> tuple[T, list[str]]:
    """``options_type`` built from ``key=value`` tokens, and the tokens under ``passthrough.`` (``gate.`` for the
    gate's dotted policy keys) with that prefix removed, for the caller to apply."""
    fields = {option.name: option for option in dataclasses.fields(options_type)}
    hints = typing.get_type_hints(options_type)
    values: dict[str, Any] = {}
    forwarded = []
    for token in argv:
        key, separator, text = token.partition("=")
        if not separator:
            raise CompressError(f"argument {token!r} is not key=value; usage: {synopsis}")
        if passthrough and key.startswith(f"{passthrough}."):
            forwarded.append(f"{key.removeprefix(passthrough + '.')}={text}")
            continue
        if key not in fields:
            valid = [*fields, f"{passthrough}.<key>"] if passthrough else list(fields)
            raise unknown_key_error("argument", key, valid)
        parse = fields[key].metadata.get("parse")
        try:
            values[key] = parse(text) if parse else convert(text, hints[key])
        except ValueError as error:
            raise CompressError(f"{key}={text!r}: {error}") from None
    missing = [name for name, option in fields.items() if name not in values and _required(option)]
    if missing:
        raise CompressError(f"missing {', '.join(f'{name}=...' for name in missing)}; usage: {synopsis}")
    try:
        return options_type(**values), forwarded
    except ValueError as error:  # the options' own __post_init__ checks
        raise CompressError(str(error)) from None


def _required(option: dataclasses.Field) -> bool:
    return option.default is dataclasses.MISSING and option.default_factory is dataclasses.MISSING


def convert(text: str, hint: Any) -> Any:
    """``text`` as a value of type ``hint``; ValueError names what to give instead."""
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, types.UnionType) or origin is typing.Union:
        if type(None) in arguments and text.lower() in NULL:
            return None
        (inner,) = [argument for argument in arguments if argument is not type(None)]
        return convert(text, inner)
    if origin is typing.Literal:
        if text not in arguments:
            raise ValueError(f"choose {' or '.join(map(str, arguments))}")
        return text
    if origin is list:
        return [convert(item.strip(), arguments[0]) for item in text.split(",") if item.strip()]
    if hint is bool:
        if text.lower() not in BOOLEANS:
            raise ValueError("give true or false")
        return BOOLEANS[text.lower()]
    if hint in (int, float):
        try:
            return hint(text)
        except ValueError:
            raise ValueError(f"give {'an integer' if hint is int else 'a number'}") from None
    if hint in (str, Path):
        return hint(text)
    raise TypeError(f"no key=value conversion for {hint!r}")  # a programming error in an options dataclass
