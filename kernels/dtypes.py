"""The project's one table of storage dtypes: KV-cache dtype names and the largest code of each 8-bit format.

Kernels, the engine, the KV-cache stage and the gate all read it from here, so a scale calibrated in one place
(``amax / qmax``) means the same thing everywhere. Imports only torch: the lowest layer, safe for any importer.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
QUANT_MAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
"""Largest magnitude of each 8-bit code: int8 symmetric, and the largest finite float8_e4m3fn."""
INT8_MAX = QUANT_MAX[torch.int8]
FP8_MAX = QUANT_MAX[torch.float8_e4m3fn]


def is_quantized(dtype: torch.dtype) -> bool:
    """8-bit storage that needs scales (int8, fp8), as opposed to a float dtype stored as is."""
    return dtype in QUANT_MAX


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """The ``kv_cache_dtype`` name of a torch dtype (``torch.bfloat16`` → ``bf16``)."""
    for name, candidate in KV_CACHE_DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"{dtype} is not a KV-cache dtype; use one of {list(KV_CACHE_DTYPES)}")
