"""Every shipped recipe file run from its own YAML, end to end: composed exactly as ``python -m compress run``
composes it (``compress.oneshot`` with the recipe's name: the same Hydra files and checks), compressed on a tiny
random Llama, saved, and reloaded both by our reader and by transformers + compressed-tensors.

The stage list is the file's: the only overrides are sizes (calibration samples and their length, distillation steps,
SignRound iterations) and the LoRA adapter the merge recipes ask the user to name. Each recipe's logits are held to a
bound measured on this model (1.5-2x the measured error; 1.15x for 2:4 pruning): the model whose decoder linears
output zeros is 0.96 away from the dense one, beyond every bound, so a stage that breaks the model fails.
transformers' logits must match our reader's on the same checkpoint to the precision of its own arithmetic (the
tolerance column says where and why it is not exact).

A new recipe file fails here until it is given its bounds in ``BOUNDS``. The whole file costs ~30 s of CPU time
(each recipe 1-3 s: Hydra's composition and tokenizing the pydoc calibration text cost most of it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import build_tiny_llama, build_tiny_tokenizer, relative_error
from transformers import AutoModelForCausalLM

from compress import oneshot
from compress.checkpoint import load_checkpoint
from compress.model.layer_walk import decoder_layers
from compress.stages.lora import read_adapter, save_adapter
from tests.compress.stages.test_lora import _random_factors, _unmerged_logits

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
RECIPES = sorted(path.stem for path in RECIPES_DIR.glob("*.yaml") if path.name != "_base.yaml")
TOKENS = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
SIZES = ["data.num_samples=4", "data.seq_len=32"]
STAGE_SIZES = {  # stage type -> the size overrides that keep it to seconds on the tiny model (the stage list stays)
    "distill": {"steps": 2, "seq_len": 16, "held_out": 1, "batch_size": 2},
    "signround": {"iterations": 4, "batch_size": 2},
}
ZEROED = 0.96  # relative logit error of the tiny model with every decoder linear zeroed (test_zeroed_model_is_far)

# recipe -> (bound on the relative logit error against the dense model, tolerance of transformers against our reader).
# Measured on this model: int4 ≈ 0.20, int3 ≈ 0.41 (0.34 rotated), FP4 0.18–0.27, FP8 ≈ 0.06, W8A8 ≈ 0.015,
# KV int8 ≈ 0.008 and fp8 ≈ 0.026, 2:4 pruning ≈ 0.65–0.67 (random weights have no redundancy: half of each
# linear's weights removed moves the logits ~0.7 of the way to the zeroed model's, so that bound is 0.8 × ZEROED).
EXACT = 1e-5  # integer and FP8-block weights decompressed by compressed-tensors equal ours; fp32 arithmetic
FP8_TOKEN = 2e-3  # per-token FP8 activation scales: measured 7.6e-4
KV_INT8 = 5e-3  # measured 1.4e-3
W8A8 = 0.03  # compressed-tensors' int8 activation scale is absmax/127.5 (ours and vLLM's absmax/127): measured 0.013
BF16 = 0.02  # FP4 weights: compressed-tensors decompresses them to bf16, so transformers runs the model in bf16
W4A4 = 0.25  # and rounds activations to e2m1 from bf16 values and scales (a tie lands a whole FP4 step away; measured
# 0.12–0.14 on the model, per linear within 0.01 in tests/compress/stages/test_formats.py)
PRUNED = 0.8 * ZEROED
BOUNDS = {
    "autoround_int3": (0.6, EXACT),
    "autoround_int4": (0.35, EXACT),
    "awq_int4": (0.35, EXACT),
    "awq_int4_kv_int8": (0.35, KV_INT8),
    "awq_int4_train_scales": (0.35, EXACT),
    "fp8_block": (0.1, EXACT),
    "fp8_dynamic": (0.1, FP8_TOKEN),
    "fp8_static": (0.1, EXACT),
    "gptq_int3": (0.6, EXACT),
    "gptq_int4": (0.35, EXACT),
    "kv_fp8": (0.05, EXACT),
    "kv_int8": (0.02, KV_INT8),
    "lora_merge_awq_int4": (0.35, EXACT),
    "mxfp4": (0.45, W4A4),
    "nvfp4": (0.45, W4A4),
    "nvfp4a16": (0.45, BF16),
    "prune_2of4": (PRUNED, EXACT),
    "prune_2of4_distill": (PRUNED, EXACT),
    "prune_2of4_distill_gptq_int4": (PRUNED, EXACT),
    "prune_2of4_gptq_int4": (PRUNED, EXACT),
    "rotate_autoround_int4": (0.35, EXACT),
    "rotate_gptq_int3": (0.6, EXACT),
    "rotate_gptq_int4": (0.35, EXACT),
    "rtn_int4": (0.35, EXACT),
    "smoothquant_gptq_w8a8": (0.03, W8A8),
    "smoothquant_w8a8": (0.03, W8A8),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama folder whose widths (128, 256) fit every shipped grid: int groups of 64, FP4 groups of 16/32,
    and FP8-block's 128-wide activation groups, which compressed-tensors cannot split otherwise."""
    folder = tmp_path_factory.mktemp("recipe-model")
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    save_adapter(folder / "adapter", _random_factors(model, rank=4, seed=1), rank=4, alpha=8)
    return folder


