"""The full chain through the real CLI on a tiny model: LoRA merge → 2:4 SparseGPT → distillation → GPTQ int4."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from compress.__main__ import main
from compress.stages.lora import save_adapter

SMALL = ["data.num_samples=8", "data.seq_len=64", "eval.seq_len=64", "eval.max_windows=3", "gate=none"]


def _random_adapter(folder, model_dir, rank=4, seed=0):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(seed)
    factors = {}
    for index in range(model.config.num_hidden_layers):
        for name in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
            linear = model.get_submodule(f"model.layers.{index}.{name}")
            a = torch.randn(rank, linear.in_features, generator=generator) * 0.05
            b = torch.randn(linear.out_features, rank, generator=generator) * 0.05
            factors[f"model.layers.{index}.{name}"] = (a, b)
    return save_adapter(folder, factors, rank, alpha=8, base_model=str(model_dir))


def _two_of_four(weight: torch.Tensor) -> bool:
    return bool(((weight.reshape(weight.shape[0], -1, 4) != 0).sum(-1) <= 2).all())


@pytest.mark.usefixtures("default_mlflow_store")
def test_full_chain_is_one_command(tiny_model_dir, artifacts, tmp_path):
    adapter = _random_adapter(tmp_path / "adapter", tiny_model_dir)
    args = [
        "run",
        "recipe=prune_2of4_distill_gptq_int4",
        f"model={tiny_model_dir}",
        *SMALL,
        f"stages.0.adapters=[{adapter}]",
        "stages.2.steps=6",
        "stages.2.seq_len=32",
        "stages.2.held_out=2",
        "stages.2.gradient_checkpointing=false",
        "stages.3.group_size=32",
    ]
    assert main(args) == 0
    [run_dir] = (artifacts / "runs").iterdir()
    report = json.loads((run_dir / "report.json").read_text())
    stages = report["stages"]
    assert stages["0:lora_merge"]["adapters"][str(adapter)]["modules"] == 6
    assert stages["1:sparsegpt"]["pruned_linears"] == 14 and stages["1:sparsegpt"]["mean_sparsity"] >= 0.5
    assert len(stages["1:sparsegpt"]["per_layer_sparsity"]) == 14
    assert stages["2:distill"]["steps"] == 6
    assert stages["3:gptq"]["quantized_linears"] == 14

    config = json.loads((run_dir / "checkpoint" / "config.json").read_text())
    assert "sparsity_config" not in config["quantization_config"]  # current vLLM refuses a checkpoint that has one
    sparsity = json.loads((run_dir / "checkpoint" / "sparsity.json").read_text())
    assert sparsity["sparsity_structure"] == "2:4" and sparsity["format"] == "dense"
    assert len(sparsity["targets"]) == 14 and "lm_head" in sparsity["ignore"]
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    decoder = sum(m.weight.numel() for m in dense.model.layers.modules() if type(m) is torch.nn.Linear)
    assert sparsity["global_sparsity"] == pytest.approx(0.5 * decoder / (decoder + dense.lm_head.weight.numel()))

    from compress.checkpoint import load_checkpoint

    model, _ = load_checkpoint(run_dir / "checkpoint")
    for index in range(2):
        for name in ("self_attn.q_proj", "mlp.down_proj"):
            assert _two_of_four(model.get_submodule(f"model.layers.{index}.{name}").dequantized_weight())

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{artifacts / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("compress").experiment_id])
    curve = client.get_metric_history(run.info.run_id, "distill_loss")
    assert [point.step for point in curve] == list(range(6))


@pytest.mark.parametrize("pattern", [None, "4:8"], ids=["the file's 2:4", "4:8 override"])
def test_pruned_only_checkpoint_loads_in_transformers(tiny_model_dir, artifacts, pattern):
    args = ["run", "recipe=prune_2of4", f"model={tiny_model_dir}", *SMALL, "tracking.enabled=false"]
    assert main(args + ([f"stages.0.sparsity={pattern}"] if pattern else [])) == 0
    kept, group = (int(n) for n in (pattern or "2:4").split(":"))
    [run_dir] = (artifacts / "runs").iterdir()
    config = json.loads((run_dir / "checkpoint" / "config.json").read_text())
    assert "quantization_config" not in config  # a plain dense folder, which every runtime loads
    structure = json.loads((run_dir / "checkpoint" / "sparsity.json").read_text())["sparsity_structure"]
    assert structure == f"{kept}:{group}"
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint")
    for layer in model.model.layers:
        for linear in (layer.self_attn.q_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            weight = linear.weight
            assert ((weight.reshape(weight.shape[0], -1, group) != 0).sum(-1) <= kept).all()
            assert (weight == 0).float().mean().item() == pytest.approx(0.5, abs=1e-3)
