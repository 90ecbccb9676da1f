"""W8A8: int8 or FP8 (e4m3) weights with per-channel scales, activations quantized per token at run time.

``y = (q_x @ q_w.T) * s_x[m] * s_w[n] + bias`` with int32 (int8) or fp32 (FP8) accumulation and the scales
applied in the epilogue. Activations are quantized by a fused one-row-per-program kernel: absmax pass, then
``q = round(x / s)`` with ``s = max(absmax, EPS) / QMAX`` (dynamic), or a given per-tensor ``s`` (static FP8).
GPUs without FP8 tensor cores (before sm89) run the same GEMM on the FP8 bits decoded to fp16 (exact: every
e4m3 value is an fp16 value), with the activations quantized by the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compress.kernels.configs import ACT_QUANT, SCALED_MM, launch_options, m_bucket, pick_config, supports_native_fp8
from compress.kernels.dtypes import QUANT_MAX
from compress.kernels.tiling import grouped_tile_offsets

SCALE_EPS = 1e-10  # keeps an all-zero row's scale finite; its codes are all zero anyway
ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: (v + M) - M rounds fp32 |v| < 2**22 to nearest, ties to even


def quantize_per_token_reference(
    x: torch.Tensor, dtype: torch.dtype, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch. ``x [M, K]`` -> codes ``[M, K]`` of ``dtype`` (int8 or float8_e4m3fn) and fp32 scales
    ``[M, 1]``: per token, or ``static_scale`` broadcast."""
    values = x.float()
    qmax = QUANT_MAX[dtype]
    if static_scale is None:
        scale = values.abs().amax(dim=-1, keepdim=True).clamp(min=SCALE_EPS) / qmax
    else:
        scale = static_scale.float().reshape(1, 1).expand(values.shape[0], 1)
    scaled = (values / scale).clamp(-qmax, qmax)
    codes = torch.round(scaled).to(torch.int8) if dtype == torch.int8 else scaled.to(torch.float8_e4m3fn)
    return codes, scale.contiguous()


EXACT_FP32_K = 1024  # |a·b| <= 128**2 * 1024 = 2**24 over 1024 int8 products: every fp32 partial sum is exact


