"""FP4 (e2m1) weights, as compressed-tensors stores them (``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized``).

Storage, both formats: ``weight_packed`` uint8 ``[N, K/2]``, two 4-bit codes per byte along the input dim, the
even column in the LOW nibble; a code is ``sign << 3 | index`` into ``E2M1_GRID`` (so ``0x8`` is -0.0).

* NVFP4: groups of 16, ``weight_scale`` float8_e4m3fn ``[N, K/16]`` and ``weight_global_scale`` fp32 ``[1]``
  that DIVIDES: ``w = value * (weight_scale / weight_global_scale)``, computed in fp32.
* MXFP4: groups of 32, ``weight_scale`` uint8 ``[N, K/32]`` holding an e8m0 exponent: ``scale = 2 ** (e - 127)``.

The Triton GEMM here is for GPUs without FP4 tensor cores: it decodes each weight tile to the activations' dtype
(fp16/bf16) and runs a 16-bit dot with fp32 accumulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from compress.kernels.configs import Config, launch_options, m_bucket, pick_config
from compress.kernels.tiling import grouped_tile_offsets
from compress.kernels.w8a8 import _e4m3_bits_to_fp16

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of the eight non-negative e2m1 codes, in code order."""
E2M1_MAX = 6.0
NVFP4_GROUP = 16
MXFP4_GROUP = 32
E8M0_BIAS = 127
FP8_SCALE = torch.float8_e4m3fn
MX_SCALE = torch.uint8

