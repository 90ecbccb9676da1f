"""Where models come from: a checkpoint folder, loaded by our checkpoint reader."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from compress.checkpoint import load_checkpoint


def load_model(path: str | Path) -> tuple[nn.Module, object]:
    """``(model, tokenizer)`` for a checkpoint folder: ``compress.checkpoint.load_checkpoint`` puts our quantized
    modules and calibrated K/V scales in place, and reads plain safetensors HF folders as they are."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {path}; pass a folder with config.json and weights")
    return load_checkpoint(path)
