"""Attention over the paged KV cache for a ragged batch: decodes, prefills and prefill chunks in one launch.

Every sequence ``b`` brings ``q_len`` new query tokens (packed, ``query_start_loc[b]:query_start_loc[b+1]``) whose
keys/values are already written to the cache; its context is ``context_lens[b]`` tokens, the last ``q_len`` of them
new. Query ``i`` sits at position ``context_len - q_len + i`` and attends causally to every cached position up to it,
so a chunk of a long prompt sees the prompt's cached prefix plus itself. Two per-layer options follow transformers'
semantics: ``sliding_window=w`` hides keys ``w`` or more positions behind the query (Mistral, Gemma-2/3 local
layers), and ``softcap=c`` squashes the scaled scores to ``c * tanh(score / c)`` (Gemma-2).

The Triton kernel gives one program a KV head and a tile of query tokens, and puts the tile's tokens *times* the query
heads sharing that KV head (GQA) in the rows of one matrix, so each K/V tile is loaded once for the whole group.
K/V are dequantized in-tile: codes go into the dot product and their scales multiply the scores (K) or the
probabilities (V). For decode the KV range is split across programs (flash-decoding) and a second kernel merges the
partial softmaxes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from compress.kernels.kv_cache import dequantize_reference, scale_mode, use_triton

# Masked scores start from a finite floor, so a row with nothing to attend to yields zeros instead of NaN.
_NEG_FLOOR = -1.0e30
_LOG2E = 1.4426950408889634


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens, query_start_loc):
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("q must be [tokens, heads, head_dim] and k/v caches [blocks, block_size, kv_heads, head_dim]")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {k_cache.shape[2]} KV heads")
    if block_tables.shape[0] != context_lens.shape[0] or query_start_loc.shape[0] != context_lens.shape[0] + 1:
        raise ValueError("block_tables, context_lens and query_start_loc disagree on the batch size")


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Plain torch, fp32 math. Decode-only batches (``max_query_len == 1``) run batched; others per sequence."""
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    scale_mode(k_cache, k_scale), scale_mode(v_cache, v_scale)  # reject a quantized cache without scales
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    batch = block_tables.shape[0]
    tables = block_tables.long()

    def gather(cache, scale, rows):
        """Dequantized ``[rows, num_blocks * block_size, kv_heads, head_dim]`` for the given block-table rows."""
        blocks = cache[tables[rows]]
        scales = None
        if scale is not None:
            scales = scale.expand(*blocks.shape[:4]) if scale.dim() == 1 else scale[tables[rows]]
        values = dequantize_reference(blocks, scales)
        return values.reshape(values.shape[0], -1, num_kv_heads, head_dim)

    def scaled(scores: torch.Tensor) -> torch.Tensor:
        scores = scores * sm_scale
        return scores if softcap is None else softcap * torch.tanh(scores / softcap)

    def visible(key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        """``[queries, keys]``: causal, and inside the window when the layer has one."""
        seen = key_pos[None, :] <= query_pos[:, None]
        if sliding_window is not None:
            seen &= key_pos[None, :] > query_pos[:, None] - sliding_window
        return seen

    if max_query_len == 1 and q.shape[0] == batch:
        keys, values = gather(k_cache, k_scale, slice(None)), gather(v_cache, v_scale, slice(None))
        queries = q.float().view(batch, num_kv_heads, group, head_dim)
        scores = scaled(torch.einsum("bhgd,bkhd->bhgk", queries, keys))
        mask = visible(torch.arange(keys.shape[1], device=q.device), context_lens.long() - 1)
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        out = torch.einsum("bhgk,bkhd->bhgd", scores.softmax(-1), values)
        return out.reshape(batch, num_heads, head_dim).to(q.dtype)

    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for b, context_len in enumerate(context_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        if end == start:
            continue
        rows = slice(b, b + 1)
        keys = gather(k_cache, k_scale, rows)[0, :context_len]
        values = gather(v_cache, v_scale, rows)[0, :context_len]
        query_pos = torch.arange(context_len - (end - start), context_len, device=q.device)
        mask = visible(torch.arange(context_len, device=q.device), query_pos)
        if softcap is None:  # torch's fused kernel (4-D inputs pick it on CPU): no fp32 [heads, queries, keys] scores
            attended = F.scaled_dot_product_attention(
                q[None, start:end].float().transpose(1, 2), keys[None].transpose(1, 2), values[None].transpose(1, 2),
                attn_mask=mask, scale=sm_scale, enable_gqa=True,
            )[0].transpose(0, 1)  # fmt: skip
        else:
            queries = q[start:end].float().view(end - start, num_kv_heads, group, head_dim)
            scores = scaled(torch.einsum("qhgd,khd->hgqk", queries, keys)).masked_fill(~mask, float("-inf"))
            attended = torch.einsum("hgqk,khd->qhgd", scores.softmax(-1), values)
        out[start:end] = attended.reshape(end - start, num_heads, head_dim).to(q.dtype)
    return out


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_start_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    qk_scale,
    blocks_per_split,
    sliding_window,
    softcap,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    NEG_FLOOR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    m_tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    context_len = tl.load(context_lens_ptr + seq)
    if m_tile * BLOCK_M < query_len:
        # Rows are (query token, query head of this KV head) pairs: the group shares every K/V load.
        rows = tl.arange(0, BLOCK_M * BLOCK_G)
        token = m_tile * BLOCK_M + rows // BLOCK_G
        head = kv_head * GROUP + rows % BLOCK_G
        row_valid = (token < query_len) & (rows % BLOCK_G < GROUP)
        query_pos = context_len - query_len + token
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q_offs = (query_start + token)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & mask_d[None, :], other=0.0)

        if SCALE_MODE == 1:
            qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
        # Causal: this tile needs keys up to its last query's position.
        last_token = tl.minimum(m_tile * BLOCK_M + BLOCK_M, query_len) - 1
        kv_end = context_len - query_len + last_token + 1
        first_block = split * blocks_per_split
        last_block = tl.minimum(first_block + blocks_per_split, tl.cdiv(kv_end, BLOCK_SIZE))
        if USE_WINDOW:  # start at the block holding the tile's first query's oldest visible key
            first_visible = context_len - query_len + m_tile * BLOCK_M - sliding_window + 1
            first_block = tl.maximum(first_block, tl.maximum(first_visible, 0) // BLOCK_SIZE)

        m_i = tl.full([BLOCK_M * BLOCK_G], NEG_FLOOR, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], dtype=tl.float32)
        # Each step covers BLOCKS_PER_TILE KV blocks (a 64-key tile): one-block steps left int8/fp8 caches
        # bound by per-step overhead rather than by the bytes they read.
        offs_n = tl.arange(0, BLOCK_SIZE * BLOCKS_PER_TILE)
        in_block = offs_n % BLOCK_SIZE
        for tile_block in range(first_block, last_block, BLOCKS_PER_TILE):
            block = tile_block + offs_n // BLOCK_SIZE
            block_valid = block < last_block
            physical = tl.load(block_tables_ptr + seq * stride_bt + block, mask=block_valid, other=0).to(tl.int64)
            key_pos = block * BLOCK_SIZE + in_block
            key_valid = (key_pos < context_len) & block_valid
            slots = physical * BLOCK_SIZE + in_block
            kv_offs = (slots[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + offs_d[None, :]
            kv_mask = key_valid[:, None] & mask_d[None, :]
            k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if SCALE_MODE == 2:
                k_scale = tl.load(k_scale_ptr + slots * NUM_KV_HEADS + kv_head, mask=key_valid, other=0.0)
                scores = scores * k_scale[None, :]
            scores = scores * qk_scale
            if USE_SOFTCAP:  # c * tanh(s / c) with tanh(x) = 1 - 2 / (exp(2x) + 1), then the log2(e) qk_scale left out
                scores = (softcap * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp(scores * (2.0 / softcap)) + 1.0))
            visible = (key_pos[None, :] <= query_pos[:, None]) & key_valid[None, :]
            if USE_WINDOW:
                visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.exp2(scores - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if SCALE_MODE == 2:
                p = p * tl.load(v_scale_ptr + slots * NUM_KV_HEADS + kv_head, mask=key_valid, other=0.0)[None, :]
            v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        if SCALE_MODE == 1:
            acc = acc * tl.load(v_scale_ptr + kv_head)

        out_token = (query_start + token).to(tl.int64)
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            o_offs = out_token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & mask_d[None, :])
        else:
            part = (out_token * (NUM_KV_HEADS * GROUP) + head) * NUM_SPLITS + split
            tl.store(part_m_ptr + part, m_i, mask=row_valid)
            tl.store(part_l_ptr + part, l_i, mask=row_valid)
            tl.store(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_valid[:, None])


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Combine per-split ``(max, sum, unnormalised output)`` into the softmax over the whole context."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    part = (token * NUM_HEADS + head) * NUM_SPLITS + splits
    m = tl.load(part_m_ptr + part)
    weight = tl.exp2(m - tl.max(m, axis=0))
    total = tl.sum(weight * tl.load(part_l_ptr + part), axis=0)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :])
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def num_kv_splits(max_blocks: int) -> int:
    """Flash-decoding split count: about 8 KV blocks per split, at most 16 splits, a power of two."""
    return min(16, triton.next_power_of_2(max(1, math.ceil(max_blocks / 8))))


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Triton version of :func:`paged_attention_reference`. Splits the KV range when every query is a decode.

    Never reads tensor values on the host, so decode steps can be captured in a CUDA graph."""
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    mode = scale_mode(k_cache, k_scale)
    if scale_mode(v_cache, v_scale) != mode:
        raise ValueError("k_scale and v_scale must be in the same mode (both per-head or both per-token)")
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of two >= 16 for the Triton kernel")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in head_dim")
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    batch, max_blocks = block_tables.shape
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    decode = max_query_len == 1
    # Dot operands need >= 16 rows: a decode pads the head group to 16, a prefill tile stacks tokens to ~64 rows.
    block_g = max(16, triton.next_power_of_2(group)) if decode else triton.next_power_of_2(group)
    block_m = 1 if decode else max(1, 64 // block_g)
    splits = num_kv_splits(max_blocks) if decode else 1
    if splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, splits, block_d, device=q.device, dtype=torch.float32)
        part_m = torch.empty(num_tokens, num_heads, splits, device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out
    dummy = context_lens
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    grid = (batch, num_kv_heads, triton.cdiv(max_query_len, block_m) * splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        dummy if k_scale is None else k_scale,
        dummy if v_scale is None else v_scale,
        block_tables,
        context_lens,
        query_start_loc,
        out,
        part_acc,
        part_m,
        part_l,
        sm_scale * (1.0 if softcap is not None else _LOG2E),
        triton.cdiv(max_blocks, splits),
        sliding_window or 0,
        softcap or 0.0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_G=block_g,
        NUM_SPLITS=splits,
        SCALE_MODE=mode,
        NEG_FLOOR=_NEG_FLOOR,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 queries get fp32 accuracy
        BLOCKS_PER_TILE=max(1, 64 // block_size),
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_acc,
            part_m,
            part_l,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=splits,
        )
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``[tokens, heads, head_dim]`` attention outputs: Triton on CUDA (or the interpreter), torch on CPU."""
    attend = paged_attention_triton if use_triton(q) else paged_attention_reference
    return attend(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        max_query_len,
        k_scale,
        v_scale,
        sm_scale,
        sliding_window,
        softcap,
    )
