"""A job's configuration from a recipe name (or file, or stage list) and ``key=value`` overrides: the one place
both the library (``compress.oneshot``) and the command line (``python -m compress run``) compose a recipe, so the
same files, checks and one-line errors apply to both.

Hydra composes ``recipes/<recipe>.yaml`` with the ``model/``, ``data/`` and ``gate/`` groups against the run schema
(``compress.app.run_config``); the recipe's name (run id, ``recipe.yaml``, MLflow tag, report) is its file name, so a
copied file names its runs by itself (a ``recipe:`` key that says otherwise is refused); shortcuts (``model=<folder or
hub id>``, ``data=<file or dataset>``) are resolved first, and stage arguments the recipe file leaves at their defaults
are made settable.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from compress.base.errors import CompressError, unknown_key_error
from compress.base.paths import recipes_dir

if TYPE_CHECKING:
    from compress.app.run_config import RunConfig

RecipeLike = str | Path | Sequence[dict]
GROUPS = ("model", "data", "gate")


def available(group: str | None = None) -> list[str]:
    folder = recipes_dir() / group if group else recipes_dir()
    return sorted(p.stem for p in folder.glob("*.yaml") if not p.name.startswith("_"))


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
    """Raise on unknown group options and stage keys; return the overrides with stage arguments the recipe file
    leaves at their defaults made appendable. The typed keys (``gate.engine`` too) are checked by the schema while
    composing; stages are a list of different kinds, read from the recipe file, where they live."""
    from omegaconf import OmegaConf

    stages = OmegaConf.to_container(OmegaConf.load(recipes_dir() / f"{recipe}.yaml")).get("stages") or []
    checked = []
    for override in overrides:
        key = _key(override)
        parts = key.split(".")
        if key in GROUPS:
            for choice in override.split("=", 1)[1].split(","):
                if choice not in available(key):
                    raise CompressError(f"{key}={choice} is not a known option; available: {', '.join(available(key))}")
        elif parts[0] == "hydra" or key.startswith("hydra/"):
            raise CompressError(
                f"{override}: jobs are composed by compress, so Hydra's settings do not apply except the launcher of "
                "a sweep (-m hydra/launcher=<name>, hydra.launcher.<key>=<value>; see `python -m compress run --help`)"
            )
        elif override.startswith(("+", "~")):
            pass
        elif parts[0] == "stages" and len(parts) > 1:
            override = _stage_override(override, parts, stages)
        checked.append(override)
    return checked


def _stage_override(override: str, parts: list[str], stages: list) -> str:
    """``stages.<i>.<key>=<value>`` checked against stage ``i`` of the recipe; ``+`` added when the recipe file
    leaves that argument at its default."""
    index = parts[1]
    if not index.isdigit() or int(index) >= len(stages):
        raise CompressError(f"{'.'.join(parts)}: stages has {len(stages)} entries (0..{len(stages) - 1})")
    stage = stages[int(index)]
    if len(parts) != 3 or not isinstance(stage, dict) or parts[2] in stage:
        return override
    valid = _stage_keys(stage)
    if valid is None:
        return override  # an unknown stage type: build_chain names the known ones
    if parts[2] not in valid:
        raise unknown_key_error(f"stages.{index}", parts[2], valid)
    return "+" + override


def compose_job(recipe: str, overrides: list[str]) -> RunConfig:
    """The one composition of a job: Hydra composes the recipe with the job's overrides against the run schema,
    ``build_run_config`` types and checks it; Hydra's errors become one line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from compress.app.run_config import RunConfig, build_run_config
    from compress.base.typed import config_error

    try:
        with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
            composed = hydra_compose(config_name=recipe, overrides=overrides)
    except MissingConfigException as error:
        options = f"; available: {', '.join(error.options)}" if error.options else ""
        raise CompressError(str(error).strip().splitlines()[0] + options) from None
    except (HydraException, OmegaConfBaseException) as error:
        raise in_recipe_file(config_error(error, schema=RunConfig), recipe, overrides) from None
    try:
        written = None if OmegaConf.is_missing(composed, "recipe") else composed.recipe
    except OmegaConfBaseException as error:  # recipe=${nope}: an interpolation that cannot resolve
        raise config_error(error, schema=RunConfig) from None
    check_recipe_name(recipes_dir() / f"{recipe}.yaml", written)
    composed.recipe = recipe
    try:
        return build_run_config(composed)
    except CompressError as error:
        raise in_recipe_file(error, recipe, overrides) from None


def in_recipe_file(error: CompressError, recipe: str, overrides: list[str]) -> CompressError:
    """``error`` about a key the recipe file itself sets (no override does) with the file named first: a wrong value
    in a copied recipe is fixed there, not on the command line."""
    from omegaconf import OmegaConf

    key = re.match(r"[\w.]+", str(error))
    path = recipes_dir() / f"{recipe}.yaml"
    if key is None or any(_key(o) == key[0] or key[0].startswith(_key(o) + ".") for o in overrides):
        return error
    if OmegaConf.select(OmegaConf.load(path), key[0], default=None, throw_on_resolution_failure=False) is None:
        return error
    return type(error)(f"{path}: {error}")


def check_recipe_name(path: Path, written: object) -> None:
    """A recipe in the recipes folder is named by its file: Hydra picks it by file name, so a ``recipe:`` key inside
    that disagrees (a copy of another recipe) would label the run, its checkpoint and its MLflow run as the other."""
    if written is not None and written != path.stem:
        raise CompressError(
            f"{path.name} says recipe: {written}, but a recipe is named by its file ({path.stem}); delete that line"
        )


def compose(recipe: RecipeLike, overrides: Sequence[str] = (), model: str | None = None) -> RunConfig:
    """The typed, checked run configuration: a named recipe composed by Hydra exactly as the CLI composes it, or a
    stage list (or a recipe file's stages) on top of the defaults every recipe inherits; ``model`` sets the model."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from compress.app.run_config import RunConfig, build_run_config, register_schema
    from compress.base.typed import config_error

    register_schema()
    if isinstance(recipe, str) and (recipes_dir() / f"{recipe}.yaml").is_file():
        shortcuts = resolve_shortcuts([*overrides, *([f"model={model}"] if model else [])])
        return compose_job(recipe, check_overrides(recipe, shortcuts))  # as the CLI: unset stage keys settable
    if isinstance(recipe, str | Path):
        path = Path(recipe).expanduser()
        if not path.is_file():
            raise CompressError(f"recipe {recipe!s}: neither a recipe name in {recipes_dir()} nor a YAML file")
        stage_list = (yaml.safe_load(path.read_text()) or {}).get("stages")
        name = path.stem
    else:
        stage_list, name = [dict(stage) for stage in recipe], "custom"
    if not stage_list:
        raise CompressError(f"recipe {name!r} has no stages")
    fixed = {"recipe": name, "stages": stage_list, **({"model": {"path": model}} if model else {})}
    try:
        composed = OmegaConf.merge(OmegaConf.structured(RunConfig), fixed)
        for override in overrides:  # stages.0.group_size=128 indexes the list, as on the command line
            key, _, value = override.partition("=")
            OmegaConf.update(composed, key, yaml.safe_load(value), force_add=key.startswith("stages."))
    except OmegaConfBaseException as error:
        raise config_error(error, schema=RunConfig) from None
    return build_run_config(composed)
