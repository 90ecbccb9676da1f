"""Paged KV write and paged attention: Triton kernels (interpreter) against the torch references, and the
references against plain dense causal attention."""

import pytest
import torch

from compress.kernels.kv_cache import QUANT_MAX, write_kv_reference, write_kv_triton
from compress.kernels.paged_attention import paged_attention_reference, paged_attention_triton

pytestmark = pytest.mark.gpu  # also run against the compiled kernels: COMPRESS_TEST_DEVICE=cuda pytest -m gpu

BLOCK_SIZE, NUM_BLOCKS, KV_HEADS, HEAD_DIM = 16, 24, 2, 32


def make_cache(dtype, scale_mode, generator):
    """Empty K/V caches and their scales: ``None``, static per-head, or per-token (filled by the writes)."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape).to(dtype), torch.zeros(shape).to(dtype)
    if scale_mode == "none":
        return k_cache, v_cache, None, None
    if scale_mode == "head":
        scales = 0.02 + 0.03 * torch.rand(2, KV_HEADS, generator=generator)
        return k_cache, v_cache, scales[0].contiguous(), scales[1].contiguous()
    return k_cache, v_cache, torch.zeros(shape[:3]), torch.zeros(shape[:3])


def ragged_batch(query_lens, context_lens, generator):
    """Block tables drawn from a shuffled pool (blocks out of order, as after churn) and the slot of every context
    position (cached prefix and new tokens alike: attention runs after the new K/V are written)."""
    pool = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    width = max(-(-c // BLOCK_SIZE) for c in context_lens)
    tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    slots = []
    for b, context_len in enumerate(context_lens):
        for i in range(-(-context_len // BLOCK_SIZE)):
            tables[b, i] = pool.pop()
        for pos in range(context_len):
            slots.append(int(tables[b, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return tables, torch.tensor(context_lens, dtype=torch.int32), starts, torch.tensor(slots)


@pytest.mark.parametrize(
    "cache_dtype,scale_mode",
    [
        (torch.float16, "none"),
        (torch.float32, "none"),
        (torch.int8, "head"),
        (torch.int8, "token"),
        (torch.float8_e4m3fn, "head"),
        (torch.float8_e4m3fn, "token"),
    ],
)
def test_write_kv_kernel_matches_reference(cache_dtype, scale_mode):
    generator = torch.Generator().manual_seed(0)
    key = torch.randn(40, KV_HEADS, HEAD_DIM, generator=generator)
    value = torch.randn(40, KV_HEADS, HEAD_DIM, generator=generator)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=generator)[:40]
    slots[3] = -1  # skipped slot
    ref = make_cache(cache_dtype, scale_mode, generator)
    tri = tuple(None if t is None else t.clone() for t in ref)
    write_kv_reference(key, value, ref[0], ref[1], slots, ref[2], ref[3])
    write_kv_triton(key, value, tri[0], tri[1], slots, tri[2], tri[3])
    for ref_t, tri_t in zip(ref, tri, strict=True):
        if ref_t is None:
            continue
        if ref_t.dtype == torch.float8_e4m3fn:
            # The interpreter's fp32->fp8 cast (not the GPU's) drops the carry when rounding up to a power of two
            # and flushes subnormals: those codes come out as half the power of two, or zero. All others match.
            ref_f, tri_f = ref_t.float(), tri_t.float()
            log2 = ref_f.abs().log2()
            halved = (log2 == log2.round()) & (tri_f == ref_f / 2)
            quirk = (ref_f != 0) & (halved | ((ref_f.abs() < 2**-6) & (tri_f == 0)))
            assert quirk.sum() < 0.05 * (ref_f != 0).sum()
            torch.testing.assert_close(tri_f[~quirk], ref_f[~quirk], rtol=0, atol=0)
        else:
            torch.testing.assert_close(tri_t, ref_t, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert untouched.sum() == NUM_BLOCKS * BLOCK_SIZE - 39  # the -1 slot wrote nothing
    assert not tri[0].view(-1, KV_HEADS, HEAD_DIM)[untouched].float().any()
    if cache_dtype in QUANT_MAX:  # the round trip through codes stays within half a quantization step
        flat_scale = ref[2] if ref[2].dim() == 1 else ref[2].view(-1, KV_HEADS)[slots[slots >= 0]]
        keep = slots >= 0
        codes = ref[0].view(-1, KV_HEADS, HEAD_DIM)[slots[keep]].float()
        step = flat_scale[..., None] if flat_scale.dim() == 2 else flat_scale[None, :, None]
        error = (codes * step - key[keep]).abs()
        clipped = key[keep].abs() >= QUANT_MAX[cache_dtype] * step
        bound = step / 2 if cache_dtype == torch.int8 else key[keep].abs() / 16 + step / 2**10
        assert bool(((error <= bound + 1e-6) | clipped).all())


def dense_causal_attention(q, keys, values, query_len, sliding_window=None, softcap=None):
    """Textbook attention of the last ``query_len`` positions over ``keys``/``values`` ``[ctx, kv_heads, d]``;
    a window keeps the last ``sliding_window`` positions up to the query, as transformers' sliding masks do."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) / HEAD_DIM**0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    context = keys.shape[0]
    mask = torch.ones(query_len, context).tril(context - query_len).bool()
    if sliding_window is not None:
        mask &= ~torch.ones(query_len, context).tril(context - query_len - sliding_window).bool()
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), values.float())


