"""compressed-tensors checkpoints: write them atomically, read them back into ``QuantizedLinear`` modules; and the
runtime's one loader (:func:`load_checkpoint`), which dispatches any model folder or hub id on its
``quantization_config``.

The folder is an ordinary HF model folder (config.json, safetensors, tokenizer) whose ``config.json`` carries a
``quantization_config`` with ``quant_method: compressed-tensors`` and ``format: pack-quantized``, so vLLM and
transformers load it. Each quantized linear ``<name>`` stores ``<name>.weight_packed`` (int32, codes packed along the
input dim), ``<name>.weight_scale``, ``<name>.weight_shape`` and, when asymmetric, ``<name>.weight_zero_point``
(packed along the output dim) and, with act-order groups, ``<name>.weight_g_idx``.

MoE models: the stages quantize one linear per expert (``compress.moe``), and tensors and config groups are named as
hub checkpoints and vLLM's compressed-tensors MoE loader name them (``model.layers.L.mlp.experts.N.gate_proj.*``;
Mixtral ``model.layers.L.block_sparse_moe.experts.N.w1.*``); routers are listed in ``ignore``. Loading rebuilds the
per-expert structure; transformers loads the folder into its fused experts through its own MoE weight conversion.

Imports only torch, safetensors and transformers: the engine loads checkpoints with it on a bare GPU box.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from compress.errors import CompressError
from compress.moe import checkpoint_name, model_name, router_names, unfuse_experts
from compress.qlinear import Fp4Linear, Fp8BlockLinear, Fp8Linear, Int8Linear, QuantizedLinear
from compress.sparsity import sparsity_config
from kernels.packing import pack_int32, unpack_int32

FORMAT = "pack-quantized"
INT_FORMAT = "int-quantized"  # W8A8 int8: int8 `weight`, `weight_scale [out, 1]`, activations quantized per token
FLOAT_FORMAT = "float-quantized"  # FP8 e4m3 `weight`, `weight_scale [out, 1]`, optional static `input_scale`
NVFP4_FORMAT = "nvfp4-pack-quantized"  # uint8 `weight_packed`, fp8 `weight_scale`, fp32 `weight_global_scale`
MXFP4_FORMAT = "mxfp4-pack-quantized"  # uint8 `weight_packed`, uint8 e8m0 `weight_scale`
MIXED_FORMAT = "mixed-precision"  # several of the above; each config group names its own format
ACTIVATION_QUANTIZED = (Int8Linear, Fp8Linear)
DENSE = "dense"  # a pruned but unquantized model: plain weights, sparsity recorded in sparsity_config
FLOAT_WEIGHTS = (Fp8BlockLinear, Fp4Linear)  # FP8_BLOCK / NVFP4 / MXFP4 modules, described by _float_weight_groups
READABLE_FORMATS = (FORMAT, INT_FORMAT, FLOAT_FORMAT, NVFP4_FORMAT, MXFP4_FORMAT, MIXED_FORMAT, DENSE)
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


def _scheme_key(module: QuantizedLinear) -> tuple:
    channel = module.group_size == module.in_features
    return (module.num_bits, module.symmetric, None if channel else module.group_size, module.weight_g_idx is not None)


def quantization_config(model: nn.Module, kv_cache_scheme: dict | None = None) -> dict | None:
    """The ``quantization_config`` block describing the model's ``QuantizedLinear`` modules."""
    model_type = getattr(model.config, "model_type", None)
    quantized = {checkpoint_name(model_type, n): m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    activation_groups = _activation_groups(model) + _float_weight_groups(model)
    if not quantized and not activation_groups and kv_cache_scheme is None:
        return None
    schemes: dict[tuple, list[str]] = {}
    for name, module in quantized.items():
        schemes.setdefault(_scheme_key(module), []).append(name)
    groups = {}
    for index, ((bits, symmetric, group_size, act_order), names) in enumerate(sorted(schemes.items(), key=str)):
        alone = len(schemes) == 1 and not activation_groups  # "Linear" would also match the W8A8 modules
        targets = ["Linear"] if alone else [f"re:^{re.escape(n)}$" for n in names]
        groups[f"group_{index}"] = {
            "targets": targets,
            "weights": {
                "num_bits": bits,
                "type": "int",
                "symmetric": symmetric,
                "strategy": "channel" if group_size is None else "group",
                "group_size": group_size,
                "dynamic": False,
                "actorder": "group" if act_order else None,
            },
            "input_activations": None,
            "output_activations": None,
            "format": FORMAT,
        }
    for index, group in enumerate(activation_groups, start=len(groups)):
        groups[f"group_{index}"] = group
    formats = sorted({group["format"] for group in groups.values()})
    dense = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    dense += [name for name in router_names(model) if name not in dense]  # vLLM builds routers as linears
    dense = [checkpoint_name(model_type, name) for name in dense]
    return {
        "quant_method": "compressed-tensors",
        "format": formats[0] if len(formats) == 1 else (MIXED_FORMAT if formats else DENSE),
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": dense,
        "kv_cache_scheme": kv_cache_scheme,
    }


def _activation_groups(model: nn.Module) -> list[dict]:
    """Config groups of the W8A8 modules (int8 or fp8 weights per channel; dynamic per-token or static per-tensor
    activations), one per distinct scheme."""
    by_scheme: dict[tuple[str, bool], list[str]] = {}
    model_type = getattr(model.config, "model_type", None)
    for name, module in model.named_modules():
        if isinstance(module, ACTIVATION_QUANTIZED):
            kind = "int" if isinstance(module, Int8Linear) else "float"
            static = getattr(module, "input_scale", None) is not None
            by_scheme.setdefault((kind, static), []).append(checkpoint_name(model_type, name))
    single = len(by_scheme) == 1 and not any(isinstance(m, QuantizedLinear) for m in model.modules())
    groups = []
    for (kind, static), names in sorted(by_scheme.items()):
        groups.append(
            {
                "targets": ["Linear"] if single else [f"re:^{re.escape(n)}$" for n in names],
                "weights": {
                    "num_bits": 8,
                    "type": kind,
                    "symmetric": True,
                    "strategy": "channel",
                    "group_size": None,
                    "dynamic": False,
                    "actorder": None,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": kind,
                    "symmetric": True,
                    "strategy": "tensor" if static else "token",
                    "group_size": None,
                    "dynamic": not static,
                    "actorder": None,
                },
                "output_activations": None,
                "format": INT_FORMAT if kind == "int" else FLOAT_FORMAT,
            }
        )
    return groups


def _float_scheme(module: nn.Module) -> dict:
    """``weights`` and ``input_activations`` of an FP8-block or FP4 module, exactly as compressed-tensors 0.20 writes
    its ``FP8_BLOCK``, ``NVFP4A16``, ``NVFP4``, ``MXFP4A16`` and ``MXFP4`` presets, and the group's format."""
    if isinstance(module, Fp8BlockLinear):
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "block"}
        weights.update(block_structure=[128, 128], dynamic=False)
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": 128, "strategy": "group"}
        return {"weights": weights, "input_activations": {**inputs, "dynamic": True}, "format": FLOAT_FORMAT}
    nv = module.fmt == "nvfp4"
    args = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16 if nv else 32}
    args.update(strategy="tensor_group" if nv else "group", dynamic=False)
    args["scale_dtype"] = "torch.float8_e4m3fn" if nv else "torch.uint8"
    inputs = None
    if module.quantize_activations:
        inputs = {**args, "dynamic": "local", "observer": "static_minmax"} if nv else {**args, "dynamic": True}
    return {"weights": args, "input_activations": inputs, "format": NVFP4_FORMAT if nv else MXFP4_FORMAT}


