"""FP8 block-wise (DeepSeek-V3 / compressed-tensors ``FP8_BLOCK``): e4m3 weights with one fp32 scale per 128x128
weight block, activations quantized per token and per group of 128 input channels at run time.

``y[m, n] = sum_g (sum_{k in g} qx[m, k] * qw[n, k]) * sx[m, g] * sw[n // 128, g]`` (with ``g`` the K group):
every K tile of the GEMM lies inside one activation group and one weight block, so the two scales multiply the
tile's partial dot product in fp32 before it joins the accumulator. The weight layout matches what
compressed-tensors writes for ``FP8_BLOCK``: ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale``
``[ceil(N / 128), ceil(K / 128)]`` with ``scale = amax(block) / 448`` (a zero block gets the scale dtype's eps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compress.kernels.configs import Config, launch_options, m_bucket, pick_config
from compress.kernels.dtypes import FP8_MAX
from compress.kernels.tiling import grouped_tile_offsets
from compress.kernels.w8a8 import SCALE_EPS, _e4m3_bits_to_fp16, _round_to_e4m3_grid, fp8_needs_decode

FP8 = torch.float8_e4m3fn
BLOCK = (128, 128)
"""Weight block (rows of the ``[N, K]`` weight, input channels) sharing one scale."""
GROUP = 128
"""Input channels per dynamic activation scale; equal to the weight block's width, as every FP8-block model uses."""

# Block-scaled GEMM tiles. BLOCK_K must divide the 128-wide scale group (one scale pair per K tile); BLOCK_N may
# span several 128-row weight blocks (the weight scale is gathered per column). K tiles >= 32 for 8-bit dots.
# Every entry compiles for its family without register spills (sm90 native FP8; sm80 fp16-decoded).
FP8_BLOCK_MATMUL: dict[str, list[Config]] = {
    "hopper": [
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=5),
        dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=5),
    ],
    "ampere": [
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    ],
    # BLOCK_K=32 puts four K tiles in each scale group; BLOCK_N=64 splits a 128-row weight block over two tiles.
    "interpreter": [dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)],
}
ACT_GROUP_QUANT: dict[str, list[Config]] = {
    "hopper": [dict(num_warps=1, num_stages=1), dict(num_warps=2, num_stages=1), dict(num_warps=4, num_stages=1)],
    "ampere": [dict(num_warps=1, num_stages=1), dict(num_warps=2, num_stages=1)],
    "interpreter": [dict(num_warps=1, num_stages=1)],
}


def _check_2d(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(tensor.shape)}")


