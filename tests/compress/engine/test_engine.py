"""Engine on tiny random Llama-family models: exactness against transformers, and the scheduler/cache features
(chunked prefill, prefix cache, copy-on-write, preemption) changing nothing in the outputs."""

import pytest
import torch
from helpers import wide_init_model

from compress.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu  # also run against the compiled kernels: COMPRESS_TEST_DEVICE=cuda pytest -m gpu

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def prompts(lengths, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


def transformers_greedy(model, prompt, max_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def engine(model, **options):
    return LLM(model, **{"num_kv_blocks": 64, "attention_backend": "torch", **options})


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3-rope"])
def test_greedy_matches_transformers_generate(kind):
    model = wide_init_model(kind)
    batch = prompts([5, 17, 33, 40, 70])
    # A small token budget mixes decodes with prefill chunks in the same steps.
    outputs = engine(model, max_num_batched_tokens=24).generate(batch, GREEDY)
    for prompt, output in zip(batch, outputs, strict=True):
        assert output.token_ids == transformers_greedy(model, prompt, GREEDY.max_tokens)
        assert output.finish_reason == "length"


def test_triton_kernels_in_the_engine_match_transformers():
    """The Triton write and attention kernels (interpreter), chunked, end to end."""
    model = wide_init_model()
    batch = prompts([9, 20])
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outputs = engine(model, attention_backend="triton", max_num_batched_tokens=16).generate(batch, params)
    for prompt, output in zip(batch, outputs, strict=True):
        assert output.token_ids == transformers_greedy(model, prompt, params.max_tokens)


def test_chunked_prefill_equals_unchunked():
    model = wide_init_model()
    text = prompts([120])[0]
    whole = engine(model, max_num_batched_tokens=256, enable_prefix_caching=False)
    chunked = engine(model, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert chunked.perplexity(text) == pytest.approx(whole.perplexity(text), rel=1e-5)
    batch = prompts([50, 3, 90])
    assert [o.token_ids for o in chunked.generate(batch, GREEDY)] == [
        o.token_ids for o in whole.generate(batch, GREEDY)
    ]


def test_prefix_cache_reuses_shared_system_prompt():
    model = wide_init_model()
    system = prompts([48], seed=7)[0]  # three full blocks
    questions = prompts([5, 9, 13], seed=8)
    llm = engine(model)
    first = llm.generate([system + questions[0]], GREEDY)[0]
    later = llm.generate([system + q for q in questions[1:]], GREEDY)
    assert first.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in later] == [48, 48]
    assert llm.block_manager.prefix_hit_rate > 0.5
    cold = engine(model, enable_prefix_caching=False).generate([system + q for q in questions], GREEDY)
    assert [o.token_ids for o in [first, *later]] == [o.token_ids for o in cold]
    llm.block_manager.check_invariants([])


def test_copy_on_write_when_a_shared_block_is_rewritten():
    """An exactly block-aligned prompt that is fully cached must recompute its last token; the block holding it
    is shared with a running sequence, so it is copied first and the running sequence is undisturbed."""
    model = wide_init_model()
    prompt = prompts([32])[0]
    llm = engine(model)
    first = llm.add_request(prompt, GREEDY)
    llm.step()  # prefill: both blocks computed and registered in the prefix cache
    second = llm.add_request(prompt, GREEDY)
    llm.step()  # admits the second: both blocks hit, the last one copied before its last slot is rewritten
    a, b = llm.requests[first], llm.requests[second]
    assert b.num_cached_tokens == 31
    assert a.block_table[0] == b.block_table[0] and a.block_table[1] != b.block_table[1]
    pool = llm.runner.kv_pool
    assert torch.equal(pool[:, :, a.block_table[1], :15], pool[:, :, b.block_table[1], :15])
    while llm.has_unfinished():
        llm.step()
    expected = transformers_greedy(model, prompt, GREEDY.max_tokens)
    assert llm.output(first).token_ids == expected and llm.output(second).token_ids == expected


def test_preemption_by_recompute_gives_identical_output():
    model = wide_init_model()
    batch = prompts([30, 25, 40, 18, 33, 27])
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    roomy = engine(model).generate(batch, params)
    tight_llm = engine(model, num_kv_blocks=10)
    tight = tight_llm.generate(batch, params)
    assert tight_llm.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    tight_llm.block_manager.check_invariants([])
    assert tight_llm.block_manager.num_free_blocks == 10


def test_kv_cache_dtypes_keep_perplexity():
    model = wide_init_model()
    text = prompts([160], seed=3)[0]
    exact = engine(model).perplexity(text)
    # This random model's sharp logits magnify cache error; e4m3's 3 mantissa bits cost it ~2% here.
    assert engine(model, kv_cache_dtype="int8").perplexity(text) == pytest.approx(exact, rel=0.01)
    assert engine(model, kv_cache_dtype="fp8").perplexity(text) == pytest.approx(exact, rel=0.03)
    bf16 = engine(model, kv_cache_dtype="bf16", max_num_batched_tokens=1024)
    fp32 = engine(model, max_num_batched_tokens=1024)
    seq_logits = []
    for llm in (bf16, fp32):
        llm.add_request(text, SamplingParams(max_tokens=1))
        seq_logits.append(llm.runner.execute(llm.scheduler.schedule(), all_logits=True))
    error = (seq_logits[0] - seq_logits[1]).abs().max()
    assert 0 < error <= 0.03 * seq_logits[1].abs().max()  # bf16 keeps ~3 significant digits of K/V


def test_static_per_head_kv_scales_are_used():
    model = wide_init_model()
    for layer in model.model.layers:  # what a calibrated checkpoint carries
        layer.self_attn.register_buffer("k_scale", torch.full((2,), 0.05))
        layer.self_attn.register_buffer("v_scale", torch.full((1,), 0.03))
    llm = engine(model, kv_cache_dtype="int8")
    assert llm.runner.scale_pool is None
    assert torch.equal(llm.runner.kv_scales[0][1], torch.full((2,), 0.03))
    text = prompts([100], seed=4)[0]
    assert llm.perplexity(text) == pytest.approx(engine(model).perplexity(text), rel=0.05)


def test_sampling_seeds_top_k_and_stop_tokens():
    model = wide_init_model()
    batch = prompts([10, 20, 30])
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=123, ignore_eos=True)
    alone = engine(model).generate([batch[1]], seeded)[0].token_ids
    together = engine(model).generate(batch, [GREEDY, seeded, seeded])[1].token_ids
    assert alone == together  # a seeded request does not depend on its batch mates
    top1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True)
    greedy = engine(model).generate(batch, GREEDY)
    assert [o.token_ids[:10] for o in engine(model).generate(batch, top1)] == [o.token_ids[:10] for o in greedy]
    stop = greedy[0].token_ids[3]
    stopped = engine(model).generate([batch[0]], SamplingParams(max_tokens=12, stop_token_ids=(stop,)))[0]
    assert stopped.token_ids[-1] == stop and stopped.finish_reason == "stop"
    assert len(stopped.token_ids) == greedy[0].token_ids.index(stop) + 1