def _float_weight_groups(model: nn.Module) -> list[dict]:
    """Config groups of the FP8-block and FP4 modules, one per distinct scheme."""
    by_scheme: dict[str, tuple[dict, list[str]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FLOAT_WEIGHTS):
            scheme = _float_scheme(module)
            by_scheme.setdefault(json.dumps(scheme, sort_keys=True), (scheme, []))[1].append(name)
    others = (QuantizedLinear, *ACTIVATION_QUANTIZED)
    single = len(by_scheme) == 1 and not any(isinstance(m, others) for m in model.modules())
    groups = []
    for _, (scheme, names) in sorted(by_scheme.items()):
        targets = ["Linear"] if single else [f"re:^{re.escape(n)}$" for n in names]
        groups.append({"targets": targets, **scheme, "output_activations": None})
    return groups


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
        if self.target.exists():
            raise CompressError(f"checkpoint folder {self.target} already exists; choose another output or remove it")
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.staging = Path(tempfile.mkdtemp(prefix=f".{self.target.name}-", dir=self.target.parent))
        self.shards = ShardWriter(self.staging)
        self.written: list[str] = []  # the modules whose tensors are already in the shards

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is not None:
            self.shards.abandon()
            shutil.rmtree(self.staging, ignore_errors=True)

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
    ) -> CheckpointSummary:
        for key, value in _tensors(model, self.dtype, skip=tuple(self.written)):
            self.shards.add(key, value)
        self.shards.close()
        staging = self.staging
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        if self.dtype is not None:
            config["dtype"] = str(self.dtype).removeprefix("torch.")
        qconfig = quantization_config(model, kv_cache_scheme)
        sparsity = sparsity_config(model)
        if sparsity is not None:  # compressed-tensors records sparsity inside quantization_config
            qconfig = qconfig or {
                "quant_method": "compressed-tensors",
                "format": DENSE,
                "quantization_status": "compressed",
                "config_groups": {},
                "ignore": [],
                "kv_cache_scheme": None,
            }
            qconfig["sparsity_config"] = sparsity
        if qconfig is not None:
            config["quantization_config"] = qconfig
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
        os.replace(staging, self.target)
        return summarize(model, self.target)


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
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    quantized_params = sum(m.in_features * m.out_features for m in quantized)
    stored_bits = 0
    for m in quantized:
        stored_bits += m.weight_packed.numel() * 32 + m.weight_scale.numel() * m.weight_scale.element_size() * 8
        if m.weight_zero_point is not None:
            stored_bits += m.weight_zero_point.numel() * m.num_bits
    eight_bit = [m for m in model.modules() if isinstance(m, ACTIVATION_QUANTIZED)]
    for m in eight_bit:
        stored_bits += m.weight.numel() * 8 + m.weight_scale.numel() * m.weight_scale.element_size() * 8
    quantized_params += sum(m.in_features * m.out_features for m in eight_bit)
    quantized += eight_bit
    float_weights = [m for m in model.modules() if isinstance(m, FLOAT_WEIGHTS)]
    for m in float_weights:
        stored = (m.weight_packed if isinstance(m, Fp4Linear) else m.weight, m.weight_scale)
        stored += tuple(t for t in (getattr(m, "weight_global_scale", None),) if t is not None)
        stored_bits += sum(t.numel() * t.element_size() * 8 for t in stored)
    quantized_params += sum(m.in_features * m.out_features for m in float_weights)
    quantized += float_weights
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


