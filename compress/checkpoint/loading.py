"""The runtime's one loader: any model folder or hub id, dense or compressed, dispatched on its
``quantization_config``; with the dtype and tokenizer helpers every loader shares."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from compress.base.errors import CompressError
from compress.checkpoint.description import torch_dtype
from compress.checkpoint.reader import load_compressed, read_quantization_config
from compress.checkpoint.validation import check_model_files


@contextmanager
def loading_errors(source: str | Path, what: str = "model", fix: str = "") -> Iterator[None]:
    """Missing files, corrupt safetensors, a bad config: every loading failure ends as one CompressError line, with
    ``fix`` after it where the caller knows one."""
    try:
        yield
    except CompressError:
        raise
    except Exception as error:
        if "trust_remote_code" in str(error):
            raise CompressError(
                f"model {str(source)!r} ships its own Python code to load: set model.trust_remote_code=true if you "
                "trust its source"
            ) from error
        reason = " ".join(str(error).split()).rstrip(".")
        fix = f"; {fix}" if fix else ""
        raise CompressError(f"cannot load {what} {str(source)!r}: {type(error).__name__}: {reason}{fix}") from error


def load_tokenizer(source: str | Path, trust_remote_code: bool = False):
    """The folder's or hub id's tokenizer; None for a local folder saved without one (tests, bare checkpoints)."""
    from transformers import AutoTokenizer

    folder = Path(source)
    if folder.is_dir() and not (folder / "tokenizer_config.json").is_file():
        return None
    fix = "copy its tokenizer.json and tokenizer_config.json from the model's source" if folder.is_dir() else ""
    with loading_errors(source, "the tokenizer of", fix):
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)


def load_checkpoint(
    source: str | Path,
    device: str | torch.device = "cpu",
    *,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
):
    """``(model, tokenizer)`` in eval mode from a model folder or hub id, the runtime's one loader.

    Dispatches on config.json's ``quantization_config``: our compressed-tensors checkpoints are rebuilt with
    ``QuantizedLinear``/``Int8Linear``/``Fp8Linear`` modules and calibrated K/V scales; anything else goes to
    transformers' ``from_pretrained`` (plain folders, hub ids, quantizers transformers knows). ``dtype``: ``auto``
    (the checkpoint's own) or ``float32``/``bfloat16``/``float16``. ``compress.model.sources.load`` adds the default
    model, lazy layer reading and the pickle check on top; the engine, with no pipeline installed, calls this
    directly."""
    folder, fix = Path(source).expanduser(), ""
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise CompressError(f"{folder} is not a checkpoint folder (no config.json)")
        check_model_files(folder)
        qconfig = read_quantization_config(folder)
        if qconfig.get("quant_method") == "compressed-tensors":
            model = load_compressed(folder, qconfig, dtype)
            return model.to(device).eval(), load_tokenizer(folder, trust_remote_code)
        if qconfig.get("quant_method"):  # a quantizer of transformers' own, which may need a package not installed
            fix = (
                f"{folder / 'config.json'} declares a {qconfig['quant_method']} checkpoint; compress reads dense "
                "models and compressed-tensors checkpoints: give the original dense model"
            )
        source = str(folder)
    elif str(source).startswith((".", "/", "~")) or str(source).count("/") > 1:
        raise CompressError(f"model path {source} does not exist; give an existing folder or a hub id (org/name)")
    from transformers import AutoModelForCausalLM

    with loading_errors(source, fix=fix):
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=torch_dtype(dtype),
            trust_remote_code=trust_remote_code,
            use_safetensors=None if allow_pickle else True,  # None: safetensors still win where both exist
        )
    return model.to(device).eval(), load_tokenizer(source, trust_remote_code)
