"""MoE families in the engine: the model's own forward routes tokens (fused experts as transformers builds them, or
one compressed linear per expert as our checkpoints load), so greedy generation through ``LLM`` equals transformers
``generate`` token for token, for the float model and for its GPTQ int4 checkpoint."""

import pytest
import torch
from helpers import MOE_FAMILIES, build_tiny_moe

from compress.checkpoint import load_checkpoint, save_checkpoint
from compress.compression.in_memory import compress_model
from compress.formats import QuantizedLinear
from compress.formats.moe_experts import UnfusedExperts
from tests.compress.engine.test_engine_families import assert_engine_matches_transformers, prompts

SAMPLES = torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("family", "backend"), [*((family, "torch") for family in MOE_FAMILIES), ("qwen3_moe", "triton")]
)
def test_greedy_matches_transformers_on_the_fused_model(family, backend):
    assert_engine_matches_transformers(build_tiny_moe(family), prompts([3, 11, 21]), attention_backend=backend)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_matches_generate_on_the_per_expert_int4_checkpoint(tmp_path, family):
    model = build_tiny_moe(family)
    compress_model(model, [{"type": "gptq", "group_size": 32}], SAMPLES, batch_size=4)
    save_checkpoint(model, None, tmp_path / "ckpt")
    loaded, _ = load_checkpoint(tmp_path / "ckpt")
    experts = loaded.model.layers[0].mlp.experts
    assert isinstance(experts, UnfusedExperts)
    assert all(isinstance(linear, QuantizedLinear) for linear in experts.modules() if hasattr(linear, "in_features"))
    assert_engine_matches_transformers(loaded, prompts([3, 11, 21]), attention_backend="torch")