def quantize_weight_fp8_blocks(
    weight: torch.Tensor, block: tuple[int, int] = BLOCK, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (float8_e4m3fn codes ``[N, K]``, scales ``[ceil(N/bn), ceil(K/bk)]``), RTN.

    compressed-tensors' ``calculate_qparams`` + ``quantize`` for ``FP8_BLOCK``: ``scale = amax / 448`` (edge blocks
    see only their real elements, as its zero padding does), an all-zero block gets the eps of ``scale_dtype``,
    codes ``= clamp(w / scale, ±448)`` cast to e4m3 (RNE). Both divisions run in the promoted dtype of weight and
    scale, as there: with ``scale_dtype`` equal to a bf16 weight's dtype (what compressed-tensors stores) the bytes
    are its bytes; the fp32 default divides in fp32, one rounding instead of bf16-then-e4m3.
    """
    _check_2d("weight", weight)
    rows, cols = weight.shape
    block_rows, block_cols = block
    arithmetic = torch.promote_types(weight.dtype, scale_dtype)
    padded = torch.nn.functional.pad(weight.to(arithmetic), (0, -cols % block_cols, 0, -rows % block_rows))
    blocks = padded.reshape(padded.shape[0] // block_rows, block_rows, padded.shape[1] // block_cols, block_cols)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).to(scale_dtype)
    scale = torch.where(scale == 0, torch.finfo(scale_dtype).eps, scale)
    scaled = blocks / scale.to(arithmetic)[:, None, :, None]
    codes = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(padded.shape)[:rows, :cols]
    return codes.contiguous(), scale


def dequantize_fp8_blocks(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """fp32 weight ``codes * scale`` with each block scale broadcast over its block (edge blocks cropped)."""
    rows, cols = codes.shape
    expanded = scale.float().repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return codes.float() * expanded[:rows, :cols]


def quantize_per_token_group_reference(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch. ``x [M, K]`` -> (float8_e4m3fn codes ``[M, K]``, fp32 scales ``[M, ceil(K/group)]``) with
    ``scale = max(amax(group), eps) / 448`` per token and group (the last group may be short)."""
    _check_2d("activations", x)
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -cols % group)).reshape(rows, -1, group)
    scale = padded.abs().amax(dim=-1).clamp(min=SCALE_EPS) / FP8_MAX
    codes = (padded / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(rows, -1)[:, :cols]
    return codes.contiguous(), scale


def fp8_block_linear_reference(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_blocks: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = BLOCK,
    group: int = GROUP,
) -> torch.Tensor:
    """Plain torch FP8-block linear: ``x [..., K]`` quantized per token-group, times the dequantized weight, in
    fp32; returns ``x.dtype``. The numerics every kernel of this format is judged against."""
    leading = x.shape[:-1]
    codes, scale = quantize_per_token_group_reference(x.reshape(-1, x.shape[-1]), group)
    out = fp8_block_matmul_reference(codes, scale, w_fp8, w_scale_blocks, bias, x.dtype, block, group)
    return out.reshape(*leading, w_fp8.shape[0])


def fp8_block_matmul_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    block: tuple[int, int] = BLOCK,
    group: int = GROUP,
) -> torch.Tensor:
    """Plain torch :func:`fp8_block_matmul`: both operands dequantized, one fp32 product."""
    a_dequant = a.float() * a_scale.float().repeat_interleave(group, dim=1)[:, : a.shape[1]]
    out = a_dequant @ dequantize_fp8_blocks(b, b_scale, block).T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@triton.jit
