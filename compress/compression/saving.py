"""A compression's output as a compressed-tensors folder: the streaming writer its finished layers go into, and the
files that complete it (recipe, what each stage did, the calibration windows' digest, KV scheme, size).
``compress.oneshot``, the ``run`` pipeline and ``compress search`` all save through here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from torch import nn

from compress.base.data import CALIBRATION_FILE, calibration_json
from compress.checkpoint import CheckpointSummary, CheckpointWriter
from compress.stages import Stage


def checkpoint_writer(target: Path, save_dtype: str | None) -> CheckpointWriter:
    """The writer a compression streams its finished layers into (``output.save_dtype``: their stored dtype)."""
    return CheckpointWriter(target, getattr(torch, save_dtype) if save_dtype else None)


def write_checkpoint(
    writer: CheckpointWriter,
    model: nn.Module,
    tokenizer,
    stages: list[Stage],
    summaries: list[dict],
    recipe: str,
    stage_args: list[dict],
    extra_files: dict[str, str] | None = None,
    calibration: torch.Tensor | None = None,
) -> CheckpointSummary:
    """Complete the compressed-tensors folder ``writer`` holds (layers it already has stay as written) with its
    recipe, what each stage did (``stages.json``), the windows it was calibrated on (``calibration.json``: their
    count, length and digest; none where no stage reads calibration data), the KV scheme and the size summary,
    written whole or not at all."""
    recipe_yaml = yaml.safe_dump({"recipe": recipe, "stages": stage_args}, sort_keys=False)
    if calibration is not None and any(stage.needs_calibration for stage in stages):  # beside the recipe, what
        # decides a calibrated checkpoint: which token ids it saw
        extra_files = {**(extra_files or {}), CALIBRATION_FILE: calibration_json(calibration)}
    kv_cache_scheme = next((s.kv_cache_scheme for s in stages if s.quantizes_kv_cache), None)
    summary = writer.finish(
        model,
        tokenizer,
        extra_files={
            "recipe.yaml": recipe_yaml,
            "stages.json": json.dumps(named_summaries(stages, summaries), indent=2),
            **(extra_files or {}),
        },
        kv_cache_scheme=kv_cache_scheme,
        summary_file="size.json",  # inside the staging folder: the renamed checkpoint is complete or absent
    )
    return summary


def named_summaries(stages: list[Stage], summaries: list[dict]) -> dict[str, dict]:
    """``{"0:gptq": {...}, "1:kv_cache": {...}}``: each stage's summary under its position and name."""
    return {f"{i}:{stage.name}": summary for i, (stage, summary) in enumerate(zip(stages, summaries, strict=True))}
