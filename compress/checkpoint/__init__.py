"""compressed-tensors checkpoints: write them atomically, read them back into ``QuantizedLinear`` modules; and the
runtime's one loader (:func:`load_checkpoint`), which dispatches any model folder or hub id on its
``quantization_config``.

The folder is an ordinary HF model folder (config.json, safetensors, tokenizer) whose ``config.json`` carries a
``quantization_config`` with ``quant_method: compressed-tensors`` and ``format: pack-quantized``, so vLLM and
transformers load it. Each quantized linear ``<name>`` stores ``<name>.weight_packed`` (int32, codes packed along the
input dim), ``<name>.weight_scale``, ``<name>.weight_shape`` and, when asymmetric, ``<name>.weight_zero_point``
(packed along the output dim) and, with act-order groups, ``<name>.weight_g_idx``.

MoE models: the stages quantize one linear per expert (``compress.formats.moe_experts``), and tensors and config groups
are named as hub checkpoints and vLLM's compressed-tensors MoE loader name them
(``model.layers.L.mlp.experts.N.gate_proj.*``; Mixtral ``model.layers.L.block_sparse_moe.experts.N.w1.*``); routers are
listed in ``ignore``. Loading rebuilds the per-expert structure; transformers loads the folder into its fused experts
through its own MoE weight conversion.

Imports only torch, safetensors and transformers: the engine loads checkpoints with it on a bare GPU box.

Modules, in import order: ``description`` (formats, ``quantization_config``, dtype names) → ``writer`` (stored
tensors, shards, the staged folder, the size summary) → ``reader`` (tensors back into quantized linears) → ``loading``
(the one loader of any model folder or hub id).
"""

from compress.checkpoint.description import quantization_config, source_dtype, torch_dtype
from compress.checkpoint.loading import load_checkpoint, load_tokenizer, loading_errors
from compress.checkpoint.reader import parameters_on_meta, read_config_json, read_quantization_config
from compress.checkpoint.validation import check_model_files
from compress.checkpoint.writer import CheckpointSummary, CheckpointWriter, save_checkpoint, summarize

__all__ = [
    "CheckpointSummary",
    "CheckpointWriter",
    "check_model_files",
    "load_checkpoint",
    "load_tokenizer",
    "loading_errors",
    "parameters_on_meta",
    "quantization_config",
    "read_config_json",
    "read_quantization_config",
    "save_checkpoint",
    "source_dtype",
    "summarize",
    "torch_dtype",
]
