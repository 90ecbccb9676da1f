"""``python -m compress run recipe=<name> [overrides] [-m]``: Hydra composes the recipe, the pipeline runs it.

Before Hydra sees the command line we resolve shortcuts (``model=<folder or hub id>``, ``data=<file or dataset>``)
and check every override key against the composed recipe, so a typo is reported with the valid keys instead of
Hydra's generic struct error. Keys a stage accepts but its recipe file leaves at the default are added for you.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from compress.errors import CompressError
from compress.paths import recipes_dir

GROUPS = ("model", "data", "gate")
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "-i"}
OUTCOMES_ENV = "COMPRESS_JOB_OUTCOMES"  # the folder where each job of this command records how it ended


def available(group: str | None = None) -> list[str]:
    folder = recipes_dir() / group if group else recipes_dir()
    return sorted(p.stem for p in folder.glob("*.yaml") if not p.name.startswith("_"))


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """Hydra flags (``-m``, ``--cfg job`` ...) and ``key=value`` overrides."""
    flags, overrides = [], []
    tokens = iter(argv)
    for token in tokens:
        if token.startswith("-"):
            flags.append(token)
            if token in HYDRA_FLAGS_WITH_VALUE:
                flags.append(next(tokens, ""))
        else:
            overrides.append(token)
    return flags, overrides


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def resolve_shortcuts(overrides: list[str]) -> list[str]:
    """``model=/some/folder`` → ``model=hf model.path=/some/folder``; likewise ``data=`` for files and datasets."""
    resolved = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key in ("model", "data") and value and "," not in value and value not in available(key):
            if key == "model":
                resolved += ["model=hf", f"model.path={value}"]
            elif Path(value).expanduser().is_file():
                resolved += ["data=file", f"data.path={value}"]
            else:
                resolved += ["data=hf", f"data.name={value}"]
        else:
            resolved.append(override)
    return resolved


def _stage_keys(stage: dict) -> list[str] | None:
    from compress.stages import STAGES

    kind = STAGES.get(stage.get("type"))
    return None if kind is None else ["type", *kind.valid_keys()]


def check_overrides(recipe: str, overrides: list[str]) -> list[str]:
    """Raise on unknown keys (naming the valid ones); return overrides with stage defaults made appendable."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from compress.config import unknown_key_error

    group_choices = []
    for override in overrides:
        key = _key(override)
        if key in GROUPS:
            for choice in override.split("=", 1)[1].split(","):
                if choice not in available(key):
                    raise CompressError(f"{key}={choice} is not a known option; available: {', '.join(available(key))}")
            group_choices.append(override.split(",")[0])
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
        composed = OmegaConf.to_container(compose(config_name=recipe, overrides=group_choices), resolve=False)

    checked = []
    for override in overrides:
        key = _key(override)
        if key in GROUPS or key.startswith("hydra") or override.startswith(("+", "~")):
            checked.append(override)
            continue
        node, path = composed, []
        for part in key.split("."):
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise CompressError(f"{key}: {'.'.join(path)} has {len(node)} entries (0..{len(node) - 1})")
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                where = ".".join(path) or "config"
                stage_keys = _stage_keys(node) if path[:1] == ["stages"] and isinstance(node, dict) else None
                if stage_keys is not None and part in stage_keys and len(path) == 2:
                    override = "+" + override  # a stage argument the recipe file leaves at its default
                    break
                if path[:2] == ["gate", "engine"]:
                    override = "+" + override  # free-form compress.engine.EngineConfig options
                    break
                valid = stage_keys if stage_keys is not None else list(node) if isinstance(node, dict) else []
                raise unknown_key_error(where, part, valid)
            path.append(part)
        checked.append(override)
    return checked


@dataclass
class Outcome:
    """How one job ended, written where the parent process can read it (joblib jobs run in other processes)."""

    job: int  # Hydra's job number (0 for a single run)
    exit_code: int
    line: str