def _quantize_token_groups_kernel(
    x_ptr, codes_ptr, scale_ptr, K, stride_xm, stride_cm, stride_sm, GROUP: tl.constexpr, EPS: tl.constexpr
):
    """One (token, group) per program: absmax, scale, e4m3 codes rounded exactly (see ``_round_to_e4m3_grid``)."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    values = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(values), axis=0), EPS), 448.0)
    tl.store(scale_ptr + row * stride_sm + group, scale)
    scaled = tl.minimum(tl.maximum(tl.math.div_rn(values, scale), -448.0), 448.0)
    tl.store(codes_ptr + row * stride_cm + offs, _round_to_e4m3_grid(scaled).to(tl.float8e4nv), mask=offs < K)


def quantize_per_token_group(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`quantize_per_token_group_reference` (same codes and scales, bit for bit). GPUs
    without FP8 (before sm89) have no e4m3 type in Triton: there the reference quantizes (torch casts anywhere)."""
    _check_2d("activations", x)
    if fp8_needs_decode(x.device):
        return quantize_per_token_group_reference(x, group)
    if group & (group - 1) or group < 16:
        raise ValueError(f"the activation group must be a power of two >= 16, got {group}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    codes = torch.empty(rows, cols, device=x.device, dtype=FP8)
    scale = torch.empty(rows, triton.cdiv(cols, group), device=x.device, dtype=torch.float32)
    if rows == 0 or cols == 0:
        return codes, scale

    def launch(config: Config) -> None:
        _, options = launch_options(config)
        _quantize_token_groups_kernel[(rows, scale.shape[1])](
            x, codes, scale, cols, x.stride(0), codes.stride(0), scale.stride(0), GROUP=group, EPS=SCALE_EPS, **options
        )

    launch(pick_config(ACT_GROUP_QUANT, (m_bucket(rows), cols, x.dtype, group), x.device, launch))
    return codes, scale


@triton.jit
def _fp8_block_matmul_kernel(
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
    stride_bn,
    stride_a_scale_m,
    stride_b_scale_n,
    stride_om,
    SCALE_GROUP_K: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr,
    DECODE_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Tiled ``a @ b.T`` on e4m3 operands (K contiguous in both); each K tile's partial product is scaled by its
    activation-group and weight-block scales before it is accumulated."""
    offs_m, offs_n = grouped_tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_scale_rows = a_scale_ptr + offs_m.to(tl.int64) * stride_a_scale_m
    b_scale_rows = b_scale_ptr + (offs_n // SCALE_BLOCK_N).to(tl.int64) * stride_b_scale_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(
            a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + offs_k[:, None] + offs_n.to(tl.int64)[None, :] * stride_bn,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        if DECODE_FP8:
            partial = tl.dot(_e4m3_bits_to_fp16(a), _e4m3_bits_to_fp16(b))
        else:  # Hopper's fp8 tensor cores sum in reduced precision: promote into fp32 once per K tile
            partial = tl.dot(a, b, max_num_imprecise_acc=BLOCK_K)
        scale_group = (tile * BLOCK_K) // SCALE_GROUP_K
        a_scale = tl.load(a_scale_rows + scale_group, mask=mask_m, other=0.0)
        b_scale = tl.load(b_scale_rows + scale_group, mask=mask_n, other=0.0)
        acc += partial * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_block_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    block: tuple[int, int] = BLOCK,
    group: int = GROUP,
    decode_fp8: bool | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """Block-scaled FP8 GEMM: ``a [M, K]`` e4m3 with ``a_scale [M, ceil(K/group)]``, ``b [N, K]`` e4m3 with
    ``b_scale [ceil(N/block[0]), ceil(K/block[1])]``. ``decode_fp8`` forces (or forbids) decoding the FP8 bits to
    fp16 in the kernel; by default that happens exactly where the GPU lacks FP8 tensor cores."""
    _check_2d("activation codes", a)
    _check_2d("weight codes", b)
    M, K = a.shape
    N = b.shape[0]
    if a.dtype != FP8 or b.dtype != FP8:
        raise ValueError(f"operands must both be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if b.shape[1] != K:
        raise ValueError(f"weight is [{N}, {b.shape[1]}] but activations have K={K}")
    if group != block[1]:
        raise ValueError(f"the activation group ({group}) must equal the weight block width ({block[1]})")
    expected_a, expected_b = (M, triton.cdiv(K, group)), (triton.cdiv(N, block[0]), triton.cdiv(K, block[1]))
    if tuple(a_scale.shape) != expected_a or tuple(b_scale.shape) != expected_b:
        shapes = f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}"
        raise ValueError(f"scales must be {expected_a} and {expected_b}, got {shapes}")
    a, b = a.contiguous(), b.contiguous()
    decode = fp8_needs_decode(a.device) if decode_fp8 is None else decode_fp8
    if decode:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    a_scale, b_scale = a_scale.float().contiguous(), b_scale.float().contiguous()

    def launch(chosen: Config) -> torch.Tensor:
        meta, options = launch_options(chosen)
        if group % meta["BLOCK_K"]:
            raise ValueError(f"BLOCK_K={meta['BLOCK_K']} does not divide the scale group {group}")
        out = torch.empty(M, N, device=a.device, dtype=out_dtype)
        grid = (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
        _fp8_block_matmul_kernel[grid](
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
            b.stride(0),
            a_scale.stride(0),
            b_scale.stride(0),
            out.stride(0),
            SCALE_GROUP_K=group,
            SCALE_BLOCK_N=block[0],
            DECODE_FP8=decode,
            HAS_BIAS=bias is not None,
            **meta,
            **options,
        )
        return out

    if M == 0:
        return torch.empty(0, N, device=a.device, dtype=out_dtype)
    if config is None:
        key = (m_bucket(M), N, K, decode, out_dtype, bias is not None, block, group)
        config = pick_config(FP8_BLOCK_MATMUL, key, a.device, launch)
    return launch(config)


def fp8_block_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_blocks: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = BLOCK,
    group: int = GROUP,
) -> torch.Tensor:
    """Triton FP8-block linear (``x [..., K]`` in any float dtype): quantize the activations per token-group, then
    the block-scaled GEMM. Same numerics as :func:`fp8_block_linear_reference`."""
    leading = x.shape[:-1]
    codes, scale = quantize_per_token_group(x.reshape(-1, x.shape[-1]), group)
    out = fp8_block_matmul(codes, scale, w_fp8, w_scale_blocks, bias, x.dtype, block, group)
    return out.reshape(*leading, w_fp8.shape[0])
