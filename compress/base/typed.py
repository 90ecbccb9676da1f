"""Typed configuration from plain data: OmegaConf's structured merge, its multi-line errors turned into one line that
names the key and the fix. The run configuration, the gate policy and the search spec are all read through here, so a
wrong key or type reads the same wherever it is given.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, TypeVar

from compress.base.errors import CompressError, unknown_key_error

T = TypeVar("T")
TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}


def typed(schema: type[T], values: Any, where: str = "") -> T:
    """``values`` (a mapping, OmegaConf node or ``schema`` instance) over ``schema``'s defaults, as a ``schema``
    object; ``where`` prefixes the keys errors name (``gate``, ``search``)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged = None
    try:
        if OmegaConf.is_config(values):  # resolved first: an interpolation's value is type-checked like any other
            values = OmegaConf.to_container(values, resolve=True)
        merged = OmegaConf.merge(OmegaConf.structured(schema), values or {})
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise config_error(error, where, schema) from None
    except (TypeError, ValueError) as error:  # a section's own __post_init__ check, which names no key
        key = ".".join(part for part in (where, merged is not None and refusing_section(merged)) if part)
        raise CompressError(f"{key}: {error}" if key else str(error)) from None


def refusing_section(node: Any, path: str = "") -> str:
    """The dotted path of the innermost dataclass section of ``node`` whose constructor refuses its values."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            try:
                OmegaConf.to_object(child)
            except (TypeError, ValueError):
                return refusing_section(child, f"{path}.{key}" if path else str(key))
            except OmegaConfBaseException:
                continue  # a missing value elsewhere in that section: not what refused
    return path


def config_error(error: BaseException, where: str = "", schema: type | None = None) -> CompressError:
    """Hydra's and OmegaConf's multi-line errors as one line naming the key and the fix; ``schema`` finds the
    dataclass that lacks an unknown key when the error does not say which."""
    from omegaconf.errors import (
        ConfigAttributeError,
        ConfigKeyError,
        MissingMandatoryValue,
        OmegaConfBaseException,
        ValidationError,
    )

    node: BaseException | None = error
    while node is not None and not isinstance(node, OmegaConfBaseException):
        node = node.__cause__ or node.__context__
    if node is None:
        return CompressError(str(error).strip().splitlines()[0])
    relative = re.sub(r"\[(\d+)\]", r".\1", str(getattr(node, "full_key", "") or ""))
    key = ".".join(part for part in (where, relative) if part)
    if isinstance(node, MissingMandatoryValue):
        return CompressError(f"{key} has no value: set {key}=<value>")
    if isinstance(node, ConfigKeyError | ConfigAttributeError):
        owner = getattr(node, "object_type", None)
        if not dataclasses.is_dataclass(owner) and schema is not None:
            parent = relative.rpartition(".")[0]
            owner = schema_type(schema, parent.split(".") if parent else [])
        if dataclasses.is_dataclass(owner):
            parent_key, _, name = key.rpartition(".")
            return unknown_key_error(parent_key or "config", name, [f.name for f in dataclasses.fields(owner)])
    expected = _expected(getattr(node, "object_type", None), getattr(node, "key", None))
    if isinstance(node, ValidationError) and expected:
        return CompressError(f"{key}={node.value!r} has the wrong type: give {expected}")
    reason = str(getattr(node, "msg", "") or node).strip().splitlines()[0]
    return CompressError(f"{key}: {reason}" if key else reason)


def schema_type(schema: type, path: list[str]) -> type | None:
    """The dataclass at ``path`` in ``schema``; None inside its untyped parts (``stages``). Hydra's
    errors about a command-line key name the key, not always the dataclass that lacks it."""
    owner: Any = schema
    for part in path:
        if not dataclasses.is_dataclass(owner):
            return None
        owner = typing.get_type_hints(owner).get(part)
    return owner if dataclasses.is_dataclass(owner) else None


def _expected(owner: Any, key: Any) -> str | None:
    """``an integer or null`` for a dataclass field typed ``int | None``; None when the type says nothing simple."""
    if not dataclasses.is_dataclass(owner) or not isinstance(key, str):
        return None
    hint = typing.get_type_hints(owner).get(key)
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    options = typing.get_args(hint) if union else (hint,)
    words = [TYPE_WORDS.get(typing.get_origin(option) or option) for option in options]
    if typing.get_origin(hint) in (list, tuple):
        return "a list, e.g. [a, b]"
    return " or ".join(words) if all(words) else None