@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (6, None), (20, 0.5)])
@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1, 1, 1], [5, 40, 17]),  # decode, ragged contexts
        ([7, 1, 20, 3], [7, 33, 52, 3]),  # full prefills, a decode and a chunk after a cached prefix
    ],
)
def test_reference_matches_dense_attention(query_lens, context_lens, sliding_window, softcap):
    generator = torch.Generator().manual_seed(1)
    tables, contexts, starts, slots = ragged_batch(query_lens, context_lens, generator)
    total = sum(context_lens)
    keys = torch.randn(total, KV_HEADS, HEAD_DIM, generator=generator)
    values = torch.randn(total, KV_HEADS, HEAD_DIM, generator=generator)
    k_cache, v_cache, _, _ = make_cache(torch.float32, "none", generator)
    write_kv_reference(keys, values, k_cache, v_cache, slots)
    q = torch.randn(sum(query_lens), 2 * KV_HEADS, HEAD_DIM, generator=generator)
    out = paged_attention_reference(
        q, k_cache, v_cache, tables, contexts, starts, max(query_lens), sliding_window=sliding_window, softcap=softcap
    )
    offset = 0
    for b, (query_len, context_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        expected = dense_causal_attention(
            q[starts[b] : starts[b + 1]],
            keys[offset : offset + context_len],
            values[offset : offset + context_len],
            query_len,
            sliding_window,
            softcap,
        )
        torch.testing.assert_close(out[starts[b] : starts[b + 1]], expected, rtol=1e-5, atol=1e-5)
        offset += context_len


@pytest.mark.parametrize(
    "cache_dtype,scale_mode,q_dtype,group",
    [
        (torch.float16, "none", torch.float16, 2),
        (torch.float32, "none", torch.float32, 3),
        (torch.int8, "head", torch.float16, 2),
        (torch.int8, "token", torch.float32, 4),
        (torch.float8_e4m3fn, "head", torch.float32, 2),
        (torch.float8_e4m3fn, "token", torch.float16, 3),
    ],
)
@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1, 1, 1, 1], [3, 150, 64, 17]),  # decode: 150 tokens = 10 blocks -> 2 KV splits
        ([1, 9, 20, 1], [30, 9, 52, 16]),  # mixed: decodes, a full prefill, a chunk on a cached prefix
    ],
)
def test_triton_matches_reference(cache_dtype, scale_mode, q_dtype, group, query_lens, context_lens):
    generator = torch.Generator().manual_seed(2)
    tables, contexts, starts, slots = ragged_batch(query_lens, context_lens, generator)
    keys = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=generator)
    values = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=generator)
    k_cache, v_cache, k_scale, v_scale = make_cache(cache_dtype, scale_mode, generator)
    write_kv_reference(keys, values, k_cache, v_cache, slots, k_scale, v_scale)
    q = torch.randn(sum(query_lens), group * KV_HEADS, HEAD_DIM, generator=generator).to(q_dtype)
    args = (q, k_cache, v_cache, tables, contexts, starts, max(query_lens), k_scale, v_scale)
    expected = paged_attention_reference(*args)
    actual = paged_attention_triton(*args)
    tolerance = 2e-3 if q_dtype == torch.float16 else 1e-5
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tolerance, atol=tolerance)


DECODE = ([1, 1, 1, 1], [3, 150, 64, 17])  # 150 tokens: two KV splits of five blocks
MIXED = ([1, 9, 70, 1], [30, 9, 100, 16])  # prefill tiles whose windows start in different blocks


@pytest.mark.parametrize(
    "cache_dtype,scale_mode,sliding_window,softcap,query_lens,context_lens",
    [
        (torch.float32, "none", 5, None, *DECODE),  # window inside one block; the first split does no work
        (torch.float32, "none", 5, None, *MIXED),
        (torch.float32, "none", 40, 0.5, *DECODE),  # window across blocks; soft-capped scores
        (torch.float32, "none", 40, 0.5, *MIXED),
        (
            torch.float32,
            "none",
            120,
            None,
            *DECODE,
        ),  # the window starts inside the first split, which must stop at its end
        (torch.int8, "token", 24, 0.5, *DECODE),
        (torch.int8, "token", 24, 0.5, *MIXED),
    ],
)
def test_triton_sliding_window_and_softcap_match_reference(
    cache_dtype, scale_mode, sliding_window, softcap, query_lens, context_lens
):
    generator = torch.Generator().manual_seed(4)
    tables, contexts, starts, slots = ragged_batch(query_lens, context_lens, generator)
    keys = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=generator)
    values = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=generator)
    k_cache, v_cache, k_scale, v_scale = make_cache(cache_dtype, scale_mode, generator)
    write_kv_reference(keys, values, k_cache, v_cache, slots, k_scale, v_scale)
    q = torch.randn(sum(query_lens), 2 * KV_HEADS, HEAD_DIM, generator=generator)
    args = (
        q,
        k_cache,
        v_cache,
        tables,
        contexts,
        starts,
        max(query_lens),
        k_scale,
        v_scale,
        None,
        sliding_window,
        softcap,
    )
    expected = paged_attention_reference(*args)
    without = paged_attention_reference(*args[:-2])
    assert (expected - without).abs().max() > 1e-2  # the options change the result on these shapes
    torch.testing.assert_close(paged_attention_triton(*args), expected, rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_problem():
    generator = torch.Generator().manual_seed(3)
    k_cache, v_cache, _, _ = make_cache(torch.int8, "none", generator)
    tables, contexts, starts, _ = ragged_batch([1], [4], generator)
    q = torch.randn(1, 2 * KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="needs scales"):
        paged_attention_reference(q, k_cache, v_cache, tables, contexts, starts, 1)
    with pytest.raises(ValueError, match="multiple of"):
        paged_attention_reference(
            torch.randn(1, 3, HEAD_DIM), k_cache.float(), v_cache.float(), tables, contexts, starts, 1
        )
