"""Entry points the quantized modules call. Each runs the Triton kernel or the plain-torch reference of the
same function, chosen by :mod:`compress.kernels.backend` (CUDA -> Triton, CPU -> reference; ``COMPRESS_KERNELS`` or
``use_backend`` force one; forcing Triton on CPU needs ``TRITON_INTERPRET=1``). Inputs may have any leading
dimensions; the last one is the input features.
"""

from __future__ import annotations

import torch

from compress.kernels import fp4, fp8_block, w4a16, w8a8
from compress.kernels.backend import choose_backend


def weight_only_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    num_bits: int,
    in_features: int,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    packed_n_contiguous: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` group-quantized in the pack-quantized layout (W4A16 and friends).
    ``packed_n_contiguous``: optional cached :func:`compress.kernels.w4a16.repack_n_contiguous` of ``weight_packed``;
    without it the kernels read the on-disk words through a transposed view."""
    why_not = w4a16.check_kernel_input(num_bits, x)
    if choose_backend(x.device, not why_not, why_not) == "reference":
        return w4a16.weight_only_linear_reference(
            x, weight_packed, scale, zero_point, num_bits, in_features, group_size, g_idx, bias
        )
    packed_kn = packed_n_contiguous if packed_n_contiguous is not None else weight_packed.t()
    rows = x.reshape(-1, in_features)
    out = w4a16.weight_only_matmul(rows, packed_kn, scale, zero_point, num_bits, group_size, g_idx, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def quantize_per_token(
    x: torch.Tensor, dtype: torch.dtype, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8 or float8_e4m3fn) and fp32 scales ``[rows, 1]`` of the 2-D activations ``x``."""
    backend = choose_backend(x.device)
    if backend == "triton" and dtype == torch.float8_e4m3fn and w8a8.fp8_needs_decode(x.device):
        backend = "reference"  # Triton cannot emit FP8 before sm89; torch can
    if backend == "reference":
        return w8a8.quantize_per_token_reference(x, dtype, static_scale)
    return w8a8.quantize_per_token(x, dtype, static_scale)


def scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a @ b.T) * a_scale * b_scale.T + bias`` on already-quantized 8-bit operands (int8 or FP8)."""
    if choose_backend(a.device) == "reference":
        return w8a8.scaled_mm_reference(a, a_scale, b, b_scale, bias, out_dtype)
    return w8a8.scaled_mm(a, a_scale, b, b_scale, bias, out_dtype)


def _activation_quantized_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    rows = x.reshape(-1, weight.shape[1])
    codes, scale = quantize_per_token(rows, weight.dtype, input_scale)
    out = scaled_mm(codes, scale, weight, weight_scale, bias, x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """W8A8 int8: per-channel int8 ``weight [N, K]`` with ``weight_scale [N, 1]``, activations quantized per
    token on the fly; int32 sums, scales and bias in the epilogue, output in ``x.dtype``."""
    if weight.dtype != torch.int8:
        raise ValueError(f"int8_linear needs an int8 weight, got {weight.dtype}")
    return _activation_quantized_linear(x, weight, weight_scale, bias, None)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 W8A8 (e4m3): per-channel weight scales; activations per token, or static with ``input_scale``."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear needs a float8_e4m3fn weight, got {weight.dtype}")
    return _activation_quantized_linear(x, weight, weight_scale, bias, input_scale)


def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """FP8 block-wise (``FP8_BLOCK``): e4m3 ``weight [N, K]`` with one scale per 128x128 block, activations
    quantized per token and group of 128 on the fly; output in ``x.dtype``."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_block_linear needs a float8_e4m3fn weight, got {weight.dtype}")
    if choose_backend(x.device) == "reference":
        return fp8_block.fp8_block_linear_reference(x, weight, weight_scale, bias)
    return fp8_block.fp8_block_linear(x, weight, weight_scale, bias)


def quantize_per_token_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8-block activations: e4m3 codes of the 2-D ``x`` and fp32 scales ``[rows, ceil(K / 128)]``."""
    if choose_backend(x.device) == "reference":
        return fp8_block.quantize_per_token_group_reference(x)
    return fp8_block.quantize_per_token_group(x)


def fp8_block_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The block-scaled FP8 GEMM on operands :func:`quantize_per_token_group` and the checkpoint already hold."""
    if choose_backend(a.device) == "reference":
        return fp8_block.fp8_block_matmul_reference(a, a_scale, b, b_scale, bias, out_dtype)
    return fp8_block.fp8_block_matmul(a, a_scale, b, b_scale, bias, out_dtype)


def fp4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP4 weights (NVFP4: fp8 group-16 scales and a global scale; MXFP4: e8m0 group-32 scales) times 16-bit
    activations, the weight decoded tile by tile; output in ``x.dtype``."""
    why_not = "" if x.dtype in (torch.float16, torch.bfloat16) else f"{x.dtype} activations (fp16/bf16 only)"
    if choose_backend(x.device, not why_not, why_not) == "reference":
        return fp4.fp4_linear_reference(x, weight_packed, weight_scale, global_scale, bias)
    return fp4.fp4_linear(x, weight_packed, weight_scale, global_scale, bias)
