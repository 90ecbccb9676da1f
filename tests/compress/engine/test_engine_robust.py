"""Engine robustness (issue 11): a bad request or a failing step never poisons the engine, and ``auto`` runs the
checkpoint's own KV-cache dtype."""

import pytest
import torch
from helpers import wide_init_model

from compress.base.errors import CompressError
from compress.checkpoint import load_checkpoint, save_checkpoint
from compress.engine import LLM, SamplingParams
from compress.evals.generation import TransformersGenerator
from compress.evals.sides import kv_cache_dtype_of
from compress.grids.kv_quant import KVCacheScheme, calibrated_kv_cache_dtype, calibrated_kv_unused, set_scales
from compress.kernels.dtypes import KV_CACHE_DTYPES
from tests.compress.engine.test_engine import GREEDY, engine, prompts

SHORT = SamplingParams(max_tokens=4, ignore_eos=True)


def assert_idle_and_clean(llm: LLM) -> None:
    """Nothing queued or running, and every KV block back in the pool."""
    assert not llm.has_unfinished()
    llm.block_manager.check_invariants([])
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.parametrize("bad_id", [256, 60000, -3])
def test_out_of_range_token_id_is_rejected_and_later_calls_work(bad_id):
    model = wide_init_model()
    llm = engine(model)
    good = prompts([7, 11])
    with pytest.raises(ValueError, match=rf"token id {bad_id} .*vocabulary of 256"):
        llm.generate([good[0], [1, 2, bad_id, 4]], SHORT)
    assert_idle_and_clean(llm)
    with pytest.raises(ValueError, match=rf"token id {bad_id}"):
        llm.add_request([bad_id], SHORT)
    assert_idle_and_clean(llm)
    expected = engine(model).generate(good, SHORT)
    assert [o.token_ids for o in llm.generate(good, SHORT)] == [o.token_ids for o in expected]


@pytest.mark.parametrize(("bad_prompt", "message"), [([1] * 250, "max_model_len"), ([], "empty prompt")])
def test_one_bad_prompt_queues_nothing_of_its_batch(bad_prompt, message):
    model = wide_init_model()
    llm = engine(model)
    good = prompts([9, 5])
    with pytest.raises(ValueError, match=message) as error:
        llm.generate([good[0], bad_prompt, good[1]], GREEDY)
    assert_idle_and_clean(llm)
    assert str(error.value).startswith("prompt 1: ")  # which prompt of the batch is bad
    # The next call runs exactly its own prompt: nothing of the failed batch ran silently in it.
    outputs = llm.generate([good[1]], GREEDY)
    assert len(llm.requests) == 0 and len(outputs) == 1
    assert outputs[0].token_ids == engine(model).generate([good[1]], GREEDY)[0].token_ids


def corrupt_token_model(bad_token: int):
    """A model whose embedding row ``bad_token`` is NaN, as in a damaged checkpoint: a prompt holding that token
    gives NaN logits, which sampling with a temperature rejects in the middle of a step."""
    model = wide_init_model()
    with torch.no_grad():
        model.model.embed_tokens.weight[bad_token] = float("nan")
    return model


def test_a_step_that_raises_finishes_its_requests_with_an_error_and_later_calls_start_clean():
    model = corrupt_token_model(bad_token=5)
    llm = engine(model)
    clean = prompts([12, 6], seed=2)
    assert 5 not in clean[0] + clean[1]
    sampled = SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True, seed=0)
    first = llm.add_request([3, 5, 8], sampled)
    with pytest.raises(RuntimeError):
        llm.generate(clean, GREEDY)
    assert llm.output(first).finish_reason == "error"
    assert_idle_and_clean(llm)
    expected = [o.token_ids for o in engine(model).generate(clean, GREEDY)]
    assert [o.token_ids for o in llm.generate(clean, GREEDY)] == expected


def test_a_stream_closed_early_leaves_nothing_behind():
    model = wide_init_model()
    llm = engine(model)
    stream = llm.stream(prompts([8, 15]), GREEDY)
    next(stream)
    stream.close()
    assert_idle_and_clean(llm)
    assert [o.finish_reason for o in llm.generate(prompts([4]), SHORT)] == ["length"]


@pytest.fixture(scope="module", params=["int", "float"])
def kv_checkpoint(request, tmp_path_factory):
    """A tiny Llama checkpoint with a ``kv_cache_scheme`` (int8 or fp8) and per-KV-head K/V scales, written by our
    saver; the scales are ``amax / qmax`` of the projections on a sample, as calibration would pick them."""
    model = wide_init_model()
    scheme = KVCacheScheme(request.param, "attn_head")
    states = {}
    hooks = [
        getattr(layer.self_attn, f"{name}_proj").register_forward_hook(
            lambda module, args, output, key=(name, i): states.__setitem__(key, output)
        )
        for i, layer in enumerate(model.model.layers)
        for name in ("k", "v")
    ]
    with torch.no_grad():
        model(torch.tensor(prompts([48], seed=5)))
    for hook in hooks:
        hook.remove()
    for i, layer in enumerate(model.model.layers):
        k_peak, v_peak = (states[(name, i)].view(-1, 2, 16).abs().amax(dim=(0, 2)) for name in ("k", "v"))
        set_scales(layer.self_attn, (k_peak / scheme.qmax).view(2, 1, 1), (v_peak / scheme.qmax).view(2, 1, 1), scheme)
    folder = tmp_path_factory.mktemp(f"kv-{scheme.kv_cache_dtype}") / "checkpoint"
    save_checkpoint(model, None, folder, kv_cache_scheme=scheme.to_dict())
    return scheme.kv_cache_dtype, folder


