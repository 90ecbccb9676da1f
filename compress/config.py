"""The run configuration as typed sections, built from the composed Hydra config with key checking.

Hydra composes ``recipes/<recipe>.yaml`` with the ``model/``, ``data/`` and ``gate/`` groups; this module turns the
result into dataclasses and names the valid keys whenever one is misspelled, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, TypeVar

from compress.data import DataSpec
from compress.errors import CompressError
from compress.models import ModelSpec

T = TypeVar("T")


@dataclass
class EvalSpec:
    perplexity: bool = True
    seq_len: int = 512
    batch_size: int = 4
    max_windows: int | None = None
    reference: str | None = None  # "rtn": also evaluate round-to-nearest with the recipe's weight scheme


@dataclass
class OutputSpec:
    dir: str | None = None  # default <artifacts>/runs
    run_name: str | None = None
    save_dtype: str | None = None  # default: the model's dtype


@dataclass
class TrackingSpec:
    enabled: bool = True
    uri: str | None = None  # default $MLFLOW_TRACKING_URI or sqlite:///<artifacts>/mlflow.db
    experiment: str = "compress"


@dataclass
class RunConfig:
    recipe: str
    stages: list[dict]
    model: ModelSpec
    data: DataSpec
    eval: EvalSpec = field(default_factory=EvalSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    tracking: TrackingSpec = field(default_factory=TrackingSpec)
    gate: dict = field(default_factory=dict)
    seed: int = 0
    device: str = "auto"
    calibration_batch_size: int = 8
    raw: dict = field(default_factory=dict)  # the composed config, for the report and MLflow params


def unknown_key_error(where: str, key: str, valid: list[str]) -> CompressError:
    hint = difflib.get_close_matches(key, valid, n=1)
    suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
    return CompressError(f"{where}: unknown key {key!r}{suggestion}; valid keys: {', '.join(valid)}")


def build_section(cls: type[T], values: dict | None, where: str) -> T:
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in values or {}:
        if key not in valid:
            raise unknown_key_error(where, key, valid)
    return cls(**(values or {}))


SECTIONS = {"model": ModelSpec, "data": DataSpec, "eval": EvalSpec, "output": OutputSpec, "tracking": TrackingSpec}
SCALARS = ("recipe", "stages", "gate", "seed", "device", "calibration_batch_size")


def build_run_config(composed: dict[str, Any]) -> RunConfig:
    valid = [*SCALARS, *SECTIONS]
    for key in composed:
        if key not in valid:
            raise unknown_key_error("config", key, valid)
    if not composed.get("recipe"):
        raise CompressError("the recipe file must set `recipe: <name>`")
    stages = composed.get("stages") or []
    if not stages:
        raise CompressError(f"recipe {composed['recipe']!r} has no stages")
    sections = {name: build_section(cls, composed.get(name), name) for name, cls in SECTIONS.items()}
    scalars = {key: composed[key] for key in SCALARS if key in composed}
    scalars["gate"] = scalars.get("gate") or {}
    return RunConfig(**scalars, **sections, raw=composed)
