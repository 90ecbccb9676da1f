"""Where the jobs of a ``-m`` sweep run: ``hydra/launcher=basic`` (the default: one after another in this
process), ``submitit_local`` (each job a process of its own on this machine, all at once) or ``submitit_slurm``
(each job a Slurm job), the last two through submitit, as Hydra's submitit launcher plugin names them.

``hydra.launcher.<key>=<value>`` sets submitit's parameters: ``timeout_min``, ``mem_gb``, ``nodes``,
``cpus_per_task``, ``gpus_per_node``, ``tasks_per_node``, ``name`` as they are, anything else for the cluster
(``hydra.launcher.partition=gpu`` → ``slurm_partition``), and ``submitit_folder`` for the job logs (default
``<artifacts>/sweeps/<time>/.submitit/%j``). Each job receives the ``RunConfig`` composed for it in this process,
pickled, so it is composed once; its outcome comes back the same way.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from compress.base.errors import CompressError
from compress.base.paths import artifacts_dir

LAUNCHERS = ("basic", "submitit_local", "submitit_slurm")
GENERIC = ("timeout_min", "mem_gb", "nodes", "cpus_per_task", "gpus_per_node", "tasks_per_node", "name")


@dataclass
class Outcome:
    """How one job ended: its exit code and the line the sweep summary shows."""

    job: int  # the job's number in the sweep (0 for a single run)
    exit_code: int
    line: str


@dataclass
class Launcher:
    name: str = "basic"
    parameters: dict[str, Any] = field(default_factory=dict)


def split_launcher(overrides: list[str]) -> tuple[Launcher, list[str]]:
    """``(the launcher, the other overrides)`` from ``hydra/launcher=<name>`` and ``hydra.launcher.<key>=<value>``."""
    launcher, rest = Launcher(), []
    for override in overrides:
        key, _, value = override.partition("=")
        if key == "hydra/launcher":
            if value not in LAUNCHERS:
                raise CompressError(
                    f"hydra/launcher={value} is not a known launcher; available: {', '.join(LAUNCHERS)}"
                )
            launcher.name = value
        elif key.startswith("hydra.launcher."):
            launcher.parameters[key.removeprefix("hydra.launcher.")] = yaml.safe_load(value)
        else:
            rest.append(override)
    if launcher.parameters and launcher.name == "basic":
        raise CompressError("hydra.launcher.* options need hydra/launcher=submitit_local or submitit_slurm")
    return launcher, rest


def executor_for(launcher: Launcher):
    """A submitit executor with the launcher's parameters; a bad parameter is one line, before any job starts."""
    import submitit

    cluster = launcher.name.removeprefix("submitit_")
    parameters = dict(launcher.parameters)
    folder = parameters.pop("submitit_folder", None)
    if folder is None:
        folder = artifacts_dir() / "sweeps" / time.strftime("%Y%m%d-%H%M%S") / ".submitit" / "%j"
    try:
        executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
        executor.update_parameters(**{k if k in GENERIC else f"{cluster}_{k}": v for k, v in parameters.items()})
    except (NameError, ValueError, TypeError, RuntimeError) as error:
        raise CompressError(f"hydra/launcher={launcher.name}: {str(error).strip().splitlines()[0]}") from None
    return executor


def submit(executor, run_job: Callable[[Any, int], Outcome], configs: list) -> list[Outcome]:
    """Every job submitted at once, then each one's outcome as it returns; a job that crashed or was killed is a
    failure and the others are still collected."""
    jobs = [executor.submit(run_job, config, number) for number, config in enumerate(configs)]
    print(f"submitted {len(jobs)} jobs; logs in {jobs[0].paths.folder}")
    outcomes = []
    for number, job in enumerate(jobs):
        try:
            outcomes.append(job.result())
        except Exception as error:  # noqa: BLE001 - one job's failure must not lose the others' outcomes
            traceback.print_exc()
            line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            outcomes.append(Outcome(number, 1, f"{type(error).__name__}: {line} (log {job.paths.stderr})"))
    return outcomes
