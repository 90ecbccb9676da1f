"""``compress.oneshot`` (defined here): compression as a library call, the CLI's ``run`` without evaluation,
gate or tracking.

    from compress import oneshot
    checkpoint = oneshot(model="org/name", recipe="gptq_int4", output_dir="out/gptq",
                         overrides=["stages.0.group_size=128", "data.num_samples=128"])

The recipe is composed exactly as ``python -m compress run`` composes it (same files, same checks, same one-line
errors); the checkpoint is the same compressed-tensors folder, written to a temporary sibling and renamed when
complete.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import yaml
from torch import nn

from compress.checkpoint import CheckpointSummary, save_checkpoint
from compress.compression import compress_model
from compress.config import check_stage_types
from compress.data import DataSpec, calibration_samples, load_corpus, tokenize
from compress.errors import CompressError
from compress.models import ModelSpec, load
from compress.paths import artifacts_dir, recipes_dir
from compress.stages import Stage, build_chain

RecipeLike = str | Path | Sequence[dict]
DataLike = str | Path | torch.Tensor | Sequence[str] | None


def oneshot(
    model: str | Path | nn.Module,
    recipe: RecipeLike,
    data: DataLike = None,
    output_dir: str | Path | None = None,
    overrides: Sequence[str] = (),
    tokenizer=None,
    device: str | None = None,
) -> Path:
    """Compress ``model`` with ``recipe`` and return the checkpoint folder.

    - ``model``: a local folder, a hub id, the default model's name (``smollm2-135m``) or an ``nn.Module`` (pass its
      ``tokenizer`` to save one with the checkpoint and to calibrate on text).
    - ``recipe``: a recipe name from ``recipes/``, a path to a recipe YAML file, or a list of stage mappings
      (``[{"type": "gptq", "bits": 4, "group_size": 64}]``).
    - ``data``: None for the recipe's calibration text; a ``.txt``/``.jsonl`` file; a ``datasets`` name; a list of
      strings; or token ids ``[num_samples, seq_len]`` used as they are.
    - ``overrides``: the CLI's ``key=value`` overrides (``stages.0.group_size=128``, ``data.num_samples=128``).
    - ``output_dir``: where the checkpoint goes (must not exist); default ``<artifacts>/oneshot/<recipe>-<time>``.
    - ``device``: where each layer is calibrated (default: the recipe's ``device``, ``auto`` = CUDA when visible).
    """
    settings = compose(recipe, overrides)
    check_stage_types(settings["stages"])
    stages = build_chain(settings["stages"])  # a bad recipe fails here, before anything is loaded
    target = Path(output_dir) if output_dir else artifacts_dir() / "oneshot" / f"{settings['recipe']}-{_stamp()}"
    if target.exists():
        raise CompressError(f"output_dir {target} already exists; choose another folder or remove it")
    if isinstance(model, nn.Module):
        loaded = model
    else:
        loaded, tokenizer = load(ModelSpec(**{**settings.get("model", {}), "path": str(model)}))
    data_spec = DataSpec(**settings.get("data", {}))
    samples = calibration_ids(data, data_spec, tokenizer, int(settings.get("seed", 0)))
    compute = select_device(device or settings.get("device", "auto"))
    summaries = compress_model(loaded, stages, samples, compute, settings["calibration_batch_size"])
    save_dtype = settings.get("output", {}).get("save_dtype")
    write_checkpoint(loaded, tokenizer, stages, summaries, target, settings["recipe"], settings["stages"], save_dtype)
    return target


def compose(recipe: RecipeLike, overrides: Sequence[str] = ()) -> dict:
    """The recipe as a plain dict with ``overrides`` applied: named recipes through Hydra as the CLI composes them,
    a stage list on top of the defaults every recipe inherits."""
    from compress.commands.run import compose_job, resolve_shortcuts
    from compress.config import register_schema

    if isinstance(recipe, str) and (recipes_dir() / f"{recipe}.yaml").is_file():
        register_schema()
        return compose_job(recipe, resolve_shortcuts(list(overrides)))
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
    from omegaconf import OmegaConf

    from compress.config import RunSchema

    base = OmegaConf.structured(RunSchema)
    merged = OmegaConf.merge(base, {"recipe": name}, {"stages": stage_list}, OmegaConf.from_dotlist(list(overrides)))
    return OmegaConf.to_container(merged, resolve=True)


def calibration_ids(data: DataLike, spec: DataSpec, tokenizer, seed: int) -> torch.Tensor:
    """Token ids ``[num_samples, seq_len]`` from whatever ``data`` is (see :func:`oneshot`)."""
    if isinstance(data, torch.Tensor):
        if data.dim() != 2 or data.dtype != torch.long:
            raise CompressError(
                f"data: token ids must be a [num_samples, seq_len] long tensor, not {data.dtype} "
                f"of shape {list(data.shape)}"
            )
        return data
    if tokenizer is None:
        raise CompressError("data: text calibration needs a tokenizer; pass tokenizer=... or token ids as data")
    if isinstance(data, Sequence) and not isinstance(data, str):
        text = "\n\n".join(data)
    else:
        if data is not None:
            path = Path(data).expanduser()
            spec = DataSpec(
                **{
                    **vars(spec),
                    **(
                        {"source": "file", "path": str(path)} if path.is_file() else {"source": "hf", "name": str(data)}
                    ),
                }
            )
        text = load_corpus(spec).calibration_text
    return calibration_samples(tokenize(tokenizer, text), spec.num_samples, spec.seq_len, seed)


def write_checkpoint(
    model: nn.Module,
    tokenizer,
    stages: list[Stage],
    summaries: list[dict],
    target: Path,
    recipe: str,
    stage_args: list[dict],
    save_dtype: str | None,
    extra_files: dict[str, str] | None = None,
) -> CheckpointSummary:
    """The compressed-tensors folder with its recipe, what each stage did (``stages.json``), the KV scheme and the
    size summary, written whole or not at all."""
    recipe_yaml = yaml.safe_dump({"recipe": recipe, "stages": stage_args}, sort_keys=False)
    kv_cache_scheme = next((s.kv_cache_scheme for s in stages if s.quantizes_kv_cache), None)
    summary = save_checkpoint(
        model,
        tokenizer,
        target,
        dtype=getattr(torch, save_dtype) if save_dtype else None,
        kv_cache_scheme=kv_cache_scheme,
        extra_files={
            "recipe.yaml": recipe_yaml,
            "stages.json": json.dumps(named_summaries(stages, summaries), indent=2),
            **(extra_files or {}),
        },
    )
    (target / "size.json").write_text(json.dumps(summary.to_dict(), indent=2))
    return summary


def named_summaries(stages: list[Stage], summaries: list[dict]) -> dict[str, dict]:
    """``{"0:gptq": {...}, "1:kv_cache": {...}}``: each stage's summary under its position and name."""
    return {f"{i}:{stage.name}": summary for i, (stage, summary) in enumerate(zip(stages, summaries, strict=True))}


def select_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CompressError(f"device={name} asked for, but no CUDA GPU is visible; use device=cpu")
    return torch.device(name)


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
