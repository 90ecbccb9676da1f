"""The run configuration: one schema, registered in Hydra's ConfigStore, validated before any work.

Hydra composes ``recipes/<recipe>.yaml`` (whose ``_base`` lists ``run_schema`` first) with the ``model/``, ``data/``
and ``gate/`` groups, so a value of the wrong type is refused while composing. The stages are a list of different
kinds, which a structured config cannot type; each stage's arguments are checked against that stage's config
dataclass, also kept in the ConfigStore (group ``stage``). ``build_run_config`` then checks what types cannot say
(positive sizes, path-safe names, a writable output folder, the gate policy) so that a doomed run fails in the first
second with one line naming the key and the fix, before a model is loaded or a run folder exists.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from compress.base.data import SOURCES, DataSpec, out_of_domain
from compress.base.errors import CompressError, EnvironmentFailure, unknown_key_error
from compress.base.paths import artifacts_dir
from compress.base.typed import config_error, typed
from compress.evals.gate import GatePolicy
from compress.model.sources import ModelSpec

T = TypeVar("T")

SAVE_DTYPES = ("float16", "bfloat16", "float32")
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?|mps")
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")


@dataclass
class EvalSpec:
    perplexity: bool = True  # score perplexity of the baseline and the compressed model (the headline figure)
    seq_len: int = 512  # tokens per evaluation window
    batch_size: int = 4  # windows per forward pass
    max_windows: int | None = None  # windows scored per text (null: every window of the held-out split)
    reference: str | None = None  # "rtn": also evaluate round-to-nearest with the recipe's weight scheme
    # The headline evaluation text: another source than the calibration data, whose held-out split is reported beside
    # it as the in-domain figure. None: the in-domain split is the only evaluation (labelled so).
    data: DataSpec | None = field(default_factory=out_of_domain)


@dataclass
class OutputSpec:
    dir: str | None = None  # default <artifacts>/runs
    run_name: str | None = None  # names the run folder <time>-<run_name>-<id> (null: the recipe); letters, digits, ._-
    save_dtype: str | None = None  # float16 | bfloat16 | float32 (null: the model's dtype)


@dataclass
class PlanSpec:
    enforce: bool = True  # refuse a run, before any work, when free disk or available RAM is below the plan


@dataclass
class TrackingSpec:
    enabled: bool = True  # log params, metrics and the checkpoint to MLflow
    uri: str | None = None  # default $MLFLOW_TRACKING_URI or sqlite:///<artifacts>/mlflow.db
    experiment: str = "compress"  # the MLflow experiment the run is logged in


@dataclass
class RunConfig:
    """The one run configuration: Hydra's schema (``run_schema`` in the ConfigStore, listed first in every recipe's
    defaults, so a wrong type is refused while composing) and, through ``OmegaConf.to_object`` of the composed
    recipe, the typed object the pipeline reads. ``build_run_config`` adds the checks types cannot express."""

    recipe: str = "???"  # recipes/<recipe>.yaml: its name labels the run, its checkpoint and its MLflow run
    stages: list[Any] = field(default_factory=list)  # each checked against its stage's config (group ``stage``)
    model: ModelSpec = field(default_factory=ModelSpec)  # the model to compress (``model=<name>``: recipes/model/)
    data: DataSpec = field(default_factory=DataSpec)  # the calibration text and its held-out split (``data=<name>``)
    eval: EvalSpec = field(default_factory=EvalSpec)  # perplexity before and after, on the headline evaluation text
    output: OutputSpec = field(default_factory=OutputSpec)  # where the run folder and checkpoint go
    tracking: TrackingSpec = field(default_factory=TrackingSpec)  # MLflow logging of the run
    gate: GatePolicy = field(default_factory=GatePolicy)  # the release gate's policy (``gate=<name>``: recipes/gate/)
    plan: PlanSpec = field(default_factory=PlanSpec)  # the pre-flight plan of RAM, disk and time
    resume: bool = True  # keep the layer walk's progress so the same command continues after a crash
    seed: int = 0  # picks the calibration windows (stages with randomness have their own seed key)
    device: str = "auto"  # where the layer walk computes: auto (cuda if visible, else cpu), cpu, cuda, cuda:N, mps
    calibration_batch_size: int = 8  # calibration windows per forward pass of the layer walk

    @property
    def raw(self) -> dict[str, Any]:
        """The configuration as plain data, for the report, the checkpoint's ``config.yaml`` and MLflow params."""
        return dataclasses.asdict(self)


def register_schema() -> None:
    """Put the run schema and every stage's config into Hydra's ConfigStore (before Hydra composes a recipe)."""
    from hydra.core.config_store import ConfigStore

    from compress.stages import STAGES

    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for name, stage in STAGES.items():
        store.store(group="stage", name=name, node=stage.Config)


def build_section(cls: type[T], values: dict | None, where: str) -> T:
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in values or {}:
        if key not in valid:
            raise unknown_key_error(where, key, valid)
    return cls(**(values or {}))