def compose_job(recipe: str, overrides: list[str]) -> dict:
    """The composed config of one job, type-checked against the run schema; Hydra's errors become one line."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from compress.config import config_error

    try:
        with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
            cfg = compose(config_name=recipe, overrides=overrides)
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingConfigException as error:
        options = f"; available: {', '.join(error.options)}" if error.options else ""
        raise CompressError(str(error).strip().splitlines()[0] + options) from None
    except (HydraException, OmegaConfBaseException) as error:
        raise config_error(error) from None


def job_overrides(overrides: list[str], multirun: bool) -> list[list[str]]:
    """Every job's overrides: one job, or Hydra's basic sweep (the cartesian product of the sweep values)."""
    if not multirun:
        return [overrides]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as error:
        raise CompressError(str(error).strip().splitlines()[0]) from None
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def prepare_tracking(configs: list) -> None:
    """Create (and migrate) each MLflow store and experiment once, before parallel jobs race to do it: two fresh
    processes migrating one sqlite file fail with "table _alembic_tmp_metrics already exists"."""
    from mlflow.tracking import MlflowClient

    from compress.tracking import experiment_id, tracking_uri

    for uri, experiment in {
        (tracking_uri(c.tracking.uri), c.tracking.experiment) for c in configs if c.tracking.enabled
    }:
        experiment_id(MlflowClient(tracking_uri=uri), experiment)


def _run_job(cfg, job: int) -> Outcome:
    from omegaconf import OmegaConf

    from compress.config import build_run_config
    from compress.pipeline import run
    from compress.report import gate_details, summary_lines, verdict_line

    try:
        config = build_run_config(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))
        result = run(config)
    except CompressError as error:
        print(f"error: {error}", file=sys.stderr)
        return Outcome(job, 1, f"error: {error}")
    print("\n" + "\n".join(summary_lines(result.report)))
    print(f"\nrun folder: {result.run_dir}")
    if result.mlflow_run_id:
        print(f"MLflow run: {result.mlflow_run_id} (browse with `mlflow ui --backend-store-uri {config_uri(config)}`)")
    gate = result.report.get("gate")
    if gate is None:
        return Outcome(job, 0, f"run folder: {result.run_dir}")
    enforce = bool(config.gate.get("enforce", False))
    line = verdict_line(gate, enforce)
    print("\n".join([*gate_details(gate), line]))
    return Outcome(job, 1 if enforce and not gate["passed"] else 0, line)


def _task(cfg) -> None:
    """One Hydra job. It never raises SystemExit, which would stop a sweep: it records how it ended instead."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    job = int(OmegaConf.select(HydraConfig.get(), "job.num", default=0, throw_on_missing=False) or 0)
    try:
        outcome = _run_job(cfg, job)
    except BaseException as error:  # a bug: recorded as a failure, then Hydra reports it after the other jobs
        _record(Outcome(job, 1, f"{type(error).__name__}: {error}"))
        raise
    _record(outcome)


def _record(outcome: Outcome) -> None:
    folder = os.environ.get(OUTCOMES_ENV)
    if folder:
        (Path(folder) / f"{uuid.uuid4().hex}.json").write_text(json.dumps(dataclasses.asdict(outcome)))


def _outcomes(folder: Path) -> list[Outcome]:
    return [Outcome(**json.loads(path.read_text())) for path in sorted(folder.glob("*.json"))]


def config_uri(config) -> str:
    from compress.tracking import tracking_uri

    return tracking_uri(config.tracking.uri)


def validate(recipe: str, overrides: list[str], multirun: bool) -> tuple[list[str], list[list[str]], list]:
    """Every job's configuration, checked before the first job starts: the overrides to hand to Hydra (key-checked,
    stage defaults made appendable), each job's own overrides, and each job's ``RunConfig``."""
    from compress.config import build_run_config, register_schema
    from compress.models import check_model_source

    register_schema()
    overrides = check_overrides(recipe, resolve_shortcuts(overrides))
    jobs, configs = job_overrides(overrides, multirun), []
    for job in jobs:
        config = build_run_config(compose_job(recipe, job))
        check_model_source(config.model)
        configs.append(config)
    return overrides, jobs, configs


def sweep_labels(jobs: list[list[str]]) -> list[str]:
    """Each job named by the overrides that set it apart from the other jobs."""
    return [" ".join(o for o in job if not all(o in other for other in jobs)) or "(no varying key)" for job in jobs]


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    flags, overrides = split_arguments(argv)
    multirun = bool({"-m", "--multirun"} & set(flags))
    recipes = [o for o in overrides if o.startswith("recipe=")]
    overrides = [o for o in overrides if not o.startswith("recipe=")]
    try:
        if not recipes:
            raise CompressError(f"choose a recipe: recipe=<name>; available: {', '.join(available())}")
        recipe = recipes[-1].split("=", 1)[1]
        if recipe not in available():
            raise CompressError(f"unknown recipe {recipe!r}; available: {', '.join(available())}")
        overrides, jobs, configs = validate(recipe, overrides, multirun)
        if multirun:
            prepare_tracking(configs)
    except CompressError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1

    import hydra

    entry = hydra.main(version_base="1.3", config_path=None, config_name=None)(_task)
    saved_argv, saved_env = sys.argv, os.environ.get(OUTCOMES_ENV)
    sys.argv = ["compress", f"--config-dir={recipes_dir()}", f"--config-name={recipe}", *flags, *overrides]
    with tempfile.TemporaryDirectory(prefix="compress-outcomes-") as folder:
        os.environ[OUTCOMES_ENV] = folder
        code = 0
        try:
            entry()
        except SystemExit as exit_:  # Hydra's own usage errors, and a job's unexpected exception
            code = exit_.code if isinstance(exit_.code, int) else 1
        finally:
            sys.argv = saved_argv
            if saved_env is None:
                os.environ.pop(OUTCOMES_ENV, None)
            else:
                os.environ[OUTCOMES_ENV] = saved_env
        outcomes = _outcomes(Path(folder))
    if multirun and outcomes:
        labels = sweep_labels(jobs)
        print(f"\nsweep: {len(outcomes)} of {len(jobs)} jobs ran")
        for outcome in sorted(outcomes, key=lambda outcome: outcome.job):
            label = labels[outcome.job] if outcome.job < len(labels) else f"job {outcome.job}"
            print(f"  #{outcome.job} {label}: {outcome.line}")
    return max([code, *(outcome.exit_code for outcome in outcomes)])