def _exact_int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` of int8 ``a [M, K]`` and ``b [N, K]``, summed exactly and rounded once to fp32. Each stretch of
    ``EXACT_FP32_K`` columns is an fp32 GEMM whose partial sums are all exact integers; the stretches add up in
    float64: the same numbers as one float64 GEMM, without its cost on a CPU, where this is the W8A8 path."""
    if a.shape[1] <= EXACT_FP32_K:
        return a.float() @ b.float().T
    total = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64, device=a.device)
    for start in range(0, a.shape[1], EXACT_FP32_K):
        stop = start + EXACT_FP32_K
        total += a[:, start:stop].float() @ b[:, start:stop].float().T
    return total.float()


def scaled_mm_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Plain torch ``(a @ b.T) * a_scale * b_scale.T + bias``: ``a [M, K]``, ``b [N, K]`` int8 or FP8; scales
    ``[M, 1]`` and ``[N, 1]``. int8 products are summed exactly, as the int32 accumulator does: see
    :func:`_exact_int8_matmul`."""
    if a.dtype == torch.int8:
        acc = _exact_int8_matmul(a, b)
    else:
        acc = a.float() @ b.float().T
    out = acc * a_scale.float() * b_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@triton.jit
def _round_to_e4m3_grid(values):
    """Round fp32 values (|v| <= 448) to the nearest e4m3 value, ties to even, with exact power-of-two steps,
    so the cast that follows is exact on every GPU and in the interpreter (whose own fp8 rounding is wrong)."""
    bits = values.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    step_exponent = tl.maximum(exponent, -6) - 3  # 3 mantissa bits; below 2**-6 the subnormal step is 2**-9
    step = ((step_exponent + 127) << 23).to(tl.float32, bitcast=True)
    rounded = ((values / step + 12582912.0) - 12582912.0) * step
    sign = bits & -2147483648  # sign bit; keep the sign of values that round to zero, as torch does (-0.0)
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    K,
    stride_xm,
    stride_cm,
    QMAX: tl.constexpr,
    EPS: tl.constexpr,
    TO_FP8: tl.constexpr,
    STATIC: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One row per program: the row is read twice (absmax, then codes); the second read hits L2."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(scale_ptr).to(tl.float32)
    else:
        absmax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            offs = start + tl.arange(0, BLOCK_K)
            values = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            absmax = tl.maximum(absmax, tl.abs(values))
        scale = tl.math.div_rn(tl.maximum(tl.max(absmax, axis=0), EPS), QMAX)
        tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK_K):
        offs = start + tl.arange(0, BLOCK_K)
        values = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        scaled = tl.minimum(tl.maximum(tl.math.div_rn(values, scale), -QMAX), QMAX)
        if TO_FP8:
            codes = _round_to_e4m3_grid(scaled).to(tl.float8e4nv)
        else:
            codes = ((scaled + 12582912.0) - 12582912.0).to(tl.int8)  # ROUND_MAGIC: round half to even
        tl.store(codes_ptr + row * stride_cm + offs, codes, mask=offs < K)


def quantize_per_token(
    x: torch.Tensor, dtype: torch.dtype, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`quantize_per_token_reference` (same outputs)."""
    if dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"activation codes must be int8 or float8_e4m3fn, got {dtype}")
    if static_scale is not None and dtype != torch.float8_e4m3fn:
        raise ValueError("a static input scale is supported for FP8 activations only")
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    codes = torch.empty(M, K, device=x.device, dtype=dtype)
    if static_scale is None:
        scale = torch.empty(M, 1, device=x.device, dtype=torch.float32)
    else:
        scale = static_scale.to(device=x.device, dtype=torch.float32).reshape(1, 1)
    if M == 0:
        return codes, scale.expand(M, 1)

    def launch(config: dict[str, int]) -> None:
        meta, options = launch_options(config)
        _quantize_rows_kernel[(M,)](
            x,
            codes,
            scale,
            K,
            x.stride(0),
            codes.stride(0),
            QMAX=QUANT_MAX[dtype],
            EPS=SCALE_EPS,
            TO_FP8=dtype != torch.int8,
            STATIC=static_scale is not None,
            **meta,
            **options,
        )

    launch(pick_config(ACT_QUANT, (m_bucket(M), K, x.dtype, dtype, static_scale is None), x.device, launch))
    return codes, scale if static_scale is None else scale.expand(M, 1)


@triton.jit
def _e4m3_bits_to_fp16(bits):
    """float8_e4m3fn bit patterns (uint8) -> fp16, exactly, for GPUs whose Triton has no FP8 type."""
    bits = bits.to(tl.int32)
    sign = (bits >> 7) & 1
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    normal_bits = (sign << 15) | ((exponent + 8) << 10) | (mantissa << 7)
    normal = normal_bits.to(tl.int16).to(tl.float16, bitcast=True)
    subnormal = (mantissa.to(tl.float32) * 0.001953125 * (1 - 2 * sign).to(tl.float32)).to(tl.float16)
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def _scaled_mm_kernel(
    a_ptr,
    b_ptr,
    a_scale_ptr,
    b_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_asm,
    stride_bsn,
    stride_om,
    stride_on,
    INT8: tl.constexpr,
    DECODE_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Tiled ``a @ b.T`` on 8-bit operands; ``b`` is the ``[N, K]`` weight, read K-major."""
    offs_m, offs_n = grouped_tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if INT8 else tl.float32)
    for tile in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
            mask=(offs_m < M)[:, None] & (offs_k < K)[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
            mask=(offs_k < K)[:, None] & (offs_n < N)[None, :],
            other=0.0,
        )
        if INT8:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        elif DECODE_FP8:
            acc = tl.dot(_e4m3_bits_to_fp16(a), _e4m3_bits_to_fp16(b), acc)
        else:  # Hopper's fp8 tensor cores sum in reduced precision: promote into fp32 once per K tile
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    a_scale = tl.load(a_scale_ptr + offs_m * stride_asm, mask=offs_m < M, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n * stride_bsn, mask=offs_n < N, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def fp8_needs_decode(device: torch.device) -> bool:
    """True where FP8 operands must be decoded to fp16 in the kernel (CUDA before sm89)."""
    return device.type == "cuda" and not supports_native_fp8(device.index or 0)


def scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    decode_fp8: bool | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Triton version of :func:`scaled_mm_reference`. ``decode_fp8`` forces (or forbids) the fp16-decode FP8
    path; by default it is used exactly where the GPU lacks FP8 tensor cores."""
    M, K = a.shape
    N = b.shape[0]
    if a.dtype != b.dtype or a.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"operands must both be int8 or both float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if b.shape[1] != K:
        raise ValueError(f"weight is [{N}, {b.shape[1]}] but activations have K={K}")
    if a_scale.shape != (M, 1) or b_scale.shape not in ((N, 1), (N,)):
        shapes = f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}"
        raise ValueError(f"scales must be [M, 1] and [N, 1], got {shapes}")
    int8 = a.dtype == torch.int8
    decode = (not int8) and (fp8_needs_decode(a.device) if decode_fp8 is None else decode_fp8)
    if decode:  # Triton without FP8 support reads the raw bytes
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    a_scale, b_scale = a_scale.float(), b_scale.float().reshape(N)

    def launch(chosen: dict[str, int]) -> torch.Tensor:
        meta, options = launch_options(chosen)
        out = torch.empty(M, N, device=a.device, dtype=out_dtype)
        grid = (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
        _scaled_mm_kernel[grid](
            a,
            b,
            a_scale,
            b_scale,
            bias if bias is not None else b_scale,
            out,
            M,
            N,
            K,
            a.stride(0),
            a.stride(1),
            b.stride(0),
            b.stride(1),
            a_scale.stride(0),
            b_scale.stride(0),
            out.stride(0),
            out.stride(1),
            INT8=int8,
            DECODE_FP8=decode,
            HAS_BIAS=bias is not None,
            **meta,
            **options,
        )
        return out

    if config is None:
        key = (m_bucket(M), N, K, a.dtype, decode, out_dtype, bias is not None)
        config = pick_config(SCALED_MM, key, a.device, launch)
    return launch(config)
