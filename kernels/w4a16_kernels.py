"""The W4A16 Triton kernels, one per access pattern, all reading the packed weight through a ``[K / codes_per_word,
N]`` view with arbitrary strides (see :mod:`compress.kernels.w4a16`, which picks one by M and launches it):

- ``skinny_kernel``: decode (M <= 16), one 16-row dot tile, split-K so that many programs keep the weight stream at
  full bandwidth;
- ``gemv_kernel``: decode without tensor cores, one activation row a program (the tile table's ``KIND="gemv"``
  entries, M <= ``GEMV_MAX_M``);
- ``gemm_kernel``: mid-size M, a tiled GEMM that dequantizes each weight tile in registers before the dot;
- ``dequantize_kernel``: large M, one pass into a scratch weight in the activation dtype for cuBLAS.

``dequantized_tile`` is the one decoding of a ``[BLOCK_K, BLOCK_N]`` weight tile they share.
"""

from __future__ import annotations

import triton
import triton.language as tl

from compress.kernels.tiling import grouped_tile_offsets


@triton.jit
def dequantized_tile(
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
def dequantize_kernel(
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
    w = dequantized_tile(
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
def skinny_kernel(
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
        w = dequantized_tile(
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
def gemm_kernel(
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
        w = dequantized_tile(
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
def gemv_kernel(
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
    """Decode path without tensor cores, one activation row per program (grid axis 2). Each packed word is loaded
    once and its codes become floats without the conversion unit: masking code ``j`` in place (``p = j % (16 / BITS)``
    codes into its 16-bit half, the upper half shifted down once per word) and setting the exponent bits of 2**23
    gives the float ``2**23 + code * 2**(p * BITS)``; one subtraction centres it exactly, and the activation, scaled
    by ``2**-(p * BITS)`` once per word row, undoes the position. Three instructions a code (mask-or, subtract, fma)
    where a shift, extract, or, subtract and fma took five. The zero point enters once per word through the sum of
    the word's activations; the scale once per word; the ``[words, BLOCK_N]`` partial sums are reduced at the end."""
    CODES: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = 16 // BITS  # codes per 16-bit half word: 2**23 + code * 2**(p * BITS) stays exact
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
        low = tl.load(
            packed_ptr + word_rows[:, None] * stride_pk + offs_n[None, :] * stride_pn,
            mask=mask,
            other=0,
            eviction_policy="evict_first",
        ).to(tl.uint32, bitcast=True)  # logical shifts
        # Each half with the exponent bits of 2**23 set once per word: a code is then one AND with an immediate.
        high = (low >> 16) | 0x4B000000
        low = (low & 0xFFFF) | 0x4B000000
        if ONE_GROUP_PER_TILE:  # one [BLOCK_N] scale row per tile instead of a gather per word row
            groups = tile * BLOCK_K // GROUP_SIZE
            scale = tl.load(scale_ptr + offs_n * stride_sn + groups * stride_sg, mask=mask_n, other=0.0)[None, :]
            zero_mask = mask_n[None, :]
        else:  # a word never straddles groups (GROUP_SIZE % CODES == 0)
            groups = (first_k // GROUP_SIZE)[:, None]
            scale = tl.load(scale_ptr + offs_n[None, :] * stride_sn + groups * stride_sg, mask=mask, other=0.0)
            zero_mask = mask
        partial = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        x_sum = tl.zeros((WORDS,), dtype=tl.float32)
        for j in tl.static_range(CODES):
            x = tl.load(x_row + (first_k + j) * stride_xk, mask=first_k + j < K, other=0.0).to(tl.float32)
            x_sum += x
            position = (j % HALF) * BITS
            if j < HALF:
                field = low & ((((1 << BITS) - 1) << position) | 0x4B000000)
            else:
                field = high & ((((1 << BITS) - 1) << position) | 0x4B000000)
            value = field.to(tl.float32, bitcast=True) - (8388608.0 + (1 << (BITS - 1 + position)))
            partial += (x * (1.0 / (1 << position)))[:, None] * value
        if HAS_ZERO:
            zero = tl.load(zero_ptr + offs_n[None, :] * stride_zn + groups * stride_zg, mask=zero_mask, other=0)
            partial -= x_sum[:, None] * zero.to(tl.float32)
        acc += partial * scale.to(tl.float32)
    out = tl.sum(acc, axis=0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32) * (pid_k == 0).to(tl.float32)
    out_ptrs = out_ptr + row * stride_om + offs_n * stride_on
    if SPLIT_K == 1:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.atomic_add(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_n, sem="relaxed")
