"""LoRA merge: merged logits equal base + adapter computed unmerged; adapters for another base fail clearly."""

import json

import pytest
import torch
from helpers import build_tiny_llama

from compress.base.errors import CompressError
from compress.compression.in_memory import compress_model
from compress.stages import build_chain
from compress.stages.lora import read_adapter, save_adapter

CPU = torch.device("cpu")
TARGETS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.down_proj")


def _random_factors(model, rank, seed, targets=TARGETS):
    generator = torch.Generator().manual_seed(seed)
    factors = {}
    for index in range(model.config.num_hidden_layers):
        for name in targets:
            linear = model.get_submodule(f"model.layers.{index}.{name}")
            a = torch.randn(rank, linear.in_features, generator=generator) * 0.1
            b = torch.randn(linear.out_features, rank, generator=generator) * 0.1
            factors[f"model.layers.{index}.{name}"] = (a, b)
    return factors


def _unmerged_logits(model, adapters, tokens):
    """base + Σ wᵢ·(α/r)·x·Aᵀ·Bᵀ added to each targeted linear's output by forward hooks (as peft runs it)."""
    handles = []
    for adapter, weight in adapters:
        for module, (a, b) in adapter.factors.items():
            scale = weight * adapter.scale[module]

            def hook(_module, args, output, a=a, b=b, scale=scale):
                return output + scale * (args[0] @ a.T @ b.T)

            handles.append(model.get_submodule(module).register_forward_hook(hook))
    try:
        with torch.no_grad():
            return model(tokens).logits
    finally:
        for handle in handles:
            handle.remove()


def _merge(model, adapters):
    [summary] = compress_model(
        model, [{"type": "lora_merge", "adapters": adapters}], torch.zeros(1, 8, dtype=torch.long), CPU, batch_size=1
    )
    return summary


def test_merged_logits_equal_base_plus_unmerged_adapters(tmp_path):
    base = build_tiny_llama()
    first = save_adapter(tmp_path / "first", _random_factors(base, rank=4, seed=1), rank=4, alpha=8)
    second = save_adapter(tmp_path / "second", _random_factors(base, rank=2, seed=2, targets=TARGETS[:2]), 2, 16)
    tokens = torch.randint(0, 320, (2, 24))
    expected = _unmerged_logits(base, [(read_adapter(first), 0.7), (read_adapter(second), -0.3)], tokens)
    with torch.no_grad():
        assert (expected - base(tokens).logits).abs().max() > 1e-2  # the adapters really change the model

    merged = build_tiny_llama()
    summary = _merge(merged, [{"path": str(first), "weight": 0.7}, {"path": str(second), "weight": -0.3}])
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, expected, atol=1e-5, rtol=1e-4)
    assert summary["adapters"][str(first)]["modules"] == 8 and summary["adapters"][str(second)]["modules"] == 4


def test_rslora_and_rank_pattern_scaling(tmp_path):
    base = build_tiny_llama()
    folder = save_adapter(tmp_path / "a", _random_factors(base, rank=4, seed=3), rank=4, alpha=8)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(use_rslora=True, alpha_pattern={"down_proj": 2})
    (folder / "adapter_config.json").write_text(json.dumps(config))
    adapter = read_adapter(folder)
    assert adapter.scale["model.layers.0.self_attn.q_proj"] == pytest.approx(8 / 2)  # α/√r
    assert adapter.scale["model.layers.1.mlp.down_proj"] == pytest.approx(2 / 2)


def test_adapter_for_a_different_base_is_refused_before_any_change(tmp_path):
    other = build_tiny_llama(hidden_size=32, intermediate_size=64)
    folder = save_adapter(tmp_path / "other", _random_factors(other, 4, 0), 4, 8, base_model="some/other-model")
    model = build_tiny_llama()
    before = model.model.layers[0].self_attn.q_proj.weight.clone()
    message = r"model.layers.0.mlp.down_proj adapts a 32x64 weight but the model's is 64x128; .*different base model"
    with pytest.raises(CompressError, match=message):
        _merge(model, [str(folder)])
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, before)

    deeper = build_tiny_llama(num_hidden_layers=3)
    folder = save_adapter(tmp_path / "deeper", _random_factors(deeper, 4, 0), 4, 8, base_model="deeper/model")
    message = r"\(trained on 'deeper/model'\) targets model.layers.2.mlp.down_proj, which this model does not have"
    with pytest.raises(CompressError, match=message):
        _merge(build_tiny_llama(), [str(folder)])


def test_unreadable_or_unsupported_adapters_name_the_problem(tmp_path):
    base = build_tiny_llama()
    folder = save_adapter(tmp_path / "dora", _random_factors(base, 2, 0), 2, 4)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(CompressError, match="DoRA"):
        read_adapter(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CompressError, match="missing adapter_config.json, adapter_model.safetensors"):
        read_adapter(tmp_path / "empty")
    with pytest.raises(CompressError, match=r"stages.0 \(lora_merge\): adapters is empty"):
        build_chain([{"type": "lora_merge"}])


def test_adapter_on_a_tied_head_is_refused(tmp_path):
    model = build_tiny_llama()  # tie_word_embeddings=True
    factors = {"lm_head": (torch.randn(2, 64), torch.randn(320, 2))}
    folder = save_adapter(tmp_path / "head", factors, 2, 4)
    with pytest.raises(CompressError, match="lm_head shares its weight with the input embeddings"):
        _merge(model, [str(folder)])


def test_merge_must_come_before_pruning_and_quantization():
    message = r"stages.1 \(lora_merge\) comes after stages.0 \(sparsegpt\); merge adapters first"
    with pytest.raises(CompressError, match=message):
        build_chain([{"type": "sparsegpt"}, {"type": "lora_merge", "adapters": ["x"]}])


def test_lora_merge_awq_int4_quantizes_the_merged_weights_as_awq_int4():
    """The same AWQ stage as the headline recipe; calibration stays on text (a model's own samples would come from
    the base model, before its adapters are merged)."""
    from compress.app.recipe import compose

    merged = compose("lora_merge_awq_int4", ["stages.0.adapters=[adapter]"])
    assert [stage["type"] for stage in merged.stages] == ["lora_merge", "awq"]
    assert merged.stages[1] == compose("awq_int4").stages[0]
    assert merged.data.generated == 0.0
