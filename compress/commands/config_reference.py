"""Every configuration key in one place (``compress config``, ``docs/config.md``), read from the typed classes that
check them, so the reference cannot drift from what a run accepts.

The convention every config dataclass follows: a field's meaning is the ``#`` comment at the end of its line, or,
when it does not fit there, the comment lines directly above it. Read with ``tokenize`` from the class's source, so
the comment a reader of the code sees is the line the reference prints. A section's own line is the comment on the
field that holds it, else the first paragraph of its class docstring.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

from compress.base.errors import CompressError, did_you_mean

MARKDOWN_COMMAND = "python -m compress config --markdown > docs/config.md"
PRAGMAS = ("fmt:", "noqa", "type:", "pragma:")


@dataclass(frozen=True)
class Key:
    key: str  # as written on the command line, e.g. gate.perplexity.max_ratio or stages.<i>.bits
    type: str
    default: str
    meaning: str


@dataclass(frozen=True)
class Section:
    name: str  # run, gate.perplexity, stages.gptq, search
    about: str
    keys: list[Key]
    source: str = ""  # the class whose fields these are, e.g. compress.stages.gptq.GPTQConfig


def sections() -> list[Section]:
    """The run's sections (its own keys, then each nested section in field order), each stage type, and search."""
    from compress.app.recipe import GROUPS, available
    from compress.app.run_config import RunConfig
    from compress.base.paths import recipes_dir
    from compress.search.spec import SearchSpec
    from compress.stages import STAGES

    groups = "; ".join(
        f"`{group}=<name>` picks `recipes/{group}/<name>.yaml`: {', '.join(available(group))}" for group in GROUPS
    )
    about = f"A recipe (`recipe=<name>`: `{recipes_dir().name}/<name>.yaml`) and its top-level keys. {groups}."
    found = _walk(RunConfig, "", "run", about)
    for name, stage in STAGES.items():
        about = _summary(stage.__doc__) or _summary(sys.modules[stage.__module__].__doc__)
        kind = Key("stages.<i>.type", "str", "(required)", f"`{name}` picks this stage (a list entry of `stages`)")
        found.append(
            Section(f"stages.{name}", about, [kind, *keys_of(stage.Config, "stages.<i>.")], _path(stage.Config))
        )
    about = "The `search.<key>=<value>` keys of `compress search` (the base recipe's keys are the run's)."
    found.extend(_walk(SearchSpec, "search.", "search", about))
    return found


def select(found: list[Section], wanted: str) -> list[Section]:
    """The sections named ``wanted`` or under it (``gate`` → every gate section), or the one key named ``wanted``."""
    chosen = [s for s in found if s.name == wanted or s.name.startswith(f"{wanted}.")]
    if chosen:
        return chosen
    for section in found:
        keys = [key for key in section.keys if key.key == wanted]
        if keys:
            return [Section(section.name, section.about, keys, section.source)]
    sections_named = [section.name for section in found]
    hint = did_you_mean(wanted, sections_named + [key.key for section in found for key in section.keys])
    raise CompressError(f"no section or key {wanted!r}{hint}; sections: {', '.join(sections_named)}")


def missing_meanings(found: list[Section]) -> list[str]:
    """The keys whose field has no comment: each must say what it does."""
    named = [
        (key.key, "" if key.key.startswith(section.name) else f" ({section.name})")
        for section in found
        for key in section.keys
        if not key.meaning
    ]
    return [f"{key}{where}" for key, where in named]


def text(found: list[Section]) -> str:
    """Aligned columns per section, for a terminal."""
    lines = []
    for section in found:
        lines += [f"[{section.name}] {section.about}", f"  ({section.source})" if section.source else ""]
        width = [max(len(getattr(key, column)) for key in section.keys) for column in ("key", "type", "default")]
        for key in section.keys:
            lines.append(f"  {key.key:<{width[0]}}  {key.type:<{width[1]}}  {key.default:<{width[2]}}  {key.meaning}")
        lines.append("")
    return "\n".join(lines)