def check_stage_types(stages: list) -> None:
    """Each stage's arguments against its config dataclass in the ConfigStore (unknown keys: ``build_chain``)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    store = ConfigStore.instance()
    if "stage" not in store.list(""):
        register_schema()  # called outside the CLI (tests, notebooks)
    for position, args in enumerate(stages):
        if not isinstance(args, dict):
            raise CompressError(f"stages.{position} must be a mapping with `type: <stage>`, not {args!r}")
        kind = args.get("type")
        if not isinstance(kind, str) or f"{kind}.yaml" not in store.list("stage"):
            continue  # build_chain names the known types
        schema = store.load(f"stage/{kind}.yaml").node
        known = {key: value for key, value in args.items() if key in schema}
        try:
            OmegaConf.to_object(OmegaConf.merge(schema, known))
        except OmegaConfBaseException as error:
            raise config_error(error, f"stages.{position}") from None
        except (TypeError, ValueError) as error:  # a config's own __post_init__ checks
            raise CompressError(f"stages.{position} ({kind}): {error}") from None


def _at_least(key: str, value: int | None, minimum: int) -> None:
    if value is not None and value < minimum:
        raise CompressError(f"{key}={value} must be ≥ {minimum}")


def check_values(config: RunConfig) -> None:
    """What the types cannot say: positive sizes, known choices, path-safe names, a writable output folder."""
    _at_least("calibration_batch_size", config.calibration_batch_size, 1)
    _at_least("data.num_samples", config.data.num_samples, 1)
    _at_least("data.seq_len", config.data.seq_len, 2)
    _at_least("eval.seq_len", config.eval.seq_len, 2)
    _at_least("eval.batch_size", config.eval.batch_size, 1)
    _at_least("eval.max_windows", config.eval.max_windows, 1)
    if not DEVICE.fullmatch(config.device):
        raise CompressError(f"device={config.device!r} is unknown; use auto, cpu, cuda or cuda:N")
    _check_data(config.data, "data")
    if config.eval.data is not None:
        _check_data(config.eval.data, "eval.data")
        if _same_text(config.eval.data, config.data):
            raise CompressError(
                "eval.data is the calibration source itself: its held-out split is already reported as the in-domain "
                "figure; give eval.data another source, or eval.data=null for in-domain only"
            )
    if config.output.save_dtype not in (None, *SAVE_DTYPES):
        raise CompressError(
            f"output.save_dtype={config.output.save_dtype!r} is not supported; "
            f"use one of {', '.join(SAVE_DTYPES)} (or null to keep the model's dtype)"
        )
    name = config.output.run_name
    if name is not None and not SAFE_NAME.fullmatch(name):
        raise CompressError(
            f"output.run_name={name!r} names a folder: use letters, digits, '.', '_' and '-' only "
            "(not starting with '.' or '-')"
        )
    check_writable(config.output.dir)
    check_model_context(config)


def check_writable(output_dir: str | None) -> None:
    """The runs folder, or the closest folder above it that exists, must be one we can write into."""
    folder = Path(output_dir).expanduser() if output_dir else artifacts_dir() / "runs"
    existing = next(parent for parent in (folder, *folder.parents) if parent.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        key = "output.dir" if output_dir else "$COMPRESS_ARTIFACTS"
        raise EnvironmentFailure(
            f"{key}: cannot write run folders under {folder} ({existing} is not a writable folder); "
            "point it at a folder you can write"
        )


def check_gate(gate: GatePolicy) -> None:
    """What the gate policy's types cannot say (its backend and engine options, its layer names), now rather than
    after the compression."""
    from compress.evals.gate import resolve_policy

    try:
        resolve_policy(gate)
    except CompressError as error:
        raise CompressError(" ".join(str(error).split())) from None


def check_model_context(config: RunConfig) -> None:
    """Windows longer than the model's context give garbage or an index error; a local model's config.json says
    its context without loading anything."""
    config_file = Path(config.model.path).expanduser() / "config.json"
    if not config_file.is_file():
        return  # the default model before its conversion, or a hub id: checked when tokenized
    try:
        model_config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return  # the model load reports a broken config.json
    context = next((model_config[key] for key in CONTEXT_KEYS if isinstance(model_config.get(key), int)), None)
    if context is None:
        return
    for key, length in (("data.seq_len", config.data.seq_len), ("eval.seq_len", config.eval.seq_len)):
        if length > context:
            raise CompressError(
                f"{key}={length} is longer than the model's context ({context} tokens); set {key}≤{context}"
            )


def _check_data(spec: DataSpec, key: str) -> None:
    if spec.source not in SOURCES:
        raise CompressError(f"{key}.source={spec.source!r} is unknown; use {', '.join(SOURCES)}")
    if not 0.0 < spec.eval_fraction < 1.0:
        raise CompressError(f"{key}.eval_fraction={spec.eval_fraction} must be between 0 and 1")
    if not 0.0 <= spec.generated <= 1.0:
        raise CompressError(f"{key}.generated={spec.generated} must be a share between 0 and 1 of data.num_samples")
    if spec.source == "file" and spec.path and not Path(spec.path).expanduser().is_file():
        raise CompressError(f"{key}.path={spec.path}: no such file; give a .txt or .jsonl file")


def _same_text(first: DataSpec, second: DataSpec) -> bool:
    where = ("source", "path", "name", "subset", "split", "text_field")
    return all(getattr(first, key) == getattr(second, key) for key in where)


def check_evaluation_length(evaluation_tokens: int, config: RunConfig, key: str = "data") -> None:
    """The perplexity protocol needs one window of ``eval.seq_len`` tokens; known once the text is tokenized,
    which is before the baseline evaluation and the compression. ``key``: the data section the text comes from."""
    if config.eval.perplexity and evaluation_tokens < config.eval.seq_len:
        raise CompressError(
            f"eval.seq_len={config.eval.seq_len} is longer than the evaluation text of {key} ({evaluation_tokens} "
            f"tokens); set eval.seq_len≤{evaluation_tokens}, give more text, or raise {key}.eval_fraction"
        )


def build_run_config(composed: Any) -> RunConfig:
    """The typed run configuration of a composed recipe (Hydra's ``DictConfig`` or plain data), with everything
    checkable before the model load checked."""
    from compress.stages import build_chain

    config = typed(RunConfig, composed)
    if not config.stages:
        raise CompressError(f"recipe {config.recipe!r} has no stages")
    check_values(config)
    check_stage_types(config.stages)
    build_chain(config.stages)  # unknown stage keys and illegal orders
    check_gate(config.gate)
    return config