# -- loading ---------------------------------------------------------------------------------------------------
def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CompressError(f"{folder} holds no *.safetensors weights; is it a compress checkpoint?")
    tensors = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensors[key] = handle.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as error:
            raise CompressError(
                f"checkpoint file {file} is corrupt or truncated ({error}); re-create the checkpoint"
            ) from error
    return tensors


def _module_group(name: str, qconfig: dict) -> dict | None:
    """The config group that targets module ``name`` (None if ignored or untargeted)."""
    if name in qconfig.get("ignore", []):
        return None
    for group in qconfig["config_groups"].values():
        for target in group["targets"]:
            if target == "Linear" or (target.startswith("re:") and re.search(target[3:], name)):
                return group
    return None


def _module_scheme(name: str, qconfig: dict) -> dict | None:
    group = _module_group(name, qconfig)
    return None if group is None else group["weights"]


def _quantized_module(name: str, weights: dict, tensors: dict[str, torch.Tensor], dense: nn.Linear) -> QuantizedLinear:
    out_features, in_features = (int(v) for v in tensors.pop(f"{name}.weight_shape"))
    bits = weights["num_bits"]
    group_size = weights.get("group_size") or in_features
    zero = tensors.pop(f"{name}.weight_zero_point", None)
    if zero is not None:
        zero = unpack_int32(zero, bits, out_features, dim=0)
    g_idx = tensors.pop(f"{name}.weight_g_idx", None)
    bias = tensors.pop(f"{name}.bias", None)
    scale = tensors.pop(f"{name}.weight_scale")
    module = QuantizedLinear(
        in_features,
        out_features,
        bits,
        group_size,
        symmetric=zero is None,
        bias=bias is not None,
        dtype=scale.dtype,
        act_order=g_idx is not None,
    )
    module.weight_packed.copy_(tensors.pop(f"{name}.weight_packed"))
    module.weight_scale.copy_(scale)
    if zero is not None:
        module.weight_zero_point.copy_(zero)
    if g_idx is not None:
        module.weight_g_idx.copy_(g_idx)
    if bias is not None:
        module.bias.data.copy_(bias)
    if (out_features, in_features) != (dense.out_features, dense.in_features):
        raise CompressError(f"{name}: stored shape {(out_features, in_features)} does not match the model config")
    return module


