"""Paged KV cache: storage dtypes, scales, and the op that writes new keys/values into it (quantizing on the way).

Layout, one tensor for K and one for V per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's
*slot* is ``block * block_size + offset``; slot ``-1`` means "do not write" (padding in a captured CUDA graph).

Quantized caches (int8, fp8 e4m3) store codes with fp32 scales, ``x ≈ code * scale``, in one of two modes:

* static: one scale per KV head ``[num_kv_heads]``, calibrated offline (the checkpoint's ``kv_cache_scheme``);
* per-token: one scale per token and KV head ``[num_blocks, block_size, num_kv_heads]``, computed at write time
  from the token's absolute maximum, used when no calibrated scale exists.

The scale tensor's rank tells the mode apart, so kernels and references take the same arguments.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from compress.kernels.dtypes import QUANT_MAX, is_quantized

# Floor on a per-token absolute maximum, so an all-zero token gets a usable scale instead of dividing by zero.
MIN_AMAX = 1e-6

SCALE_NONE, SCALE_PER_HEAD, SCALE_PER_TOKEN = 0, 1, 2


def scale_mode(cache: torch.Tensor, scale: torch.Tensor | None) -> int:
    """Which scale mode a (cache, scale) pair is in; rejects a quantized cache without scales."""
    if not is_quantized(cache.dtype):
        return SCALE_NONE
    if scale is None:
        raise ValueError(
            f"a {cache.dtype} KV cache needs scales: pass per-head [num_kv_heads] or per-token "
            "[num_blocks, block_size, num_kv_heads] fp32 scales"
        )
    return SCALE_PER_HEAD if scale.dim() == 1 else SCALE_PER_TOKEN


def use_triton(tensor: torch.Tensor) -> bool:
    """CUDA runs the Triton kernels; CPU runs the torch references unless the Triton interpreter is on (tests)."""
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def per_token_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scale ``[..., 1]`` of each token and head of ``x`` ``[..., head_dim]`` when no calibrated scale exists."""
    return x.float().abs().amax(-1, keepdim=True).clamp_min(MIN_AMAX) / QUANT_MAX[dtype]


def quantize_reference(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes of ``x / scale``, saturated; int8 rounds half up (``floor(y + 0.5)``), exactly as the kernel does."""
    qmax = QUANT_MAX[dtype]
    y = x.float() / scale
    if dtype == torch.int8:
        y = torch.floor(y + 0.5)
    return y.clamp(-qmax, qmax).to(dtype)


def dequantize_reference(codes: torch.Tensor, scale: torch.Tensor | None, out_dtype=torch.float32) -> torch.Tensor:
    """Cache values ``[..., num_kv_heads, head_dim]`` back to floats; ``scale`` per head or per token."""
    if scale is None:
        return codes.to(out_dtype)
    return (codes.float() * scale.float()[..., None]).to(out_dtype)


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at their slots; per-token scales are
    computed and stored too."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache, scale in ((key[keep], k_cache, k_scale), (value[keep], v_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])
        mode = scale_mode(cache, scale)
        if mode == SCALE_NONE:
            flat[slots] = x.to(cache.dtype)
            continue
        if mode == SCALE_PER_HEAD:
            token_scale = scale.float()[None, :, None]
        else:
            token_scale = per_token_scale(x, cache.dtype)
            scale.view(-1, scale.shape[-1])[slots] = token_scale[..., 0]
        flat[slots] = quantize_reference(x, token_scale, cache.dtype)


@triton.jit
def _quantize_store(
    x,
    cache_ptr,
    scale_ptr,
    slot,
    head,
    offs_d,
    mask_d,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT8: tl.constexpr,
    MIN_AMAX: tl.constexpr,
):
    row = (slot * NUM_KV_HEADS + head) * HEAD_DIM
    if SCALE_MODE == 0:
        tl.store(cache_ptr + row + offs_d, x.to(cache_ptr.dtype.element_ty), mask=mask_d)
    else:
        if SCALE_MODE == 1:
            scale = tl.load(scale_ptr + head)
        else:
            scale = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX) / QMAX
            tl.store(scale_ptr + slot * NUM_KV_HEADS + head, scale)
        y = x / scale
        if IS_INT8:
            y = tl.floor(y + 0.5)
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        tl.store(cache_ptr + row + offs_d, y.to(cache_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT8: tl.constexpr,
    MIN_AMAX: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        k = tl.load(key_ptr + token * stride_kt + head * stride_kh + offs_d, mask=mask_d, other=0.0)
        v = tl.load(value_ptr + token * stride_vt + head * stride_vh + offs_d, mask=mask_d, other=0.0)
        _quantize_store(
            k.to(tl.float32),
            k_cache_ptr,
            k_scale_ptr,
            slot,
            head,
            offs_d,
            mask_d,
            NUM_KV_HEADS,
            HEAD_DIM,
            SCALE_MODE,
            QMAX,
            IS_INT8,
            MIN_AMAX,
        )
        _quantize_store(
            v.to(tl.float32),
            v_cache_ptr,
            v_scale_ptr,
            slot,
            head,
            offs_d,
            mask_d,
            NUM_KV_HEADS,
            HEAD_DIM,
            SCALE_MODE,
            QMAX,
            IS_INT8,
            MIN_AMAX,
        )


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Triton version of :func:`write_kv_reference`: one program per (token, KV head)."""
    mode = scale_mode(k_cache, k_scale)
    if scale_mode(v_cache, v_scale) != mode:
        raise ValueError("k_scale and v_scale must be in the same mode (both per-head or both per-token)")
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value must be contiguous in head_dim")
    if num_tokens == 0:
        return
    dummy = slot_mapping  # unused pointer when there are no scales
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        dummy if k_scale is None else k_scale,
        dummy if v_scale is None else v_scale,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        SCALE_MODE=mode,
        QMAX=QUANT_MAX.get(k_cache.dtype, 1.0),
        IS_INT8=k_cache.dtype == torch.int8,
        MIN_AMAX=MIN_AMAX,
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write new K/V into the paged cache: Triton on CUDA (or under the interpreter), torch reference on CPU."""
    write = write_kv_triton if use_triton(key) else write_kv_reference
    write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