# Every entry compiles for its family (sm90, sm80) without register spills.
FP4_MATMUL: dict[str, list[Config]] = {
    "hopper": [
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
    ],
    "ampere": [
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3),
    ],
    # BLOCK_K=32 spans two NVFP4 groups (and one MXFP4 group) per K tile; small M and N tiles exercise the masks.
    "interpreter": [dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)],
}


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., K]`` (values 0..15, K even) -> bytes ``[..., K/2]``: column ``2j`` in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even number of columns, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: bytes ``[..., K/2]`` -> codes ``[..., K]``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed FP4 weights must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of each 4-bit code (``0x8`` gives -0.0, as compressed-tensors' unpack does)."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    magnitude = grid[(codes & 0x7).long()]
    return torch.where((codes & 0x8).bool(), -magnitude, magnitude)


def e8m0_to_float(exponents: torch.Tensor) -> torch.Tensor:
    """fp32 ``2 ** (e - 127)`` of uint8 e8m0 scale exponents."""
    return torch.exp2(exponents.to(torch.float32) - E8M0_BIAS)


def uses_mx_scales(scales: torch.Tensor, global_scale: torch.Tensor | None) -> bool:
    """True for MXFP4 (uint8 e8m0 scales, no global scale), False for NVFP4 (fp8 scales with a global scale)."""
    if scales.dtype == MX_SCALE and global_scale is None:
        return True
    if scales.dtype == FP8_SCALE and global_scale is not None:
        return False
    raise ValueError(
        "FP4 scales must be uint8 e8m0 without a global scale (MXFP4) or float8_e4m3fn with one (NVFP4), "
        f"got {scales.dtype} {'with' if global_scale is not None else 'without'} a global scale"
    )


def effective_group_scales(scales: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 per-group multipliers: e8m0 exponents decoded (MXFP4) or ``fp8 scale / global scale`` (NVFP4)."""
    if uses_mx_scales(scales, global_scale):
        return e8m0_to_float(scales)
    return scales.float() / global_scale.float().reshape(1, 1)


def group_size_of(packed: torch.Tensor, scales: torch.Tensor) -> int:
    """Input channels per scale, from the shapes (``K = 2 * packed columns``), checked against the layout."""
    columns = packed.shape[-1] * 2
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] == 0 or columns % scales.shape[-1]:
        raise ValueError(f"scales {tuple(scales.shape)} do not tile the FP4 weight of {columns} input channels")
    return columns // scales.shape[-1]


def dequantize_fp4_reference(
    packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 weight ``[N, K]`` of a packed FP4 weight: ``value * effective group scale``."""
    group = group_size_of(packed, scales)
    values = e2m1_to_float(unpack_fp4(packed))
    return values * effective_group_scales(scales, global_scale).repeat_interleave(group, dim=-1)


def fp4_linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: the weight dequantized in fp32 and rounded to ``x.dtype`` (as the Triton kernel's tiles are, and
    the weight compressed-tensors decompresses to bf16), then ``F.linear`` in ``x.dtype``. An fp32 product of the
    unrounded NVFP4 weight differs by 2**-9 relative per weight in bf16, which W4A4's activation rounding downstream
    turns into whole FP4 steps (0.15 relative logits on a 4-layer model)."""
    weight = dequantize_fp4_reference(packed, scales, global_scale).to(x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


@triton.jit
def _e2m1_decode(codes):
    """4-bit codes (int32) -> fp32 values: exponent field 0 is the subnormal 0/0.5, else 2**(e-1) * (1 + m/2)."""
    exponent = (codes >> 1) & 0x3
    mantissa = (codes & 0x1).to(tl.float32)
    normal = tl.exp2((exponent - 1).to(tl.float32)) * (1.0 + 0.5 * mantissa)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, normal)
    return tl.where((codes & 0x8) != 0, -magnitude, magnitude)


@triton.jit
def _fp4_matmul_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    global_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_scale_n,
    stride_om,
    GROUP_K: tl.constexpr,
    MX_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Tiled ``x @ W.T``: each ``[BLOCK_K, BLOCK_N]`` weight tile is read as bytes, split into nibbles, decoded,
    multiplied by its group scales and cast to the activations' dtype for the dot."""
    offs_m, offs_n = grouped_tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_n = offs_n.to(tl.int64)
    if not MX_SCALES:
        global_scale = tl.load(global_scale_ptr).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask_kn = mask_k[:, None] & mask_n[None, :]
        x = tl.load(
            x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        packed = tl.load(w_ptr + (offs_k // 2)[:, None] + rows_n[None, :] * stride_wn, mask=mask_kn, other=0)
        codes = (packed.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 0xF
        raw_scale = tl.load(
            scale_ptr + (offs_k // GROUP_K)[:, None] + rows_n[None, :] * stride_scale_n, mask=mask_kn, other=0
        )
        if MX_SCALES:  # e8m0: the exponent bits of an fp32 (code 0 is 2**-127, an fp32 subnormal)
            exponent = raw_scale.to(tl.int32)
            bits = tl.where(exponent == 0, 0x400000, exponent << 23)
            scale = bits.to(tl.float32, bitcast=True)
        else:
            scale = tl.math.div_rn(_e4m3_bits_to_fp16(raw_scale).to(tl.float32), global_scale)
        weight = (_e2m1_decode(codes) * scale).to(x.dtype)
        acc = tl.dot(x, weight, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """Triton weight-dequant GEMM: ``x [..., K]`` (fp16/bf16) times a packed FP4 weight ``[N, K/2]`` with NVFP4
    (fp8 scales + fp32 global scale) or MXFP4 (uint8 e8m0) group scales; returns ``x.dtype``."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"FP4 weight-only GEMM takes fp16 or bf16 activations, got {x.dtype}")
    group = group_size_of(packed, scales)
    mx = uses_mx_scales(scales, global_scale)
    N, K = packed.shape[0], packed.shape[1] * 2
    if x.shape[-1] != K:
        raise ValueError(f"weight has K={K} input channels but activations have {x.shape[-1]}")
    leading = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    packed, scale_bits = packed.contiguous(), scales.contiguous().view(torch.uint8)  # fp8 read as bits: any GPU
    global_scale = scale_bits if mx else global_scale.float().reshape(1).to(x.device)

    def launch(chosen: Config) -> torch.Tensor:
        meta, options = launch_options(chosen)
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
        _fp4_matmul_kernel[grid](
            x2,
            packed,
            scale_bits,
            global_scale,
            bias if bias is not None else global_scale,
            out,
            M,
            N,
            K,
            x2.stride(0),
            x2.stride(1),
            packed.stride(0),
            scale_bits.stride(0),
            out.stride(0),
            GROUP_K=group,
            MX_SCALES=mx,
            HAS_BIAS=bias is not None,
            **meta,
            **options,
        )
        return out

    if M == 0:
        return torch.empty(*leading, N, device=x.device, dtype=x.dtype)
    if config is None:
        key = (m_bucket(M), N, K, x.dtype, group, mx, bias is not None)
        config = pick_config(FP4_MATMUL, key, x.device, launch)
    return launch(config).reshape(*leading, N)