def _replace_activation_quantized(model: nn.Module, name: str, dense: nn.Linear, tensors: dict) -> None:
    """An empty Int8Linear/Fp8Linear (chosen by the stored weight dtype) in place of ``dense``; load_state_dict
    fills its buffers."""
    stored = tensors[f"{name}.weight"].dtype
    if stored == torch.int8:
        module = Int8Linear(dense.in_features, dense.out_features, dense.bias is not None, dense.weight.dtype)
    elif stored == torch.float8_e4m3fn:
        module = Fp8Linear(
            dense.in_features,
            dense.out_features,
            dense.bias is not None,
            dense.weight.dtype,
            static_input_scale=f"{name}.input_scale" in tensors,
        )
    else:
        raise CompressError(f"{name}: weight_scale stored with a {stored} weight; expected int8 or float8_e4m3fn")
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def _is_float_weight(name: str, qconfig: dict, tensors: dict) -> bool:
    """FP4 (uint8 ``weight_packed``) or FP8-block (``strategy: block``) weights: the formats ``FLOAT_WEIGHTS`` hold."""
    packed = tensors.get(f"{name}.weight_packed")
    if packed is not None:
        return packed.dtype == torch.uint8
    weights = _module_scheme(name, qconfig) if f"{name}.weight_scale" in tensors else None
    return weights is not None and weights.get("strategy") == "block"


