"""Tiny random models of every architecture family we support, built from transformers configs in milliseconds.

Each family keeps what makes it different from Llama at a size that calibrates in seconds: Qwen3's q/k norms,
Gemma's (1 + weight) RMSNorm scale, sandwich norms and soft-capping, Gemma-3's local/global layers, Phi-3's fused
``qkv_proj`` / ``gate_up_proj``, Mistral's sliding window, Qwen2's q/k/v biases.
"""

from __future__ import annotations

import torch

COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, tie_word_embeddings=True,
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

    config = Gemma2Config(vocab_size=vocab_size, head_dim=16, sliding_window=256, query_pre_attn_scalar=16,
                          **COMMON)
    return Gemma2ForCausalLM(config)


def _gemma3(vocab_size: int):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=vocab_size, head_dim=16, sliding_window=256, query_pre_attn_scalar=16,
                              **COMMON)
    return Gemma3ForCausalLM(config)


def _phi3(vocab_size: int):
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2, **COMMON)
    return Phi3ForCausalLM(config)


BUILDERS = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3,
    "gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3,
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