def test_stream_yields_the_generated_tokens_in_order():
    model = wide_init_model()
    batch = prompts([8, 15])
    expected = [o.token_ids for o in engine(model).generate(batch, GREEDY)]
    streamed: dict[int, list[int]] = {}
    finished = set()
    for event in engine(model).stream(batch, GREEDY):
        streamed.setdefault(event.request_id, []).append(event.token_id)
        if event.finished:
            finished.add(event.request_id)
    assert sorted(streamed.values()) == sorted(expected) and len(finished) == 2


def test_priority_runs_first_under_pressure():
    model = wide_init_model()
    llm = engine(model, max_num_seqs=1)
    low = llm.add_request(prompts([10])[0], GREEDY, priority=5)
    high = llm.add_request(prompts([12])[0], GREEDY, priority=0)
    llm.step()
    assert [s.seq_id for s in llm.scheduler.running] == [high] and llm.scheduler.waiting[0].seq_id == low


def test_bad_requests_fail_with_a_fix():
    model = wide_init_model()
    llm = engine(model, num_kv_blocks=4)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.add_request([1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="enlarge the pool"):
        llm.add_request([1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="tokenizer"):
        llm.add_request("hello")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine(model, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


@pytest.mark.parametrize("dense_copies", [True, False])
def test_cpu_dense_weights_off_keeps_no_dense_copy_and_decodes_the_same(dense_copies):
    """``cpu_dense_weights=false`` (the quick gate's setting): the quantized linears dequantize per call instead of
    keeping a dense copy (the dense model's memory), with the same greedy tokens."""
    from compress.compression.in_memory import compress_model
    from compress.formats import QuantizedLinear

    model = wide_init_model()
    compress_model(model, [{"type": "rtn", "bits": 4, "group_size": 32}], torch.zeros(1, 8, dtype=torch.long))
    batch = prompts([7, 19])
    outputs = engine(model, cpu_dense_weights=dense_copies).generate(batch, GREEDY)
    kept = [hasattr(m, "_dense") for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert kept and all(has == dense_copies for has in kept)
    for prompt, output in zip(batch, outputs, strict=True):
        assert output.token_ids == transformers_greedy(model, prompt, GREEDY.max_tokens)