def _replace_float_weight(model: nn.Module, name: str, dense: nn.Linear, qconfig: dict, tensors: dict) -> None:
    """An empty Fp8BlockLinear/Fp4Linear shaped and typed like the stored tensors in place of ``dense``;
    load_state_dict fills its buffers."""
    bias, dtype = dense.bias is not None, dense.weight.dtype
    if f"{name}.weight_packed" in tensors:
        group = _module_group(name, qconfig)
        fmt = "nvfp4" if tensors[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn else "mxfp4"
        activations = group is not None and group.get("input_activations") is not None
        module = Fp4Linear(dense.in_features, dense.out_features, fmt, bias, dtype, activations)
    else:
        scale_dtype = tensors[f"{name}.weight_scale"].dtype
        module = Fp8BlockLinear(dense.in_features, dense.out_features, bias, dtype, scale_dtype)
    for key, buffer in module.state_dict().items():
        stored = tensors.get(f"{name}.{key}")
        if stored is not None and stored.shape != buffer.shape:
            raise CompressError(
                f"{name}.{key}: stored shape {tuple(stored.shape)} does not match the model config "
                f"({tuple(buffer.shape)}); the checkpoint belongs to another model"
            )
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def _attach_kv_scales(model: nn.Module, block: dict | None, tensors: dict, folder: Path) -> None:
    """``k_scale``/``v_scale`` buffers on every attention module, with K/V quantized as a runtime would."""
    if block is None:
        return
    from compress.kv_quant import KVCacheScheme, attention_modules, route_attention, set_scales

    scheme = KVCacheScheme.from_dict(block)
    for name, attention in attention_modules(model).items():
        if f"{name}.k_scale" not in tensors or f"{name}.v_scale" not in tensors:
            raise CompressError(f"{folder}: kv_cache_scheme is set but {name}.k_scale/v_scale are missing")
        set_scales(attention, tensors[f"{name}.k_scale"], tensors[f"{name}.v_scale"], scheme)
    route_attention(model)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype | str:
    """``"auto"`` passes through (the checkpoint's own dtype); anything else must be a supported dtype."""
    if name == "auto":
        return name
    if name not in DTYPES:
        raise CompressError(f"model.dtype={name!r} is not supported; use auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def source_dtype(config) -> torch.dtype:
    """The dtype a checkpoint was saved in (``dtype``, older ``torch_dtype``); float32 when the config says nothing."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    value = getattr(torch, value) if isinstance(value, str) else value
    return value if value in DTYPES.values() else torch.float32


def read_quantization_config(folder: Path) -> dict:
    """The ``quantization_config`` of a model folder's config.json; empty when it has none (a plain HF folder)."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        return {}
    return json.loads(config_file.read_text()).get("quantization_config") or {}


@contextmanager
def loading_errors(source: str | Path) -> Iterator[None]:
    """Missing files, corrupt safetensors, a bad config: every loading failure ends as one CompressError line."""
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
        reason = " ".join(str(error).split())
        raise CompressError(f"cannot load model {str(source)!r}: {type(error).__name__}: {reason}") from error


def load_tokenizer(source: str | Path, trust_remote_code: bool = False):
    """The folder's or hub id's tokenizer; None for a local folder saved without one (tests, bare checkpoints)."""
    from transformers import AutoTokenizer

    folder = Path(source)
    if folder.is_dir() and not (folder / "tokenizer_config.json").is_file():
        return None
    with loading_errors(source):
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
    (the checkpoint's own) or ``float32``/``bfloat16``/``float16``. ``compress.models.load`` adds the default model,
    lazy layer reading and the pickle check on top; the engine, with no pipeline installed, calls this directly."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise CompressError(f"{folder} is not a checkpoint folder (no config.json)")
        qconfig = read_quantization_config(folder)
        if qconfig.get("quant_method") == "compressed-tensors":
            model = _load_compressed(folder, qconfig, dtype)
            return model.to(device).eval(), load_tokenizer(folder, trust_remote_code)
        source = str(folder)
    elif str(source).startswith((".", "/", "~")) or str(source).count("/") > 1:
        raise CompressError(f"model path {source} does not exist; give an existing folder or a hub id (org/name)")
    from transformers import AutoModelForCausalLM

    with loading_errors(source):
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code, use_safetensors=not allow_pickle
        )
    return model.to(device).eval(), load_tokenizer(source, trust_remote_code)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside hold their parameters on the meta device (no memory, no random initialization) and their
    buffers for real: the file fills every parameter, but non-persistent buffers (rotary frequencies) exist only as
    the model computes them when built."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _load_compressed(folder: Path, qconfig: dict, dtype: str) -> nn.Module:
    """A compressed-tensors checkpoint with our quantized modules in place, in the dtype it was saved in."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if qconfig.get("format") not in READABLE_FORMATS:
        raise CompressError(
            f"{folder}: quantization compressed-tensors/{qconfig.get('format')} is not readable here; "
            f"compress loads compressed-tensors {', '.join(READABLE_FORMATS)}"
        )
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config
    saved = source_dtype(config)
    if dtype != "auto" and torch_dtype(dtype) != saved:
        raise CompressError(
            f"{folder} is a quantized checkpoint saved in {saved}; it loads in that dtype only: use dtype=auto"
        )
    model_type = getattr(config, "model_type", None)
    tensors = {model_name(model_type, key): value for key, value in _read_tensors(folder).items()}
    with parameters_on_meta():  # the quantized modules replace most of them: never allocate the dense weights
        model = AutoModelForCausalLM.from_config(config, dtype=saved)
    unfuse_experts(model)  # the checkpoint stores one linear per expert
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and _is_float_weight(name, qconfig, tensors):
            _replace_float_weight(model, name, module, qconfig, tensors)
        elif type(module) is nn.Linear and f"{name}.weight_packed" in tensors:
            weights = _module_scheme(checkpoint_name(model_type, name), qconfig)
            if weights is None:
                raise CompressError(f"{folder}: {name} is packed but no config group targets it")
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, _quantized_module(name, weights, tensors, module))
        elif type(module) is nn.Linear and f"{name}.weight_scale" in tensors:
            _replace_activation_quantized(model, name, module, tensors)
    _attach_kv_scales(model, qconfig.get("kv_cache_scheme"), tensors, folder)
    expected = model.state_dict()  # the file's tensors take the modules' dtypes, as a copy into them would
    tensors = {key: value.to(expected[key].dtype) if key in expected else value for key, value in tensors.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    allowed_missing = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    # QuantizedLinear buffers were filled directly above; everything else must come from the file.
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    missing = [k for k in missing if k not in allowed_missing and k.rpartition(".")[0] not in quantized]
    if missing or unexpected:
        raise CompressError(
            f"{folder}: weights do not match the model config (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    if allowed_missing:
        model.tie_weights()
    return model
