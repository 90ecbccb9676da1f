"""What the gate judges, loaded by ``compress.model.sources.load`` (compressed-tensors checkpoints, plain HF folders,
model
names), described without loading its weights, and the KV-cache dtype a checkpoint asks for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compress.base.errors import CompressError
from compress.checkpoint import load_tokenizer, loading_errors, read_quantization_config
from compress.grids.kv_quant import KVCacheScheme
from compress.model.sources import ModelSpec, load, resolve_model_path


def load_for_eval(source: str | Path):
    """``(model, tokenizer)`` with every layer in memory: the gate moves models between devices and runs them
    whole."""
    return load(source, lazy=False)


def describe(label: str, source, tokenizer=None) -> tuple[Any, Any, Path | None]:
    """``(tokenizer, config, local folder or None)`` of one side of the gate, its weights left on disk: the gate reads
    both sides' contexts and tokenizer before it loads either model."""
    if not isinstance(source, str | Path):
        if tokenizer is None:
            raise CompressError(f"the {label} was passed as a model in memory; pass its tokenizer too")
        return tokenizer, source.config, None
    from transformers import AutoConfig

    path = resolve_model_path(ModelSpec(str(source)))
    with loading_errors(path):
        config = AutoConfig.from_pretrained(path)
    folder = Path(path)
    return tokenizer or load_tokenizer(path), config, folder if folder.is_dir() else None


class MismatchedTokenizers(CompressError):
    """The two sides of a gate do not read text alike: a usage error, raised before any evaluation."""


TOKENIZER_PROBE_CHARS = 50_000  # enough text to meet every merge rule that matters, read in well under a second


def check_same_tokenization(candidate_tokenizer, baseline_tokenizer, text: str) -> None:
    """Refuse a baseline whose tokenizer differs from the candidate's: the gate scores both models on one list of
    token ids, so another vocabulary makes every perplexity and divergence meaningless (and can PASS)."""
    if candidate_tokenizer is None or baseline_tokenizer is None or candidate_tokenizer is baseline_tokenizer:
        return
    probe = text[:TOKENIZER_PROBE_CHARS]
    sizes = len(candidate_tokenizer), len(baseline_tokenizer)
    if sizes[0] == sizes[1] and candidate_tokenizer.get_vocab() == baseline_tokenizer.get_vocab():
        ids = [t(probe, add_special_tokens=False)["input_ids"] for t in (candidate_tokenizer, baseline_tokenizer)]
        if ids[0] == ids[1]:
            return
        why = f"they split the evaluation text into {len(ids[0])} and {len(ids[1])} tokens"
    else:
        why = f"their vocabularies differ ({sizes[0]} and {sizes[1]} tokens)"
    names = [
        f"{type(t).__name__}({getattr(t, 'name_or_path', '') or 'unnamed'})"
        for t in (candidate_tokenizer, baseline_tokenizer)
    ]
    raise MismatchedTokenizers(
        f"the baseline's tokenizer {names[1]} is not the candidate's {names[0]}: {why}; judge the candidate against "
        "the model it was compressed from"
    )


def kv_cache_dtype_of(path: Path | None) -> str | None:
    """The KV-cache storage dtype a checkpoint asks for (``int8``/``fp8``), from its ``kv_cache_scheme``: read the
    way the loader reads it, so the gate and the engine agree."""
    block = read_quantization_config(path).get("kv_cache_scheme") if path is not None else None
    if not block:
        return None
    try:
        return KVCacheScheme.from_dict(block).kv_cache_dtype
    except CompressError as error:
        raise CompressError(f"{path}: {error}") from None