def markdown(found: list[Section]) -> str:
    """``docs/config.md``: one table per section."""
    count = sum(len(section.keys) for section in found)
    intro = (
        f"Generated from the typed classes by `{MARKDOWN_COMMAND}`; do not edit: `compress config [section]` prints "
        "the same in a terminal, and `tests/compress/test_config_reference.py` fails when this file is stale. A key is "
        "set in a recipe file or as `key=value` on the command line; an unknown key or a wrong type is refused while "
        "composing, with the fix. A key's meaning is the comment beside its field in the class each section names. "
        f"{len(found)} sections, {count} keys."
    )
    lines = ["# Every configuration key", "", textwrap.fill(intro, 120, break_on_hyphens=False), ""]
    lines.append(
        textwrap.fill("Sections: " + ", ".join(f"[{s.name}](#{s.name.replace('.', '')})" for s in found) + ".", 120)
    )
    for section in found:
        source = f" Keys of `{section.source}`." if section.source else ""
        about = textwrap.fill(_prose(section.about) + source, 120, break_on_hyphens=False)
        lines += ["", f"## {section.name}", "", about, "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for key in section.keys:
            cells = (f"`{key.key}`", f"`{key.type}`", f"`{key.default}`", _prose(key.meaning))
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _prose(text: str) -> str:
    """``text`` for Markdown: ``<name>`` outside code spans escaped, so it is shown rather than read as HTML."""
    parts = text.split("`")
    return "`".join(part if index % 2 else part.replace("<", "&lt;") for index, part in enumerate(parts))


def _walk(cls: type, prefix: str, name: str, about: str) -> list[Section]:
    """``cls``'s own keys as one section, then each dataclass-typed field as a section of its own, depth first."""
    hints = typing.get_type_hints(cls)
    nested = [f for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]
    meanings = field_meanings(cls)
    found = [Section(name, about, keys_of(cls, prefix, skip={f.name for f in nested}), _path(cls))]
    for field in nested:
        child = hints[field.name]
        child_about = _sentence(meanings.get(field.name, "")) or _summary(child.__doc__)
        found.extend(_walk(child, f"{prefix}{field.name}.", f"{prefix}{field.name}", child_about))
    return found


def keys_of(cls: type, prefix: str, skip: set[str] = frozenset()) -> list[Key]:
    """``cls``'s fields (inherited ones too) as keys under ``prefix``, less ``skip``."""
    hints, meanings = typing.get_type_hints(cls), field_meanings(cls)
    return [
        Key(f"{prefix}{f.name}", type_name(hints[f.name]), default_of(f), meanings.get(f.name, ""))
        for f in dataclasses.fields(cls)
        if f.name not in skip
    ]


def field_meanings(cls: type) -> dict[str, str]:
    """``{field: meaning}`` of a dataclass and the dataclasses it inherits from (their fields are its keys)."""
    meanings: dict[str, str] = {}
    for owner in reversed(cls.__mro__):
        if dataclasses.is_dataclass(owner) and "__annotations__" in vars(owner):
            meanings.update(_own_meanings(owner))
    return meanings


@cache
def _own_meanings(cls: type) -> dict[str, str]:
    """The comments of the fields ``cls`` itself declares (see the module docstring for where they are read)."""
    source = textwrap.dedent(inspect.getsource(cls))
    trailing: dict[int, str] = {}
    alone: dict[int, str] = {}
    code_lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comment = token.string.lstrip("#").strip()
            if not comment.startswith(PRAGMAS):
                (trailing if token.start[0] in code_lines else alone)[token.start[0]] = comment
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING):
            code_lines.update(range(token.start[0], token.end[0] + 1))
    meanings = {}
    for name, line, last in _field_lines(source):
        beside = [trailing[number] for number in range(line, last + 1) if number in trailing]
        if beside:
            meanings[name] = " ".join(beside)
            continue
        above = []
        while line - 1 - len(above) in alone:
            above.insert(0, alone[line - 1 - len(above)])
        meanings[name] = " ".join(above)
    return meanings


def _field_lines(source: str) -> list[tuple[str, int, int]]:
    """Each field of the class in ``source`` with the first and last line of its statement."""
    (node,) = ast.parse(source).body
    return [
        (item.target.id, item.lineno, item.end_lineno or item.lineno)
        for item in getattr(node, "body", [])
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    ]


def type_name(hint: Any) -> str:
    """``int | null``, ``list[str]``, ``bool | str``; a nested config section by its class name."""
    if hint is type(None):
        return "null"
    if hint is Any:
        return "any"
    origin = typing.get_origin(hint)
    if isinstance(hint, types.UnionType) or origin is typing.Union:
        return " | ".join(type_name(option) for option in typing.get_args(hint))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(arg) for arg in typing.get_args(hint))}]"
    return getattr(hint, "__name__", str(hint))


def default_of(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return "(required)" if field.default == "???" else show(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return show(field.default_factory())
    return "(required)"


def show(value: Any) -> str:
    """A default as YAML writes it; a nested section by the values that differ from its class's defaults."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(show(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {show(item)}" for key, item in value.items()) + "}"
    if dataclasses.is_dataclass(value):
        plain = type(value)()
        changed = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return show({key: item for key, item in changed.items() if item != getattr(plain, key)})
    return '""' if value == "" else str(value)


def _summary(doc: str | None) -> str:
    """A docstring's first paragraph; nothing for the signature ``dataclass`` writes where there is none."""
    if not doc or re.match(r"\w+\(", doc):
        return ""
    return " ".join(doc.strip().split("\n\n", 1)[0].split())


def _sentence(comment: str) -> str:
    """A field comment as a section's line: capitalised, with its full stop."""
    return f"{comment[:1].upper()}{comment[1:].rstrip('.')}." if comment else ""


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
