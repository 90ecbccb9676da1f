"""The engine runs transformers' own model classes: for every family in ``tests/families.py`` (Qwen3's q/k norms,
Gemma's scaled embeddings, sandwich norms and soft-capping, Gemma-3's local/global layers, Phi-3's fused
projections) greedy generation through ``LLM`` equals transformers ``generate`` token for token, with the torch
reference and the Triton kernels (interpreter); sliding windows shorter than the prompts; an RTN int4 checkpoint."""

import copy

import pytest
import torch
from families import FAMILIES, build_tiny_model
from transformers import GPT2Config, GPT2LMHeadModel

from compress.checkpoint import load_checkpoint, save_checkpoint
from compress.engine import LLM, SamplingParams
from compress.pipeline import apply_stages
from compress.stages import build_chain

VOCAB = 320
NEW_TOKENS = SamplingParams(max_tokens=8, ignore_eos=True)


def prompts(lengths, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def transformers_greedy(model, prompt, max_tokens=NEW_TOKENS.max_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


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
    assert_engine_matches_transformers(build_tiny_model(family, VOCAB), prompts([3, 11, 21]),
                                       attention_backend=backend)


def with_sliding_window(family: str, window: int):
    """The family's tiny model, rebuilt with a window shorter than the prompts (same weights)."""
    model = build_tiny_model(family, VOCAB)
    config = copy.deepcopy(model.config)
    config.sliding_window = window
    windowed = type(model)(config).eval()
    windowed.load_state_dict(model.state_dict())
    return windowed


def transformers_perplexity(model, text):
    ids = torch.tensor([text])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    return torch.nn.functional.cross_entropy(logits, ids[0, 1:]).exp().item()


@pytest.mark.parametrize(("family", "backend"), [
    ("mistral", "torch"), ("gemma2", "torch"), ("gemma3", "torch"), ("gemma2", "triton"),
])
def test_sliding_window_layers_match_transformers(family, backend):
    """Windows of 6 tokens: prompts, decodes and 16-token prefill chunks all see keys fall out of the window
    (mid-block, across blocks); Gemma-2/3 mix windowed and global layers, and Gemma-3's local layers have their own
    RoPE base. Greedy tokens barely depend on context in these tiny models, so teacher-forced perplexity checks the
    logits too."""
    model = with_sliding_window(family, 6)
    assert_engine_matches_transformers(model, prompts([7, 26], seed=2), attention_backend=backend)
    text = prompts([40], seed=5)[0]
    chunked = LLM(model, num_kv_blocks=32, attention_backend=backend, max_num_batched_tokens=16)
    windowed = chunked.perplexity(text)
    assert windowed == pytest.approx(transformers_perplexity(model, text), rel=1e-5)
    full = transformers_perplexity(build_tiny_model(family, VOCAB), text)
    assert abs(windowed / full - 1) > 1e-3  # the window is what makes the difference


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_rtn_int4_checkpoint_matches_transformers(tmp_path, family):
    """A compressed-tensors W4 checkpoint loaded back with QuantizedLinear modules: the engine runs those modules
    inside transformers' forward, so its greedy tokens equal ``generate`` on the same loaded model."""
    model = build_tiny_model(family, VOCAB)
    [stage] = build_chain([{"type": "rtn", "bits": 4, "group_size": 32, "symmetric": True}])
    stage.prepare(model)
    apply_stages(model, [stage], torch.zeros(1, 8, dtype=torch.long), torch.device("cpu"), 1)
    save_checkpoint(model, None, tmp_path / "w4")
    loaded, _ = load_checkpoint(tmp_path / "w4")
    assert type(loaded.model.layers[0].mlp.down_proj).__name__ == "QuantizedLinear"
    assert_engine_matches_transformers(loaded, prompts([4, 13, 22], seed=3), attention_backend="triton")


def test_unsupported_family_is_refused_with_the_supported_list():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported.*gemma2"):
        LLM(model, num_kv_blocks=8)