def test_auto_kv_cache_dtype_is_the_checkpoints_kv_scheme(kv_checkpoint):
    dtype, folder = kv_checkpoint
    assert kv_cache_dtype_of(folder) == dtype  # the gate reads the same scheme
    llm = LLM(folder, num_kv_blocks=32, attention_backend="torch")
    assert llm.config.kv_cache_dtype == dtype
    assert llm.runner.kv_pool.dtype == KV_CACHE_DTYPES[dtype]
    assert llm.runner.scale_pool is None  # the calibrated per-head scales, not per-token ones
    output = llm.generate(prompts([10]), SHORT)[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 4
    # An unquantized cache stays available on request; another 8-bit format would misuse these scales.
    assert LLM(folder, num_kv_blocks=32, kv_cache_dtype="fp32").runner.kv_pool.dtype == torch.float32
    other = "fp8" if dtype == "int8" else "int8"
    with pytest.raises(CompressError, match=f"calibrated for {dtype}"):
        LLM(folder, num_kv_blocks=32, kv_cache_dtype=other)


def test_transformers_generator_rounds_each_key_and_value_once(kv_checkpoint):
    """The gate's transformers loop must give the logits of a cacheless forward pass, which rounds every key and
    value once with the calibrated scales (the engine's static mode): a second rounding shows up as a difference."""
    dtype, folder = kv_checkpoint
    model, _ = load_checkpoint(folder)
    other = "fp8" if dtype == "int8" else "int8"
    with pytest.raises(CompressError, match=f"calibrated for {dtype}"):
        TransformersGenerator(model, None, other)
    generator = TransformersGenerator(model, None, kv_cache_dtype_of(folder))
    step_logits = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: step_logits.append(output[0, -1]))
    prompt = prompts([20], seed=6)[0]
    with torch.no_grad():
        generated = generator.generate(prompt, 6)
    hook.remove()
    assert len(step_logits) == len(generated) > 1
    with torch.no_grad():
        for step, logits in enumerate(step_logits):
            context = torch.tensor([prompt + generated[:step]])
            assert torch.allclose(logits, model(context).logits[0, -1], atol=1e-4), f"step {step}"


@pytest.fixture(scope="module")
def models_by_calibration(kv_checkpoint) -> dict:
    """``calibrated KV dtype → model``: the checkpoint's (int8 or fp8 per parametrization) and one without scales."""
    dtype, folder = kv_checkpoint
    return {dtype: load_checkpoint(folder)[0], None: wide_init_model()}


def _engine_answer(model, requested: str) -> str:
    try:
        return LLM(model, num_kv_blocks=32, attention_backend="torch", kv_cache_dtype=requested).config.kv_cache_dtype
    except (CompressError, ValueError):
        return "refused"


def _gate_generator(model, requested: str) -> TransformersGenerator | None:
    """The gate's generator for ``requested``; None when it refuses."""
    try:
        return TransformersGenerator(model, None, None if requested == "auto" else requested)
    except CompressError:
        return None


@pytest.mark.parametrize("requested", ["auto", *KV_CACHE_DTYPES])
def test_engine_and_gate_generator_answer_every_kv_cache_dtype_request_alike(models_by_calibration, requested):
    """One rule (compress.grids.kv_quant.resolve_kv_cache_dtype) for both runtimes: the gate used to refuse a float
    cache on a KV-calibrated checkpoint that the engine ran, so the gate could not measure what the engine would
    serve."""
    for calibrated, model in models_by_calibration.items():
        engine_says = _engine_answer(model, requested)
        generator = _gate_generator(model, requested)
        assert (generator is None) == (engine_says == "refused"), f"calibrated={calibrated}"
        assert generator is None or generator.kv_cache_dtype == engine_says, f"calibrated={calibrated}"
        if calibrated is not None:
            refused = requested not in ("auto", calibrated, "bf16", "fp16", "fp32")
            assert (engine_says == "refused") == refused, f"calibrated={calibrated}"


def test_float_cache_on_a_calibrated_checkpoint_leaves_the_scales_unused(kv_checkpoint):
    """A float cache stores K/V as computed in both runtimes: the generator's logits are those of a forward pass
    without the scales, its greedy tokens are the engine's, and the model keeps its scales afterwards."""
    dtype, folder = kv_checkpoint
    model, _ = load_checkpoint(folder)
    generator = TransformersGenerator(model, None, "fp32")
    step_logits = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: step_logits.append(output[0, -1]))
    prompt = prompts([20], seed=7)[0]
    generated = generator.generate(prompt, 6)
    hook.remove()
    assert calibrated_kv_cache_dtype(model) == dtype
    with torch.no_grad(), calibrated_kv_unused(model):
        for step, logits in enumerate(step_logits):
            context = torch.tensor([prompt + generated[:step]])
            assert torch.allclose(logits, model(context).logits[0, -1], atol=1e-4), f"step {step}"
        last_context = torch.tensor([prompt + generated[: len(step_logits) - 1]])
    with torch.no_grad():  # with the scales in use the same context gives other logits: the test can tell
        assert not torch.allclose(model(last_context).logits[0, -1], step_logits[-1], atol=1e-4)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    llm = LLM(model, num_kv_blocks=32, attention_backend="torch", kv_cache_dtype="fp32")
    assert list(llm.generate([prompt], params)[0].token_ids) == generated
