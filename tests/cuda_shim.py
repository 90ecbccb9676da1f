"""``COMPRESS_TEST_DEVICE=cuda``: run the kernel tests against the *compiled* kernels on a GPU.

The tests build CPU tensors (so they run in the Triton interpreter on CI). With this shim installed, every kernel
entry point moves its CPU tensor arguments to the GPU, runs there, copies arguments it changed in place (the paged
KV cache) back, and returns results on the CPU, so the same assertions judge the GPU code. References the tests
call directly stay on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

# (module, function) pairs that launch Triton kernels or dispatch to them.
ENTRY_POINTS = {
    "compress.kernels.ops": ["weight_only_linear", "quantize_per_token", "scaled_mm", "int8_linear", "fp8_linear"],
    "compress.kernels.w4a16": ["weight_only_matmul", "dequantize_weight_kn"],
    "compress.kernels.w8a8": ["quantize_per_token", "scaled_mm"],
    "compress.kernels.kv_cache": ["write_kv", "write_kv_triton"],
    "compress.kernels.paged_attention": ["paged_attention", "paged_attention_triton"],
    "compress.kernels.fp8_block": ["quantize_per_token_group", "fp8_block_matmul", "fp8_block_linear"],
    "compress.kernels.fp4": ["fp4_linear"],
}


def _on_cuda(function: Callable) -> Callable:
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        moved: list[tuple[torch.Tensor, torch.Tensor]] = []

        def to_cuda(value):
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                moved.append((value, value.cuda()))
                return moved[-1][1]
            if type(value) in (list, tuple):
                return type(value)(to_cuda(item) for item in value)
            return value

        result = function(*[to_cuda(a) for a in args], **{k: to_cuda(v) for k, v in kwargs.items()})
        if not moved:
            return result
        torch.cuda.synchronize()
        for original, copy in moved:
            if not torch.equal(original, copy.cpu()):
                original.copy_(copy.cpu())
        return _to_cpu(result)

    return wrapper


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if type(value) in (list, tuple):
        return type(value)(_to_cpu(item) for item in value)
    return value


def install() -> None:
    """Patch the entry points in place; call before any test module imports them."""
    import importlib

    if not torch.cuda.is_available():
        raise RuntimeError("COMPRESS_TEST_DEVICE=cuda but torch sees no CUDA device")
    for module_name, names in ENTRY_POINTS.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, _on_cuda(getattr(module, name)))
