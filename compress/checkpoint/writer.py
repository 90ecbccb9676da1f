"""Writing a checkpoint: each module's stored tensors, streamed into safetensors shards as layers finish, the folder
staged beside its target and renamed when complete; and the size summary of what was written."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from compress.base.errors import CompressError
from compress.base.locks import FileLock, lock_beside
from compress.base.staging import make_staging, publish
from compress.checkpoint.description import ACTIVATION_QUANTIZED, quantization_config
from compress.formats import QUANTIZED_LINEARS, Fp4Linear, QuantizedLinear
from compress.formats.moe_experts import checkpoint_name
from compress.grids.sparsity import SPARSITY_FILE, sparsity_record
from compress.kernels.packing import pack_int32

MAX_SHARD_BYTES = 2 * 1024**3


@dataclass
class CheckpointSummary:
    path: str
    size_mb: float
    quantized_linears: int
    quantized_params: int
    total_params: int
    bits_per_weight: float  # stored bits (codes + scales + zero points) per quantized weight
    # the same over every linear but the output head, unquantized ones at their dtype's width: what a mixed
    # checkpoint's bits budget (``compress search``) counts
    linear_bits_per_weight: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _tensors(
    model: nn.Module, dtype: torch.dtype | None, root: str = "", skip: tuple[str, ...] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor the checkpoint stores of the module ``root`` (default the whole model) but those of the modules
    named in ``skip``, under its stored name and in its stored form, made one at a time as the shards are written."""
    module = model.get_submodule(root) if root else model
    prefix = f"{root}." if root else ""
    skipped = tuple(f"{name}." for name in skip)
    modules = [(name, m) for name, m in module.named_modules(prefix=root) if not f"{name}.".startswith(skipped)]
    quantized = {name: m for name, m in modules if isinstance(m, QuantizedLinear)}  # in module order
    activation_quantized = {name for name, m in modules if isinstance(m, (*ACTIVATION_QUANTIZED, Fp4Linear))}
    tied = getattr(model.config, "tie_word_embeddings", False)
    model_type = getattr(model.config, "model_type", None)
    for key, value in module.state_dict(prefix=prefix).items():
        if (tied and key == "lm_head.weight") or key.startswith(skipped):
            continue
        owner, _, leaf = key.rpartition(".")
        if owner in quantized and leaf == "weight_zero_point":
            value = pack_int32(value.cpu(), quantized[owner].num_bits, dim=0)
        elif value.is_floating_point() and dtype is not None and owner not in activation_quantized:
            if value.element_size() > 1:  # fp8 codes and fp32 W8A8/FP4 scales keep their dtypes
                value = value.to(dtype)
        yield checkpoint_name(model_type, key), value.detach().cpu().contiguous()
    for owner, linear in quantized.items():
        shape = torch.tensor([linear.out_features, linear.in_features])
        yield checkpoint_name(model_type, f"{owner}.weight_shape"), shape


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


class ShardWriter:
    """safetensors shards of at most ``MAX_SHARD_BYTES`` (a larger tensor alone), written tensor by tensor: each
    tensor's bytes go straight to a data file and only its name, dtype and shape stay in memory, so saving holds
    no shard (and no copy of the model). A shard becomes a safetensors file (header, then the data) when it is
    full; ``close`` names them ``model-0000i-of-0000n`` once ``n`` is known, with the index."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.closed: list[tuple[Path, list[str]]] = []
        self.header: dict[str, dict] = {}
        self.data = None
        self.size = self.total = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.header and self.size + nbytes > MAX_SHARD_BYTES:
            self._close_shard()
        if self.data is None:
            self.data = open(self.folder / f".shard-{len(self.closed) + 1}.data", "wb")  # noqa: SIM115 - spans calls
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise CompressError(f"{key}: cannot store {tensor.dtype} in safetensors")
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        self.data.write(flat.view(torch.uint8).numpy().data if nbytes else b"")
        shape = list(tensor.shape)
        self.header[key] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": shape}
        self.header[key]["data_offsets"] = [self.size, self.size + nbytes]
        self.size += nbytes
        self.total += nbytes

    def _close_shard(self) -> None:
        """Header (JSON, padded to 8 bytes) + the data file's bytes → ``.shard-i.safetensors``."""
        assert self.data is not None
        self.data.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        data_path = Path(self.data.name)
        path = self.folder / f".shard-{len(self.closed) + 1}.safetensors"
        with open(path, "wb") as shard, open(data_path, "rb") as data:
            shard.write(len(header).to_bytes(8, "little") + header)
            shutil.copyfileobj(data, shard, 16 * 1024**2)
        data_path.unlink()
        self.closed.append((path, list(self.header)))
        self.header, self.data, self.size = {}, None, 0

    def abandon(self) -> None:
        """Close the open data file without making a shard of it (the caller removes the folder)."""
        if self.data is not None:
            self.data.close()

    def close(self) -> None:
        if self.data is not None or not self.closed:
            if self.data is None:  # a model with no tensors still gets its (empty) file
                self.data = open(self.folder / ".shard-1.data", "wb")  # noqa: SIM115
            self._close_shard()
        if len(self.closed) == 1:
            self.closed[0][0].rename(self.folder / "model.safetensors")
            return
        weight_map = {}
        for number, (path, keys) in enumerate(self.closed, start=1):
            filename = f"model-{number:05d}-of-{len(self.closed):05d}.safetensors"
            path.rename(self.folder / filename)
            weight_map.update(dict.fromkeys(keys, filename))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


