"""W4A16 (and W8A16/W2A16) weight-only GEMM: group-quantized packed weights, 16-bit activations, fp32 sums.

Three paths chosen by M (thresholds in :mod:`compress.kernels.configs`): a split-K skinny kernel for decode (M <= 16)
whose many programs keep the weight stream at full bandwidth, a tiled GEMM that dequantizes in registers for mid-size M,
and, for large M, one dequantization pass into a scratch weight in the activation dtype followed by cuBLAS
(``torch.matmul``), since cuBLAS's GEMM outruns ours by more than the pass costs. All read the packed weight through a
``[K / codes_per_word, N]`` view with arbitrary strides, so they run on the on-disk pack-quantized tensor
(``weight_packed.t()``, a view) or on the N-contiguous copy made once by :func:`repack_n_contiguous`. Weight ``[n, k]``
is ``(u - 2**(b-1) - z[n, g(k)]) * s[n, g(k)]``, ``u`` the unsigned code at word ``k // (32 / b)``, shift ``b * (k % (32
/ b))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from compress.kernels.configs import (
    GEMV_MAX_M,
    SKINNY_MAX_M,
    W4A16_DEQUANT,
    W4A16_DEQUANT_MIN_M,
    W4A16_GEMM,
    W4A16_SKINNY,
    gpu_family,
    launch_options,
    m_bucket,
    pick_config,
)
from compress.kernels.dequant import dequantize_packed
from compress.kernels.w4a16_kernels import dequantize_kernel, gemm_kernel, gemv_kernel, skinny_kernel

KERNEL_BITS = (2, 4, 8)  # bit widths whose codes never straddle an int32 word


def weight_only_linear_reference(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    num_bits: int,
    in_features: int,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: dequantize the whole weight in fp32 (as the kernels do), then ``F.linear`` in the
    activation dtype."""
    weight = dequantize_packed(weight_packed, scale.float(), zero_point, num_bits, in_features, group_size, g_idx)
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def repack_n_contiguous(weight_packed: torch.Tensor) -> torch.Tensor:
    """``[N, K/8]`` on-disk words -> ``[K/8, N]`` contiguous, so a weight tile's rows are coalesced along N.
    The words themselves are unchanged (same codes, same shifts)."""
    return weight_packed.t().contiguous()


def check_kernel_input(num_bits: int, x: torch.Tensor) -> str:
    """Empty string when the kernels support this call, else why not (the dispatcher's error or fallback)."""
    if num_bits not in KERNEL_BITS:
        return f"{num_bits}-bit codes straddle int32 words; kernels support {KERNEL_BITS} bits"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"activations must be fp16/bf16/fp32, got {x.dtype}"
    return ""


def _atomic_add_supported(dtype: torch.dtype, device: torch.device) -> bool:
    if dtype == torch.bfloat16:  # bf16 atomics need sm90; the interpreter has none
        return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return True


def dequantize_weight_kn(
    packed_kn: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    num_bits: int,
    in_features: int,
    group_size: int,
    g_idx: torch.Tensor | None,
    dtype: torch.dtype,
    config: dict[str, int],
) -> torch.Tensor:
    """Dense ``W.T [K, N]`` in ``dtype`` by the Triton dequantization kernel: the scratch weight the large-M path
    hands to cuBLAS. Allocated per call from torch's caching allocator (no cudaMalloc after warm-up, and a CUDA
    graph can capture it), laid out like the packed words so the stores run along the axis the loads do."""
    meta, options = launch_options(config)
    meta.pop("KIND", None)
    K, N = in_features, packed_kn.shape[1]
    if packed_kn.stride(1) == 1:  # N-contiguous words (repack_n_contiguous)
        weight = torch.empty(K, N, device=packed_kn.device, dtype=dtype)
    else:  # the on-disk [N, K/8] words through a transposed view
        weight = torch.empty(N, K, device=packed_kn.device, dtype=dtype).t()
    zero = zero_point if zero_point is not None else scale
    grid = (triton.cdiv(K, meta["BLOCK_K"]), triton.cdiv(N, meta["BLOCK_N"]))
    dequantize_kernel[grid](
        packed_kn,
        scale,
        zero,
        scale if g_idx is None else g_idx,
        weight,
        N,
        K,
        packed_kn.stride(0),
        packed_kn.stride(1),
        scale.stride(0),
        scale.stride(1),
        zero.stride(0),
        zero.stride(1),
        weight.stride(0),
        weight.stride(1),
        BITS=num_bits,
        GROUP_SIZE=group_size,
        HAS_ZERO=zero_point is not None,
        HAS_G_IDX=g_idx is not None,
        ONE_GROUP_PER_TILE=g_idx is None and group_size % meta["BLOCK_K"] == 0,
        **meta,
        **options,
    )
    return weight


