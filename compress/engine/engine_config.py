"""Engine settings: one dataclass, checked once, so bad values fail at construction with a fix in the message."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compress.kernels.dtypes import KV_CACHE_DTYPES

ATTENTION_BACKENDS = ("auto", "triton", "torch")


@dataclass
class EngineConfig:
    """A field's meaning is the comment beside it (``compress config gate.engine`` prints them)."""

    block_size: int = 16  # tokens per KV block; a power of two >= 16 for the Triton kernels
    max_num_seqs: int = 64  # most sequences in one step (running batch size)
    max_num_batched_tokens: int = 1024  # token budget per step: decodes first, prefill chunks fill the rest
    max_model_len: int | None = None  # longest prompt + output; default: the model's max_position_embeddings, ≤ 8192
    # ``auto`` (the checkpoint's ``kv_cache_scheme`` if it has one, else the model's dtype), ``bf16``, ``fp16``,
    # ``fp32``, ``int8`` or ``fp8`` (e4m3). ``LLM`` resolves ``auto`` before it builds the runner.
    kv_cache_dtype: str = "auto"
    kv_cache_memory_gb: float | None = None  # KV pool size (null: gpu_memory_utilization of free GPU memory; CPU 1 GiB)
    num_kv_blocks: int | None = None  # exact pool size in blocks (overrides the memory budget; tests force preemption)
    gpu_memory_utilization: float = 0.9  # share of free GPU memory the KV pool may take when kv_cache_memory_gb is null
    enable_prefix_caching: bool = True  # reuse the KV blocks of a prompt prefix already computed
    enforce_eager: bool = False  # skip CUDA graphs for decode steps
    attention_backend: str = "auto"  # auto: Triton on CUDA or under TRITON_INTERPRET=1, else torch; or triton, torch
    # On CUDA, run each layer's q/k/v and gate/up W4A16 projections as one stacked GEMM (``engine/fusion.py``): fewer,
    # fuller launches at decode. ``false`` keeps one launch per projection (the A/B in ``bench engine``).
    fuse_projections: bool = True
    # On CPU, keep a dense copy of every quantized linear's weight: decoding ~6x faster than dequantizing it for every
    # call, for the memory of the dense model (425 MB for the default model in fp32). ``false`` saves that.
    cpu_dense_weights: bool = True

    def __post_init__(self) -> None:
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: choose auto or one of {list(KV_CACHE_DTYPES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r}: choose one of {ATTENTION_BACKENDS}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two (16 or more for Triton)")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be positive")

    @property
    def kv_dtype(self) -> torch.dtype:
        """The cache's storage dtype, once ``auto`` is resolved (``compress.grids.kv_quant.resolve_kv_cache_dtype``)."""
        if self.kv_cache_dtype == "auto":
            raise ValueError("kv_cache_dtype='auto' is not resolved yet; LLM resolves it from the model")
        return KV_CACHE_DTYPES[self.kv_cache_dtype]
