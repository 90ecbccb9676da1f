"""W4A16 (and W8A16/W2A16) weight-only GEMM: group-quantized packed weights, 16-bit activations, fp32 sums.

Three paths chosen by M (thresholds in :mod:`kernels.configs`): a split-K skinny kernel for decode (M <= 16) whose
many programs keep the weight stream at full bandwidth, a tiled GEMM that dequantizes in registers for mid-size M,
and, for large M, one dequantization pass into a scratch weight in the activation dtype followed by cuBLAS
(``torch.matmul``), since cuBLAS's GEMM outruns ours by more than the pass costs. All read the packed weight through a
``[K / codes_per_word, N]`` view with arbitrary strides, so they run on the on-disk pack-quantized tensor
(``weight_packed.t()``, a view) or on the N-contiguous copy made once by :func:`repack_n_contiguous`.
Weight ``[n, k]`` is ``(u - 2**(b-1) - z[n, g(k)]) * s[n, g(k)]``, ``u`` the unsigned code at word
``k // (32 / b)``, shift ``b * (k % (32 / b))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.configs import (
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
from kernels.dequant import dequantize_packed
from kernels.tiling import grouped_tile_offsets

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


@triton.jit
def _dequantized_tile(
    packed_ptr,
    scale_ptr,
    zero_ptr,
    g_idx_ptr,
    k_start,
    offs_n,
    K,
    N,
    stride_pk,
    stride_pn,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    ONE_GROUP_PER_TILE: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``[BLOCK_K, BLOCK_N]`` fp32 weight tile (``k_start`` and BLOCK_K multiples of the codes per word). The
    ``[BLOCK_K / codes, BLOCK_N]`` words are loaded once and unpacked in registers: loading each word once per
    code it holds made every pipelined stage copy the tile into shared memory that many times (int4: 8x; e.g.
    127 KiB for a 16x64x128 four-stage skinny tile instead of ~20, one block per SM), see
    ``benchmarks/kernel_static_check.py``. Codes past K (padding of the last word) meet zero activations."""
    CODES_PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // CODES_PER_WORD
    tl.static_assert(BLOCK_K % CODES_PER_WORD == 0, "BLOCK_K must hold whole words")
    offs_k = k_start + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    mask = mask_k[:, None] & (offs_n < N)[None, :]
    offs_w = k_start // CODES_PER_WORD + tl.arange(0, WORDS)
    word_mask = (offs_w * CODES_PER_WORD < K)[:, None] & (offs_n < N)[None, :]
    words = tl.load(packed_ptr + offs_w[:, None] * stride_pk + offs_n[None, :] * stride_pn, mask=word_mask, other=0)
    shifts = tl.arange(0, CODES_PER_WORD) * BITS
    unpacked = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
    unsigned = tl.reshape(unpacked, (BLOCK_K, unpacked.shape[2]))
    if ONE_GROUP_PER_TILE:  # the tile lies inside one group: one scale (and zero) per output column
        group = k_start // GROUP_SIZE
        mask_n = offs_n < N
        scale = tl.load(scale_ptr + offs_n * stride_sn + group * stride_sg, mask=mask_n, other=0.0)[None, :]
        if HAS_ZERO:
            zero = tl.load(zero_ptr + offs_n * stride_zn + group * stride_zg, mask=mask_n, other=0)[None, :]
    else:  # act-order (g_idx) or a tile spanning several groups: gather per column
        if HAS_G_IDX:
            groups = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
        else:
            groups = offs_k // GROUP_SIZE
        column, row = offs_n[None, :], groups[:, None]
        scale = tl.load(scale_ptr + column * stride_sn + row * stride_sg, mask=mask, other=0.0)
        if HAS_ZERO:
            zero = tl.load(zero_ptr + column * stride_zn + row * stride_zg, mask=mask, other=0)
    centered = unsigned - (1 << (BITS - 1))
    if HAS_ZERO:
        centered = centered - zero.to(tl.int32)
    return centered.to(tl.float32) * scale.to(tl.float32)