class CheckpointWriter:
    """A checkpoint written while the model is compressed: :meth:`write_layer` stores a finished decoder layer
    and drops it to the meta device (so host memory never holds the whole compressed model), :meth:`finish` the
    rest, the config and the tokenizer. Everything goes to a temporary sibling folder renamed to ``target`` at the
    end; leaving the ``with`` block by an error removes it, so an interrupted save leaves nothing at ``target``."""

    def __init__(self, target: Path, dtype: torch.dtype | None = None):
        self.target, self.dtype = Path(target), dtype
        # one writer per checkpoint name: a second waits (saying so), then finds the first's checkpoint there
        self.lock = FileLock(lock_beside(self.target), f"the checkpoint name {self.target}").acquire()
        if self.target.exists():
            self.lock.release()
            raise CompressError(f"checkpoint folder {self.target} already exists; choose another output or remove it")
        try:
            self.staging = make_staging(self.target.parent, self.target.name)
        except BaseException:
            self.lock.release()
            raise
        self.shards = ShardWriter(self.staging)
        self.written: list[str] = []  # the modules whose tensors are already in the shards

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is not None:
            self.shards.abandon()
            shutil.rmtree(self.staging, ignore_errors=True)
        self.lock.release()

    def layer_sink(self, model: nn.Module) -> Callable[[str], None]:
        """``compress_model``'s ``layer_done``: each finished layer of ``model`` goes to the shards."""
        return lambda name: self.write_layer(model, name)

    def write_layer(self, model: nn.Module, name: str) -> None:
        """Store the module ``name`` (a finished decoder layer) and move it to the meta device."""
        for key, value in _tensors(model, self.dtype, root=name):
            self.shards.add(key, value)
        self.written.append(name)
        model.get_submodule(name).to("meta")

    def finish(
        self,
        model: nn.Module,
        tokenizer,
        extra_files: dict[str, str] | None = None,
        kv_cache_scheme: dict | None = None,
        summary_file: str | None = None,
    ) -> CheckpointSummary:
        """Write the rest of the model, config.json, the tokenizer, ``extra_files`` and (``summary_file``) the size
        summary into the staging folder, flush every file to disk, and rename it to ``target`` last."""
        for key, value in _tensors(model, self.dtype, skip=tuple(self.written)):
            self.shards.add(key, value)
        self.shards.close()
        staging = self.staging
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        if self.dtype is not None:
            config["dtype"] = str(self.dtype).removeprefix("torch.")
        qconfig = quantization_config(model, kv_cache_scheme)
        sparsity = sparsity_record(model)
        if sparsity is not None:  # beside config.json, not in it: current vLLM refuses any sparsity_config
            (staging / SPARSITY_FILE).write_text(json.dumps(sparsity, indent=2, sort_keys=True))
        if qconfig is not None:
            config["quantization_config"] = qconfig
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
        summary = summarize(model, staging)
        summary.path = str(self.target)
        if summary_file is not None:
            (staging / summary_file).write_text(json.dumps(summary.to_dict(), indent=2))
        publish(staging, self.target)
        return summary


def save_checkpoint(
    model: nn.Module,
    tokenizer,
    target: Path,
    extra_files: dict[str, str] | None = None,
    dtype: torch.dtype | None = None,
    kv_cache_scheme: dict | None = None,
) -> CheckpointSummary:
    """Write into a temporary sibling folder, then rename: an interrupted save leaves nothing at ``target``."""
    with CheckpointWriter(target, dtype) as writer:
        return writer.finish(model, tokenizer, extra_files, kv_cache_scheme)


def summarize(model: nn.Module, folder: Path) -> CheckpointSummary:
    size = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    quantized = [m for m in model.modules() if isinstance(m, QUANTIZED_LINEARS)]
    quantized_params = sum(m.in_features * m.out_features for m in quantized)
    stored_bits = sum(m.stored_bits() for m in quantized)
    total = sum(p.numel() for p in model.parameters()) + quantized_params
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    dense = [m.weight for m in model.modules() if type(m) is nn.Linear and m is not head]
    linear_params = quantized_params + sum(w.numel() for w in dense)
    linear_bits = stored_bits + sum(w.numel() * w.element_size() * 8 for w in dense)
    return CheckpointSummary(
        path=str(folder),
        size_mb=size / 1e6,
        quantized_linears=len(quantized),
        quantized_params=quantized_params,
        total_params=total,
        bits_per_weight=stored_bits / quantized_params if quantized_params else 0.0,
        linear_bits_per_weight=linear_bits / linear_params if linear_params else 0.0,
    )
