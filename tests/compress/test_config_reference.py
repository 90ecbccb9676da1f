"""One reference of every configuration key (``compress config``, ``docs/config.md``), read from the typed classes,
and the gate's engine options typed like every other section, so the schema refuses a typo while composing."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from compress.__main__ import main
from compress.app.run_config import RunConfig
from compress.base.errors import CompressError
from compress.base.typed import typed
from compress.commands.config_reference import (
    MARKDOWN_COMMAND,
    Section,
    field_meanings,
    keys_of,
    markdown,
    missing_meanings,
    sections,
)
from compress.evals.gate import resolve_policy
from compress.stages import STAGES

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"gate": {"engine": {"max_num_seq": 4}}},
            "gate.engine: unknown key 'max_num_seq' (did you mean 'max_num_seqs'?)",
        ),
        ({"gate": {"engine": {"block_size": "sixteen"}}}, "gate.engine.block_size='sixteen' has the wrong type"),
        ({"gate": {"engine": {"block_size": 24}}}, "gate.engine: block_size=24 must be a power of two"),
    ],
)
def test_the_schema_refuses_a_bad_gate_engine_key_while_composing(values, message):
    """The run schema itself (what Hydra composes against), not a check after it."""
    with pytest.raises(CompressError) as error:
        typed(RunConfig, {"recipe": "rtn_int4", **values})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_engine_kv_cache_dtype_is_the_gates_own_key():
    """Two keys for one setting: the engine's would reach the engine beside the gate's and crash there."""
    with pytest.raises(CompressError, match="set gate.kv_cache_dtype=int8"):
        resolve_policy({"engine": {"kv_cache_dtype": "int8"}})


def test_docs_config_md_is_the_generated_reference():
    written = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    assert written == markdown(sections()), f"docs/config.md is stale: run `{MARKDOWN_COMMAND}`"


def test_every_key_says_what_it_does():
    found = sections()
    assert not missing_meanings(found), f"give each field a comment beside it: {missing_meanings(found)}"
    assert all(section.about for section in found)


def test_the_reference_lists_every_key_the_run_schema_accepts():
    """Read from OmegaConf's view of the schema (what Hydra composes against), not from the reference's own walk."""
    found = sections()
    listed = {
        key.key for section in found if not section.name.startswith(("stages.", "search")) for key in section.keys
    }

    def leaves(node: object, prefix: str = "") -> set[str]:
        if not isinstance(node, dict) or prefix.rstrip(".") in listed:
            return {prefix.rstrip(".")}
        return set().union(*(leaves(value, f"{prefix}{key}.") for key, value in node.items()))

    accepted = leaves(OmegaConf.to_container(OmegaConf.structured(RunConfig)))
    assert accepted == listed
    assert {"gate.engine.max_num_seqs", "gate.perplexity.max_ratio", "eval.data"} <= listed
    assert {section.name for section in found if section.name.startswith("stages.")} == {f"stages.{s}" for s in STAGES}
    gptq = next(section for section in found if section.name == "stages.gptq")
    assert {"stages.<i>.bits", "stages.<i>.dampening"} <= {key.key for key in gptq.keys}  # its own and inherited


@dataclass
class _Base:
    inherited: int = 1  # said in the base class


@dataclass
class _Toy(_Base):
    short: bool = True  # said on its line
    # said above it, when it does not fit
    # on one line
    long: list[str] = field(default_factory=lambda: ["a"])
    silent: float | None = None  # fmt: skip
    required: str = "???"


def test_a_field_means_the_comment_beside_it_or_the_block_above():
    assert field_meanings(_Toy) == {
        "inherited": "said in the base class",
        "short": "said on its line",
        "long": "said above it, when it does not fit on one line",
        "silent": "",
        "required": "",
    }
    toy = Section("toy", "a toy", keys_of(_Toy, "toy."))
    assert missing_meanings([toy]) == ["toy.silent", "toy.required"]
    assert [(key.type, key.default) for key in toy.keys][1:] == [
        ("bool", "true"),
        ("list[str]", "[a]"),
        ("float | null", "null"),
        ("str", "(required)"),
    ]


def test_the_command_shows_a_section_a_key_or_names_the_closest(capsys):
    assert main(["config", "gate.engine"]) == 0
    shown = capsys.readouterr().out
    assert "gate.engine.max_num_seqs" in shown and "gate.perplexity" not in shown
    assert main(["config", "stages.gptq"]) == 0
    assert "stages.<i>.dampening" in capsys.readouterr().out
    assert main(["config", "gate.perplexity.max_ratio"]) == 0
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("  gate.")]) == 1
    assert main(["config", "gate.engin"]) == 2
    assert "no section or key 'gate.engin' (did you mean 'gate.engine'?)" in capsys.readouterr().err
