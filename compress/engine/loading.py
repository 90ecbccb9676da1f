"""Where models come from: our checkpoint loader when it exists, plain transformers otherwise."""

from __future__ import annotations

import importlib
from pathlib import Path

from torch import nn


def load_model(path: str | Path) -> tuple[nn.Module, object]:
    """``(model, tokenizer)`` for a checkpoint folder. Uses ``compress.checkpoint.load_checkpoint`` (which puts
    our quantized modules in place) when that is available, else ``transformers.AutoModelForCausalLM``."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {path}; pass a folder with config.json and weights")
    try:
        checkpoint = importlib.import_module("compress.checkpoint")
    except ModuleNotFoundError as error:
        if error.name != "compress.checkpoint":
            raise
        checkpoint = None
    if checkpoint is not None and hasattr(checkpoint, "load_checkpoint"):
        return checkpoint.load_checkpoint(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
