"""The engine runs transformers' own model classes: for every family in ``tests/helpers.py`` (Qwen3's q/k norms,
Gemma's scaled embeddings, sandwich norms and soft-capping, Gemma-3's local/global layers, Phi-3's fused
projections) greedy generation through ``LLM`` equals transformers ``generate`` token for token, with the torch
reference and the Triton kernels (interpreter); sliding windows shorter than the prompts; an RTN int4 checkpoint."""

import copy

import pytest
import torch
from helpers import FAMILIES, build_tiny_model
from transformers import Gemma3TextConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig

from compress import oneshot
from compress.checkpoint import load_checkpoint
from compress.engine import LLM, SamplingParams
from compress.engine.model_runner import rope_recomputed_on_host
from compress.formats import QuantizedLinear

VOCAB = 320
NEW_TOKENS = SamplingParams(max_tokens=8, ignore_eos=True)


def prompts(lengths, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def transformers_greedy(model, prompt, max_tokens=NEW_TOKENS.max_tokens):
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


def assert_engine_matches_transformers(model, batch, **options):
    """One engine batch of prompts of different lengths (ragged prefills, then batched decodes) against transformers
    one prompt at a time; the model keeps its own attention implementation afterwards."""
    implementation = model.config._attn_implementation
    llm = LLM(model, **{"num_kv_blocks": 32, "block_size": 16, **options})
    outputs = llm.generate(batch, NEW_TOKENS)
    assert model.config._attn_implementation == implementation
    for prompt, output in zip(batch, outputs, strict=True):
        assert output.token_ids == transformers_greedy(model, prompt)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_for_every_family(family, backend):
    assert_engine_matches_transformers(build_tiny_model(family, VOCAB), prompts([3, 11, 21]), attention_backend=backend)


def rebuilt(family: str, **config_changes):
    """The family's tiny model with some config values changed and the same weights."""
    model = build_tiny_model(family, VOCAB)
    config = copy.deepcopy(model.config)
    for name, value in config_changes.items():
        setattr(config, name, value)
    changed = type(model)(config).eval()
    changed.load_state_dict(model.state_dict())
    return changed


def transformers_perplexity(model, text):
    ids = torch.tensor([text])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    return torch.nn.functional.cross_entropy(logits, ids[0, 1:]).exp().item()


def assert_perplexity_matches_transformers(model, unchanged, backend):
    """Teacher-forced perplexity through the engine (16-token prefill chunks on a cached prefix) equals
    transformers', and differs from the model without the feature under test (``unchanged``): greedy tokens barely
    depend on context or on logit scale in these tiny models, so the logits themselves are checked."""
    text = prompts([40], seed=5)[0]
    chunked = LLM(model, num_kv_blocks=32, attention_backend=backend, max_num_batched_tokens=16)
    ours = chunked.perplexity(text)
    assert ours == pytest.approx(transformers_perplexity(model, text), rel=1e-5)
    assert abs(ours / transformers_perplexity(unchanged, text) - 1) > 1e-4  # 10x the tolerance above


@pytest.mark.parametrize(
    ("family", "backend"),
    [
        ("mistral", "torch"),
        ("gemma2", "torch"),
        ("gemma3", "torch"),
        ("gemma2", "triton"),
    ],
)
def test_sliding_window_layers_match_transformers(family, backend):
    """Windows of 6 tokens: prompts, decodes and prefill chunks all see keys fall out of the window (mid-block,
    across blocks); Gemma-2/3 mix windowed and global layers, and Gemma-3's local layers have their own RoPE base."""
    model = rebuilt(family, sliding_window=6)
    assert_engine_matches_transformers(model, prompts([7, 26], seed=2), attention_backend=backend)
    assert_perplexity_matches_transformers(model, build_tiny_model(family, VOCAB), backend)


def sharp_gemma2(attn_logit_softcapping: float | None, final_logit_softcapping: float | None):
    """Gemma-2 with q/k projections scaled up 8x: a tiny random model's attention scores are ~0.03, far below any
    cap; these reach ~2, where a cap of 1 bites."""
    model = rebuilt(
        "gemma2", attn_logit_softcapping=attn_logit_softcapping, final_logit_softcapping=final_logit_softcapping
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gemma2_soft_capping_matches_transformers(backend):
    """Attention scores capped in our kernels, final logits in transformers' head: both at values that change the
    outputs (Gemma-2's own 50 and 30 never bite in a tiny model)."""
    assert_engine_matches_transformers(sharp_gemma2(1.0, 0.1), prompts([5, 18], seed=6), attention_backend=backend)
    for attention_cap, final_cap in ((1.0, None), (None, 0.1)):  # each cap alone changes the logits
        assert_perplexity_matches_transformers(
            sharp_gemma2(attention_cap, final_cap), sharp_gemma2(None, None), backend
        )


@pytest.mark.parametrize(("family", "backend"), [("llama", "triton"), ("gemma2", "torch"), ("phi3", "torch")])
def test_rtn_int4_checkpoint_matches_transformers(tmp_path, family, backend):
    """A compressed-tensors W4 checkpoint loaded back with QuantizedLinear modules: the engine runs those modules
    inside transformers' forward, so its greedy tokens equal ``generate`` on the same loaded model."""
    model = build_tiny_model(family, VOCAB)
    rtn = [{"type": "rtn", "bits": 4, "group_size": 32, "symmetric": True}]
    checkpoint = oneshot(model, rtn, data=torch.zeros(1, 8, dtype=torch.long), output_dir=tmp_path / "w4")
    loaded, _ = load_checkpoint(checkpoint)
    assert isinstance(loaded.model.layers[0].mlp.down_proj, QuantizedLinear)
    assert not loaded.model.layers[0].mlp.down_proj.keep_dense_on_cpu  # only the engine keeps dense copies
    assert_engine_matches_transformers(loaded, prompts([4, 13, 22], seed=3), attention_backend=backend)
    assert loaded.model.layers[0].mlp.down_proj.keep_dense_on_cpu  # decoding on CPU: dequantized once


def test_unsupported_family_is_refused_with_the_supported_list():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported.*gemma2"):
        LLM(model, num_kv_blocks=8)


def test_bidirectional_gemma3_is_refused():
    """EmbeddingGemma-style configs attend both ways; paged causal attention would silently change them."""
    with pytest.raises(ValueError, match="bidirectionally"):
        LLM(rebuilt("gemma3", use_bidirectional_attention=True), num_kv_blocks=8)


def test_cuda_graphs_skip_a_rope_recomputed_on_host_in_any_layer_type():
    """Dynamic NTK recomputes frequencies from a host-read length that a CUDA graph would freeze; Gemma-3 keys its
    rope parameters by layer type, so a dynamic global layer must be found there too."""
    dynamic = {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}
    assert rope_recomputed_on_host(LlamaConfig(rope_parameters=dynamic))
    assert not rope_recomputed_on_host(LlamaConfig())
    assert not rope_recomputed_on_host(Gemma3TextConfig(head_dim=16))
    local = {"rope_type": "default", "rope_theta": 1e4}
    assert rope_recomputed_on_host(
        Gemma3TextConfig(head_dim=16, rope_parameters={"sliding_attention": local, "full_attention": dynamic})
    )
