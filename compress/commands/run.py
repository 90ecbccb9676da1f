"""``python -m compress run recipe=<name> [overrides] [-m]``: Hydra composes the recipe, the pipeline runs it.

Before Hydra sees the command line we resolve shortcuts (``model=<folder or hub id>``, ``data=<file or dataset>``)
and check every override key against the composed recipe, so a typo is reported with the valid keys instead of
Hydra's generic struct error. Keys a stage accepts but its recipe file leaves at the default are added for you.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from compress.errors import CompressError
from compress.paths import recipes_dir

GROUPS = ("model", "data", "gate")
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "-i"}


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
                if path[:1] == ["gate"]:
                    override = "+" + override  # gate policies are partial; evals.gate checks the keys
                    break
                valid = stage_keys if stage_keys is not None else list(node) if isinstance(node, dict) else []
                raise unknown_key_error(where, part, valid)
            path.append(part)
        checked.append(override)
    return checked


def _task(cfg) -> None:
    from omegaconf import OmegaConf

    from compress.config import build_run_config
    from compress.pipeline import run, summary_lines

    try:
        config = build_run_config(OmegaConf.to_container(cfg, resolve=True))
        result = run(config)
    except CompressError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    print("\n" + "\n".join(summary_lines(result.report)))
    print(f"\nrun folder: {result.run_dir}")
    if result.mlflow_run_id:
        print(f"MLflow run: {result.mlflow_run_id} (browse with `mlflow ui --backend-store-uri {config_uri(config)}`)")
    if not result.report.get("gate", {}).get("passed", True):
        raise SystemExit(1)  # the release gate blocked this checkpoint


def config_uri(config) -> str:
    from compress.tracking import tracking_uri

    return tracking_uri(config.tracking.uri)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    flags, overrides = split_arguments(argv)
    recipes = [o for o in overrides if o.startswith("recipe=")]
    overrides = [o for o in overrides if not o.startswith("recipe=")]
    try:
        if not recipes:
            raise CompressError(f"choose a recipe: recipe=<name>; available: {', '.join(available())}")
        recipe = recipes[-1].split("=", 1)[1]
        if recipe not in available():
            raise CompressError(f"unknown recipe {recipe!r}; available: {', '.join(available())}")
        overrides = check_overrides(recipe, resolve_shortcuts(overrides))
    except CompressError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1

    import hydra

    entry = hydra.main(version_base="1.3", config_path=None, config_name=None)(_task)
    saved = sys.argv
    sys.argv = ["compress", f"--config-dir={recipes_dir()}", f"--config-name={recipe}", *flags, *overrides]
    try:
        entry()
    except SystemExit as exit_:  # our task's clean failures and Hydra's own usage errors
        return exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = saved
    return 0
