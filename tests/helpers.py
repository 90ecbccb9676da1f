"""Builders every test shares: real byte-level BPE tokenizers trained in a second on local text (no hub), and tiny
random models of every supported family, small enough to calibrate in seconds.

Each family keeps what makes it different from Llama at a size that calibrates in seconds: Qwen3's q/k norms,
Gemma's (1 + weight) RMSNorm scale, sandwich norms and soft-capping, Gemma-3's local/global layers, Phi-3's fused
``qkv_proj`` / ``gate_up_proj``, Mistral's sliding window, Qwen2's q/k/v biases.
"""

from __future__ import annotations

from pathlib import Path

import torch


def build_tiny_tokenizer(vocab_size: int = 320):
    """A real byte-level BPE tokenizer trained in a second on pydoc text (no hub, no download)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([topics[k] for k in sorted(topics)[:20]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def build_tiny_llama(vocab_size: int = 320, seed: int = 0, **overrides):
    """A random Llama-family model small enough to calibrate in seconds (GQA: 4 query heads, 2 KV heads)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**settings)).eval()


def wide_init_model(kind: str = "llama", seed: int = 0):
    """Two layers, GQA 4:2; a wide init so greedy choices are not near-ties that rounding could flip."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
        initializer_range=0.2,
    )
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)).eval()
    if kind == "llama3-rope":
        rope = dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        return LlamaForCausalLM(LlamaConfig(**common, rope_parameters=rope)).eval()
    return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True)).eval()


def pydoc_tokenizer():
    """A 384-token byte-level BPE trained on CPython's pydoc topics: every byte is a token, as in SmolLM2."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = "\n\n".join(topics[key] for key in sorted(topics))[:100_000]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([text[start : start + 2000] for start in range(0, len(text), 2000)], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def tiny_model_for(tokenizer, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


def save(model, tokenizer, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def scale_by_noise(model, seed: int = 1, strength: float = 4.0):
    """A deliberately broken copy: every weight multiplied by (1 + strength × Gaussian noise)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.mul_(1 + strength * noise)
    return model


COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def _llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **COMMON))


def _mistral(vocab_size: int):
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(vocab_size=vocab_size, sliding_window=None, **COMMON))


def _qwen2(vocab_size: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab_size, use_sliding_window=False, **COMMON))


def _qwen3(vocab_size: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab_size, head_dim=16, use_sliding_window=False, **COMMON))


def _gemma2(vocab_size: int):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=vocab_size, head_dim=16, sliding_window=256, query_pre_attn_scalar=16, **COMMON)
    return Gemma2ForCausalLM(config)


def _gemma3(vocab_size: int):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=vocab_size, head_dim=16, sliding_window=256, query_pre_attn_scalar=16, **COMMON
    )
    return Gemma3ForCausalLM(config)


def _phi3(vocab_size: int):
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2, **COMMON)
    return Phi3ForCausalLM(config)


BUILDERS = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
}
FAMILIES = tuple(BUILDERS)


def build_tiny_model(family: str, vocab_size: int = 320, seed: int = 0) -> torch.nn.Module:
    """A random fp32 model of ``family``. Norm weights are randomised too: a freshly initialised RMSNorm is all ones
    (all zeros for Gemma's 1 + w form), which would hide a wrong norm-folding rule."""
    torch.manual_seed(seed)
    model = BUILDERS[family](vocab_size).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                parameter.copy_(torch.empty_like(parameter).uniform_(0.5, 1.5) - (1.0 if "gemma" in family else 0))
    return model


MOE_COMMON = dict(COMMON, intermediate_size=64, num_experts_per_tok=2)


def _mixtral(vocab_size: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=vocab_size, num_local_experts=4, **MOE_COMMON))


def _qwen2_moe(vocab_size: int):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=vocab_size,
        num_experts=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        use_sliding_window=False,
        **MOE_COMMON,
    )
    return Qwen2MoeForCausalLM(config)


def _qwen3_moe(vocab_size: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size, num_experts=4, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True, **MOE_COMMON
    )
    return Qwen3MoeForCausalLM(config)


def build_tiny_deepseek_v3(vocab_size: int = 320, seed: int = 0) -> torch.nn.Module:
    """DeepSeek-V3: MLA attention (low-rank q/kv projections), 4 routed experts + 1 shared, sigmoid group routing.
    Outside :data:`MOE_BUILDERS`: AWQ/SmoothQuant have no MLA mappings and the engine does not run MLA."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=vocab_size,
        **{**MOE_COMMON, "num_key_value_heads": 4},
        moe_intermediate_size=32,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=0,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
    )
    return DeepseekV3ForCausalLM(config).eval()


# MoE families (transformers 5 fuses their experts into 3-D parameters): 4 experts, top-2 routing, random routers, so
# a tiny calibration set leaves some experts rarely or never routed, as real MoE models do.
MOE_BUILDERS = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe}
MOE_FAMILIES = tuple(MOE_BUILDERS)


def build_tiny_moe(family: str, vocab_size: int = 320, seed: int = 0) -> torch.nn.Module:
    """A random fp32 MoE model of ``family``, norms randomised like :func:`build_tiny_model`'s; routers get a wide
    init so routing is decisive (not a near-tie that any rounding flips)."""
    torch.manual_seed(seed)
    model = MOE_BUILDERS[family](vocab_size).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                parameter.copy_(torch.empty_like(parameter).uniform_(0.5, 1.5))
            elif name.endswith("mlp.gate.weight"):
                parameter.normal_(0, 0.5)
    return model


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """‖logits − reference‖ / ‖reference‖: how far a compressed model's outputs moved."""
    return ((logits - reference).norm() / reference.norm()).item()


def never_route_to(router, expert: int) -> None:
    """Qwen3-MoE's routing with ``expert``'s logit at -inf: the router never picks it."""

    def forward(hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, router.hidden_dim), router.weight)
        logits[:, expert] = float("-inf")
        top, indices = torch.topk(logits.softmax(-1), router.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), indices

    router.forward = forward


def small_gate_policy(models_in_memory: int) -> dict:
    """A gate small enough for a tiny model with one layer of each way of measuring: windows (perplexity),
    generation (needle) and timing (latency, which can interleave both sides)."""
    return {
        "models_in_memory": models_in_memory,
        "backend": "transformers",
        "layers": ["perplexity", "needle", "latency"],
        "perplexity": {"seq_len": 64, "max_windows": 2},
        "needle": {"context_lengths": [160], "depths": [0.5], "trials": 1},
        "latency": {"prompt_tokens": 16, "new_tokens": 2, "repeats": 1, "warmup": 0, "blocking": False},
    }


def adapters_for(recipe: str) -> list[str]:
    """An adapter for each adapter-merging stage of a shipped recipe, which it leaves to the command line (the name
    is never read: enough to compose it)."""
    import yaml

    from compress.base.paths import recipes_dir

    stages = yaml.safe_load((recipes_dir() / f"{recipe}.yaml").read_text())["stages"]
    return [f"stages.{i}.adapters=[adapter]" for i, stage in enumerate(stages) if stage["type"] == "lora_merge"]
