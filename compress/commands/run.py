"""``python -m compress run recipe=<name> [key=value ...] [-m] [--cfg job]``: compose the recipe, run the pipeline.

Each job's configuration is composed once, by Hydra's compose API against the run schema, and checked before the
first job starts; that checked ``RunConfig`` is what runs. ``-m`` sweeps comma-separated values as Hydra's basic
sweeper does (the cartesian product, jobs one after another, or all at once with
``hydra/launcher=submitit_local|submitit_slurm``: ``compress.commands.launch``); ``--cfg job`` prints each job's
configuration and runs nothing. Under ``torchrun --nproc-per-node N`` the ranks calibrate one job together
(``compress.base.distributed``). Shortcuts (``model=<folder or hub id>``, ``data=<file or dataset>``) are resolved
first, and stage arguments the recipe file leaves at their defaults are made settable. Exit status: 0 when every
job finished (whatever the gate said), unless ``gate.enforce=true``: then 1 on BLOCK, 3 on INCONCLUSIVE; 1 on an
error.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import TYPE_CHECKING

from compress.app.recipe import available, check_overrides, compose_job, resolve_shortcuts
from compress.base.errors import CompressError, ExitCode
from compress.commands.exits import command_exits, exit_code_of
from compress.commands.launch import Outcome, executor_for, split_launcher, submit

if TYPE_CHECKING:
    from compress.app.run_config import RunConfig

MULTIRUN_FLAGS = {"-m", "--multirun"}
PRINT_FLAGS = {"--cfg", "-c"}  # followed by `job`: print each job's configuration


def split_arguments(argv: list[str]) -> tuple[bool, bool, list[str]]:
    """``(multirun, print_only, overrides)``: the flags ``-m`` and ``--cfg job``, and the ``key=value`` overrides."""
    multirun, print_only, overrides = False, False, []
    tokens = iter(argv)
    for token in tokens:
        if token in MULTIRUN_FLAGS:
            multirun = True
        elif token in PRINT_FLAGS:
            if next(tokens, None) != "job":
                raise CompressError(f"{token} takes `job`: {token} job prints each job's configuration")
            print_only = True
        elif token.startswith("-"):
            raise CompressError(f"unknown flag {token!r}; use -m (sweep comma-separated values) or --cfg job")
        else:
            overrides.append(token)
    return multirun, print_only, overrides


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


def _run_job(config: RunConfig, job: int) -> Outcome:
    from compress.app.pipeline import run
    from compress.app.run_report import VERDICT_EXIT_CODES, gate_details, summary_lines, verdict_line

    try:
        result = run(config)
    except CompressError as error:
        print(f"error: {error}", file=sys.stderr)
        return Outcome(job, int(exit_code_of(error)), f"error: {error}")
    if result is None:  # a data-parallel rank other than 0: its calibration shard is done
        return Outcome(job, 0, "calibration shard done")
    print("\n" + "\n".join(summary_lines(result.report)))
    print(f"\nrun folder: {result.run_dir}")
    if result.mlflow_run_id:
        print(f"MLflow run: {result.mlflow_run_id} (browse with `mlflow ui --backend-store-uri {config_uri(config)}`)")
    gate = result.report.get("gate")
    if gate is None:
        return Outcome(job, 0, f"run folder: {result.run_dir}")
    enforce = config.gate.enforce
    line = verdict_line(gate, enforce)
    print("\n".join([*gate_details(gate), line]))
    return Outcome(job, VERDICT_EXIT_CODES[gate["verdict"]] if enforce else 0, line)


def config_uri(config) -> str:
    from compress.app.tracking import tracking_uri

    return tracking_uri(config.tracking.uri)


def validate(recipe: str, overrides: list[str], multirun: bool) -> tuple[list[list[str]], list[RunConfig]]:
    """Every job's overrides and its composed, checked ``RunConfig``, all before the first job starts."""
    from compress.app.run_config import register_schema
    from compress.model.sources import check_model_source

    register_schema()
    jobs = job_overrides(check_overrides(recipe, resolve_shortcuts(overrides)), multirun)
    configs = [compose_job(recipe, job) for job in jobs]
    for config in configs:
        check_model_source(config.model)
    return jobs, configs


def sweep_labels(jobs: list[list[str]]) -> list[str]:
    """Each job named by the overrides that set it apart from the other jobs."""
    return [" ".join(o for o in job if not all(o in other for other in jobs)) or "(no varying key)" for job in jobs]


def run_jobs(configs: list[RunConfig], multirun: bool, executor=None) -> list[Outcome]:
    """Each job in turn, as Hydra's basic launcher runs a sweep, or all at once through submitit
    (``compress.commands.launch``): a job's unexpected exception is reported and recorded as a failure, and the
    sweep goes on."""
    if not multirun:
        return [_run_job(configs[0], 0)]
    if executor is not None:  # a submitit launcher
        return submit(executor, _run_job, configs)
    outcomes = []
    for job, config in enumerate(configs):
        try:
            outcomes.append(_run_job(config, job))
        except Exception as error:  # noqa: BLE001 - a bug in one job must not stop the others
            traceback.print_exc()
            outcomes.append(Outcome(job, int(ExitCode.FAILED), f"{type(error).__name__}: {error}"))
    return outcomes


@command_exits
def main(argv: list[str]) -> int:
    from omegaconf import OmegaConf

    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    from compress.base import distributed

    parallel = distributed.init()  # under torchrun: every rank runs this, rank 0 alone saves and records
    level = logging.INFO if distributed.is_main() else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        multirun, print_only, overrides = split_arguments(argv)
        launcher, overrides = split_launcher(overrides)
        if launcher.name != "basic" and not multirun:
            raise CompressError(f"hydra/launcher={launcher.name} launches the jobs of a sweep; add -m")
        if parallel and multirun:
            raise CompressError("-m under torchrun: start one torchrun per job (the ranks calibrate one job together)")
        recipes = [o for o in overrides if o.startswith("recipe=")]
        overrides = [o for o in overrides if not o.startswith("recipe=")]
        if not recipes:
            raise CompressError(f"choose a recipe: recipe=<name>; available: {', '.join(available())}")
        recipe = recipes[-1].split("=", 1)[1]
        if recipe not in available():
            raise CompressError(f"unknown recipe {recipe!r}; available: {', '.join(available())}")
        jobs, configs = validate(recipe, overrides, multirun)
        # a bad launcher parameter fails here, before the first job
        executor = executor_for(launcher) if launcher.name != "basic" and not print_only else None
        if print_only:
            for label, config in zip(sweep_labels(jobs), configs, strict=True):
                print(f"# {label}\n" if multirun else "", OmegaConf.to_yaml(config.raw), sep="", end="")
            return 0
    except CompressError as error:
        print(f"error: {error}", file=sys.stderr)
        return int(exit_code_of(error))
    outcomes = run_jobs(configs, multirun, executor)
    distributed.shutdown()
    if multirun:
        labels = sweep_labels(jobs)
        print(f"\nsweep: {len(outcomes)} of {len(jobs)} jobs ran")
        for outcome in outcomes:
            print(f"  #{outcome.job} {labels[outcome.job]}: {outcome.line}")
    return max(outcome.exit_code for outcome in outcomes)