def _file_stages(recipe: str) -> list[dict]:
    return yaml.safe_load((RECIPES_DIR / f"{recipe}.yaml").read_text())["stages"]


def _overrides(stages: list[dict], adapter: Path) -> list[str]:
    overrides = list(SIZES)
    for index, stage in enumerate(stages):
        for key, value in STAGE_SIZES.get(stage["type"], {}).items():
            overrides.append(f"stages.{index}.{key}={value}")
        if stage["type"] == "lora_merge":
            overrides.append(f"stages.{index}.adapters=[{adapter}]")
    return overrides


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits.float()


def _reference(model_dir: Path, stages: list[dict]) -> torch.Tensor:
    """The dense model's logits; with the adapter added unmerged (as peft runs it) when the recipe merges one."""
    dense = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if any(stage["type"] == "lora_merge" for stage in stages):
        return _unmerged_logits(dense, [(read_adapter(model_dir / "adapter"), 1.0)], TOKENS).float()
    return _logits(dense)


def test_every_recipe_file_has_its_bounds():
    assert len(RECIPES) >= 23 and set(RECIPES) == set(BOUNDS), set(RECIPES) ^ set(BOUNDS)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_from_its_file_and_transformers_reloads_it(recipe, model_dir, tmp_path, artifacts):
    bound, tolerance = BOUNDS[recipe]
    stages = _file_stages(recipe)
    overrides = _overrides(stages, model_dir / "adapter")
    checkpoint = oneshot(str(model_dir), recipe, overrides=overrides, output_dir=tmp_path / "checkpoint")

    # the stages that ran are the file's, in its order, with only the size overrides changed
    ran = yaml.safe_load((checkpoint / "recipe.yaml").read_text())["stages"]
    assert [stage["type"] for stage in ran] == [stage["type"] for stage in stages]
    for index, (written, used) in enumerate(zip(stages, ran, strict=True)):
        changed = {
            override.split("=")[0].split(".")[2] for override in overrides if override.startswith(f"stages.{index}.")
        }
        assert {key: value for key, value in used.items() if key in written and key not in changed} == {
            key: value for key, value in written.items() if key not in changed
        }

    ours, tokenizer = load_checkpoint(checkpoint)
    assert tokenizer is not None
    mine = _logits(ours)
    error = relative_error(mine, _reference(model_dir, stages))
    assert 0 < error < bound, f"{recipe}: relative logit error {error:.4f} against the dense model (bound {bound})"

    quantization = json.loads((checkpoint / "config.json").read_text()).get("quantization_config") or {}
    fp4 = "fp4" in quantization.get("format", "")
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint, **({"dtype": torch.bfloat16} if fp4 else {}))
    gap = relative_error(_logits(theirs), mine)
    assert gap <= tolerance, f"{recipe}: transformers' logits {gap:.2e} from ours (tolerance {tolerance})"

    if any(stage["type"] == "sparsegpt" for stage in stages):  # the file's 2:4, kept through distillation and GPTQ
        assert json.loads((checkpoint / "sparsity.json").read_text())["sparsity_structure"] == "2:4"
        for layer in decoder_layers(theirs):
            for name, linear in layer.named_modules():
                if isinstance(linear, torch.nn.Linear):
                    kept = (linear.weight.reshape(linear.out_features, -1, 4) != 0).sum(-1)
                    assert (kept <= 2).all() and (kept == 2).float().mean() > 0.9, name


def test_zeroed_model_is_far(model_dir):
    """The anchor of the bounds above: zeroing every decoder linear moves the logits by ZEROED."""
    dense = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    reference = _logits(dense)
    with torch.no_grad():
        for layer in decoder_layers(dense):
            for linear in layer.modules():
                if isinstance(linear, torch.nn.Linear):
                    linear.weight.zero_()
    error = relative_error(_logits(dense), reference)
    assert error == pytest.approx(ZEROED, abs=0.01)
    assert all(error > bound for bound, _ in BOUNDS.values())


def test_the_quality_tables_calibration_free_recipes_are_those_whose_stages_read_no_calibration():
    """The quality table shows one draw of these as every draw: true only while no stage of theirs calibrates."""
    from benchmarks.quality_rows import CALIBRATION_FREE
    from compress.stages import build_stage

    free = set()
    for recipe in RECIPES:
        stages = yaml.safe_load((RECIPES_DIR / f"{recipe}.yaml").read_text())["stages"]
        built = [build_stage(dict(args), i) for i, args in enumerate(stages) if args["type"] != "lora_merge"]
        if not any(stage.needs_calibration for stage in built):  # LoRA merging reads none either
            free.add(recipe)
    assert free == set(CALIBRATION_FREE)


def test_the_quality_tables_recipes_needing_input_are_those_shipping_an_empty_adapter_list():
    """The quality table lists these as not measurable as shipped and draws none of them."""
    from benchmarks.quality_rows import NEEDS_INPUT

    empty = set()
    for recipe in RECIPES:
        stages = yaml.safe_load((RECIPES_DIR / f"{recipe}.yaml").read_text())["stages"]
        if any(stage["type"] == "lora_merge" and not stage.get("adapters") for stage in stages):
            empty.add(recipe)
    assert empty == set(NEEDS_INPUT)