@triton.jit
def _dequantize_kernel(
    packed_ptr,
    scale_ptr,
    zero_ptr,
    g_idx_ptr,
    out_ptr,
    N,
    K,
    stride_pk,
    stride_pn,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_ok,
    stride_on,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    ONE_GROUP_PER_TILE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Large-M path, first half: program (k-block, n-block) writes its ``[BLOCK_K, BLOCK_N]`` tile of the dense
    weight ``W.T`` in the output dtype, with the same arithmetic as the GEMM kernels (fp32, then one rounding)."""
    k_start = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    w = _dequantized_tile(
        packed_ptr,
        scale_ptr,
        zero_ptr,
        g_idx_ptr,
        k_start,
        offs_n,
        K,
        N,
        stride_pk,
        stride_pn,
        stride_sn,
        stride_sg,
        stride_zn,
        stride_zg,
        BITS,
        GROUP_SIZE,
        HAS_ZERO,
        HAS_G_IDX,
        ONE_GROUP_PER_TILE,
        BLOCK_K,
    )
    out_ptrs = out_ptr + offs_k[:, None] * stride_ok + offs_n[None, :] * stride_on
    tl.store(out_ptrs, w.to(out_ptr.dtype.element_ty), mask=(offs_k < K)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _skinny_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    zero_ptr,
    g_idx_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_pk,
    stride_pn,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_om,
    stride_on,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ONE_GROUP_PER_TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Decode path: program (n-block, k-split) streams its slice of the weight once for all M <= 16 rows and
    adds its partial sum atomically when SPLIT_K > 1 (output zero-initialised by the launcher)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    first_tile = pid_k * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, k_tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(first_tile, last_tile):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=(offs_m < M)[:, None] & (offs_k < K)[None, :],
            other=0.0,
        )
        w = _dequantized_tile(
            packed_ptr,
            scale_ptr,
            zero_ptr,
            g_idx_ptr,
            tile * BLOCK_K,
            offs_n,
            K,
            N,
            stride_pk,
            stride_pn,
            stride_sn,
            stride_sg,
            stride_zn,
            stride_zg,
            BITS,
            GROUP_SIZE,
            HAS_ZERO,
            HAS_G_IDX,
            ONE_GROUP_PER_TILE,
            BLOCK_K,
        )
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc += bias[None, :] * (pid_k == 0).to(tl.float32)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    if SPLIT_K == 1:
        tl.store(out_ptrs, out, mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, out, mask=out_mask, sem="relaxed")


@triton.jit
def _gemm_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    zero_ptr,
    g_idx_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_pk,
    stride_pn,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_om,
    stride_on,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ONE_GROUP_PER_TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Prefill path: classic tiled GEMM, weight tile dequantized in registers right before the dot."""
    offs_m, offs_n = grouped_tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=(offs_m < M)[:, None] & (offs_k < K)[None, :],
            other=0.0,
        )
        w = _dequantized_tile(
            packed_ptr,
            scale_ptr,
            zero_ptr,
            g_idx_ptr,
            tile * BLOCK_K,
            offs_n,
            K,
            N,
            stride_pk,
            stride_pn,
            stride_sn,
            stride_sg,
            stride_zn,
            stride_zg,
            BITS,
            GROUP_SIZE,
            HAS_ZERO,
            HAS_G_IDX,
            ONE_GROUP_PER_TILE,
            BLOCK_K,
        )
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _gemv_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    zero_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_pk,
    stride_pn,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_om,
    stride_on,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ONE_GROUP_PER_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Decode path without tensor cores, one activation row per program (grid axis 2): each packed word is
    loaded once and its codes become floats by an exponent trick (``code | 0x4B000000`` is the float
    ``2**23 + code``, so one subtraction centres it exactly), sparing the conversion unit; the scale is applied
    once per word, and the ``[words, BLOCK_N]`` partial sums are reduced once at the end."""
    CODES: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // CODES
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_w = tl.arange(0, WORDS)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    first_tile = pid_k * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, k_tiles)
    acc = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    x_row = x_ptr + row * stride_xm
    for tile in range(first_tile, last_tile):
        word_rows = tile * WORDS + offs_w
        first_k = word_rows * CODES
        mask = (first_k < K)[:, None] & mask_n[None, :]
        words = tl.load(
            packed_ptr + word_rows[:, None] * stride_pk + offs_n[None, :] * stride_pn,
            mask=mask,
            other=0,
            eviction_policy="evict_first",
        )
        if ONE_GROUP_PER_TILE:  # one [BLOCK_N] scale row per tile instead of a gather per word row
            groups = tile * BLOCK_K // GROUP_SIZE
            scale = tl.load(scale_ptr + offs_n * stride_sn + groups * stride_sg, mask=mask_n, other=0.0)[None, :]
            zero_mask = mask_n[None, :]
        else:  # a word never straddles groups (GROUP_SIZE % CODES == 0)
            groups = (first_k // GROUP_SIZE)[:, None]
            scale = tl.load(scale_ptr + offs_n[None, :] * stride_sn + groups * stride_sg, mask=mask, other=0.0)
            zero_mask = mask
        offset = 8388608.0 + (1 << (BITS - 1))
        if HAS_ZERO:
            zero = tl.load(zero_ptr + offs_n[None, :] * stride_zn + groups * stride_zg, mask=zero_mask, other=0)
            offset = offset + zero.to(tl.float32)
        partial = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(CODES):
            x = tl.load(x_row + (first_k + j) * stride_xk, mask=first_k + j < K, other=0.0).to(tl.float32)
            codes = ((words >> (j * BITS)) & ((1 << BITS) - 1)) | 0x4B000000
            partial += x[:, None] * (codes.to(tl.float32, bitcast=True) - offset)
        acc += partial * scale.to(tl.float32)
    out = tl.sum(acc, axis=0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32) * (pid_k == 0).to(tl.float32)
    out_ptrs = out_ptr + row * stride_om + offs_n * stride_on
    if SPLIT_K == 1:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.atomic_add(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_n, sem="relaxed")


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
    _dequantize_kernel[grid](
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
            _gemv_kernel[grid](
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
            _skinny_kernel[grid](*args, **shared, ONE_GROUP_PER_TILE=one_group, BLOCK_M=16, **meta, **options)
        else:
            grid = (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
            _gemm_kernel[grid](*args, **shared, ONE_GROUP_PER_TILE=one_group, **meta, **options)
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