def weight_only_matmul(
    x: torch.Tensor,
    packed_kn: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    num_bits: int,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` for 2-D ``x [M, K]`` by the path the M thresholds pick; ``packed_kn`` is any
    ``[K / (32/b), N]`` int32 view of the packed weight. ``config`` overrides the tile table (tests use it to reach
    every code path; ``KIND`` picks the path: ``gemv``, ``dequant``, or the dot kernels by default)."""
    why_not = check_kernel_input(num_bits, x)
    if why_not:
        raise ValueError(why_not)
    M, K = x.shape
    N = packed_kn.shape[1]
    if packed_kn.dtype != torch.int32 or packed_kn.shape[0] != -(-K * num_bits // 32):
        raise ValueError(f"packed weight {tuple(packed_kn.shape)} {packed_kn.dtype} cannot hold K={K} codes")
    groups = -(-K // group_size)
    if scale.shape != (N, groups):
        raise ValueError(f"scale must be [N, groups] = [{N}, {groups}], got {tuple(scale.shape)}")
    skinny = M <= SKINNY_MAX_M
    if skinny:
        table = W4A16_SKINNY
    elif M >= W4A16_DEQUANT_MIN_M[gpu_family(x.device)]:
        table = W4A16_DEQUANT
    else:
        table = W4A16_GEMM
    zero = zero_point if zero_point is not None else scale
    shared = dict(
        BITS=num_bits,
        GROUP_SIZE=group_size,
        HAS_ZERO=zero_point is not None,
        HAS_G_IDX=g_idx is not None,
        HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )  # fp32 in, fp32 accuracy out

    def launch(chosen: dict[str, int]) -> torch.Tensor:
        meta, options = launch_options(chosen)
        kind = meta.pop("KIND", "dot")
        if kind == "dequant":
            weight_kn = dequantize_weight_kn(
                packed_kn, scale, zero_point, num_bits, K, group_size, g_idx, x.dtype, chosen
            )
            return torch.matmul(x, weight_kn) if bias is None else torch.addmm(bias.to(x.dtype), x, weight_kn)
        gemv = kind == "gemv"
        if gemv and (M > GEMV_MAX_M or g_idx is not None or group_size % (32 // num_bits)):
            raise ValueError(f"the gemv tile takes M <= {GEMV_MAX_M} rows without act-order, got M={M}")
        one_group = g_idx is None and group_size % meta["BLOCK_K"] == 0
        split_k = meta.get("SPLIT_K", 1)
        atomic_in_place = _atomic_add_supported(x.dtype, x.device)
        if split_k == 1:
            out = torch.empty(M, N, device=x.device, dtype=x.dtype)
        else:
            out = torch.zeros(M, N, device=x.device, dtype=x.dtype if atomic_in_place else torch.float32)
        args = (
            x,
            packed_kn,
            scale,
            zero,
            scale if g_idx is None else g_idx,
            scale if bias is None else bias,
            out,
            M,
            N,
            K,
            x.stride(0),
            x.stride(1),
            packed_kn.stride(0),
            packed_kn.stride(1),
            scale.stride(0),
            scale.stride(1),
            zero.stride(0),
            zero.stride(1),
            out.stride(0),
            out.stride(1),
        )
        if gemv:
            grid = (triton.cdiv(N, meta["BLOCK_N"]), split_k, M)
            gemv_kernel[grid](
                x,
                packed_kn,
                scale,
                zero,
                scale if bias is None else bias,
                out,
                N,
                K,
                *args[10:],
                BITS=num_bits,
                GROUP_SIZE=group_size,
                HAS_ZERO=zero_point is not None,
                HAS_BIAS=bias is not None,
                ONE_GROUP_PER_TILE=one_group,
                **meta,
                **options,
            )
        elif skinny:
            grid = (triton.cdiv(N, meta["BLOCK_N"]), split_k)
            skinny_kernel[grid](*args, **shared, ONE_GROUP_PER_TILE=one_group, BLOCK_M=16, **meta, **options)
        else:
            grid = (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
            gemm_kernel[grid](*args, **shared, ONE_GROUP_PER_TILE=one_group, **meta, **options)
        return out.to(x.dtype)

    if config is None:
        key = (
            m_bucket(M),
            N,
            K,
            num_bits,
            group_size,
            x.dtype,
            zero_point is not None,
            g_idx is not None,
            packed_kn.stride(),
            bias is not None,
        )
        config = pick_config(table, key, x.device, launch)
    return launch(config)
