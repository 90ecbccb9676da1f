"""Model-free quantization (``compress.compression.model_free``) writes, from the safetensors files alone, the
checkpoint the layer walk writes for the same data-free recipe: same tensors, same config.json, and both loaders read
it."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml
from helpers import build_tiny_llama, build_tiny_moe, build_tiny_tokenizer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from compress.base.errors import CompressError
from compress.checkpoint import CheckpointWriter, load_checkpoint
from compress.compression import model_free
from compress.compression.in_memory import compress_model
from compress.compression.model_free import model_free_eligible, quantize_model_free
from compress.compression.saving import checkpoint_writer, write_checkpoint
from compress.model.sources import load
from compress.stages import build_chain
from compress.stages.rtn import rtn_reference

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _recipe(name: str) -> list[dict]:
    return yaml.safe_load((RECIPES / f"{name}.yaml").read_text())["stages"]


def _rtn_on_the_grid_of(name: str) -> list[dict]:
    """The recipe's weight format by round to nearest (its ``eval.reference=rtn``): NVFP4A16 and MXFP4 run GPTQ."""
    return [{"type": "rtn", **asdict(rtn_reference(build_chain(_recipe(name))).config)}]


SCHEMES = {
    "rtn_int4": _recipe("rtn_int4"),
    "w8a16_g32": [{"type": "rtn", "bits": 8, "group_size": 32, "symmetric": True}],
    "int4_asym": [{"type": "rtn", "bits": 4, "group_size": 32, "symmetric": False}],
    "fp8_dynamic": _recipe("fp8_dynamic"),
    "fp8_block": _recipe("fp8_block"),
    "nvfp4a16": _rtn_on_the_grid_of("nvfp4a16"),
    "mxfp4": _rtn_on_the_grid_of("mxfp4"),
    "w8a8_rtn": [{"type": "w8a8", "weights": "rtn"}],
}
FAMILIES = {  # (model, the storage dtype it is saved in, output.save_dtype)
    "llama": (lambda: build_tiny_llama(seed=4, hidden_size=128, intermediate_size=256), torch.bfloat16, None),
    "qwen3_moe": (lambda: build_tiny_moe("qwen3_moe", seed=4), torch.float32, "bfloat16"),
}
TOKENS = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory) -> dict[str, Path]:
    folders = {}
    for family, (build, dtype, _) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(family)
        model = build().to(dtype)
        model.config.dtype = dtype
        model.save_pretrained(folder)
        build_tiny_tokenizer().save_pretrained(folder)
        folders[family] = folder
    return folders


def _layer_walk(folder: Path, chain: list[dict], target: Path, save_dtype: str | None) -> None:
    """The checkpoint as ``compress run`` writes it: lazy load, walk with the streaming writer, then the rest."""
    model, tokenizer = load(str(folder))
    stages = build_chain(chain)
    with checkpoint_writer(target, save_dtype) as writer:
        samples = torch.zeros(1, 8, dtype=torch.long)  # read by no data-free stage
        summaries = compress_model(model, stages, samples, "cpu", 1, writer.layer_sink(model))
        write_checkpoint(writer, model, tokenizer, stages, summaries, "recipe", chain)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in folder.glob("*.safetensors"):
        tensors.update(load_file(shard))
    return tensors


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _text(record: dict) -> str:
    return json.dumps(record, sort_keys=True)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_model_free_checkpoint_is_the_layer_walks_and_both_loaders_read_it(model_folders, tmp_path, family, scheme):
    chain, save_dtype = SCHEMES[scheme], FAMILIES[family][2]
    if family == "qwen3_moe" and chain[0].get("group_size") == 64:  # its experts' down_proj reads 32 inputs
        chain = [{**chain[0], "group_size": 32}]  # and gets channel scales: two config groups, listed by name
    assert model_free_eligible(build_chain(chain)) is None
    walk, free = tmp_path / "walk", tmp_path / "free"
    _layer_walk(model_folders[family], chain, walk, save_dtype)
    result = quantize_model_free(
        model_folders[family], build_chain(chain), free, recipe="recipe", stage_args=chain, save_dtype=save_dtype
    )

    theirs, ours = _tensors(walk), _tensors(free)
    assert set(ours) == set(theirs)
    differ = [key for key in ours if ours[key].dtype != theirs[key].dtype or not torch.equal(ours[key], theirs[key])]
    assert differ == []
    assert _json(free / "config.json") == _json(walk / "config.json")  # quantization_config and all
    assert sorted(path.name for path in free.iterdir()) == sorted(path.name for path in walk.iterdir())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "recipe.yaml"):
        assert (free / name).read_text() == (walk / name).read_text()
    [(key, stage)] = _json(free / "stages.json").items()
    [(walk_key, walk_stage)] = _json(walk / "stages.json").items()
    assert key == walk_key and _text({**stage, "seconds": 0}) == _text({**walk_stage, "seconds": 0})  # NaN too
    assert _text(result.stages[0]["per_layer"]) == _text(stage["per_layer"])
    same = {"path": "", "size_mb": 0}  # the shard headers list the tensors in another order
    assert {**_json(free / "size.json"), **same} == {**_json(walk / "size.json"), **same}
    assert result.checkpoint.quantized_linears > 0 and result.checkpoint.path == str(free)

    assert torch.equal(_logits(load_checkpoint(free)[0]), _logits(load_checkpoint(walk)[0]))
    # transformers re-initialises packed asymmetric zero points (test_checkpoint.py); compressed-tensors' FP8_BLOCK
    # activation groups of 128 need widths of 128 (the MoE model's are 64); transformers 5.23 cannot fuse int8
    # W8A8 experts back (either checkpoint: "Concatenate on tensors destined for ...experts.gate_up_proj")
    if scheme != "int4_asym" and (scheme, family) not in {("fp8_block", "qwen3_moe"), ("w8a8_rtn", "qwen3_moe")}:
        dtype = torch.bfloat16  # compressed-tensors decompresses FP4 to bf16
        loaded = [AutoModelForCausalLM.from_pretrained(folder, dtype=dtype) for folder in (free, walk)]
        assert torch.equal(*(_logits(model) for model in loaded))


def test_one_group_of_linears_is_read_at_a_time(model_folders, tmp_path, monkeypatch):
    """Peak memory: between two writes the reader holds at most one input group's tensors (q, k, v: three)."""
    unwritten, most = [0], [0]
    read, write = model_free.Files.read, CheckpointWriter.write_layer

    def counted_read(self, name):
        unwritten[0] += 1
        most[0] = max(most[0], unwritten[0])
        return read(self, name)

    def counted_write(self, model, name):
        unwritten[0] = 0
        return write(self, model, name)

    monkeypatch.setattr(model_free.Files, "read", counted_read)
    monkeypatch.setattr(CheckpointWriter, "write_layer", counted_write)
    quantize_model_free(model_folders["qwen3_moe"], build_chain(SCHEMES["nvfp4a16"]), tmp_path / "free")
    assert most[0] == 3


@pytest.mark.parametrize(
    ("chain", "reason"),
    [
        (_recipe("gptq_int4"), r"^stages\.0 \(gptq\) calibrates on layer inputs \(GPTQ"),
        (_recipe("fp8_static"), r"^stages\.0 \(fp8\) calibrates on layer inputs"),
        ([{"type": "rtn", "format": "nvfp4", "group_size": 16, "activations": "fp4"}], r"^stages\.0 \(rtn\) calib"),
        ([{"type": "rotate"}], r"^stages\.0 \(rotate\) is not a round-to-nearest weight quantizer"),
        (_recipe("rtn_int4") + [{"type": "kv_cache"}], r"^model-free runs one round-to-nearest stage alone, not 2"),
    ],
    ids=["gptq", "fp8_static", "nvfp4_w4a4", "rotate", "rtn_then_kv_cache"],
)
def test_a_chain_that_needs_data_or_the_model_is_refused_with_its_reason(model_folders, tmp_path, chain, reason):
    stages = build_chain(chain)
    assert model_free_eligible(stages) is not None
    with pytest.raises(CompressError, match=reason):
        quantize_model_free(model_folders["llama"], stages, tmp_path / "free")
    assert list(tmp_path.iterdir()) == []


def test_fused_expert_tensors_are_refused_in_one_line(tmp_path):
    """A file with 3-D experts (the layer walk unfuses known layouts in the model) is refused, not half-quantized."""
    from safetensors.torch import save_file

    folder = tmp_path / "fused"
    model = build_tiny_moe("qwen3_moe")
    model.config.save_pretrained(folder)
    tensors = {key: value.contiguous() for key, value in model.state_dict().items() if key != "lm_head.weight"}
    save_file(tensors, folder / "model.safetensors")
    assert any(value.dim() == 3 for value in tensors.values())
    with pytest.raises(CompressError, match=r"experts\.\w+ \[4, \d+, \d+\]: fused 3-D weights \(experts\)"):
        quantize_model_free(folder, build_chain(SCHEMES["rtn_int4"]), tmp_path / "free")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["fused"]


def test_run_goes_model_free_when_no_evaluation_needs_the_model(tiny_model_dir, artifacts, caplog):
    """``run`` with a data-free chain and no perplexity pass says "model-free" and writes the layer walk's tensors."""
    from compress.__main__ import main

    caplog.set_level("INFO", logger="compress.app.pipeline")

    common = ["run", "recipe=rtn_int4", f"model={tiny_model_dir}", "stages.0.group_size=32", "gate=none",
              "tracking.enabled=false", "eval.seq_len=64", "eval.max_windows=2", "data.seq_len=64"]  # fmt: skip
    assert main([*common, "eval.perplexity=false", f"output.dir={artifacts / 'free'}"]) == 0
    assert "model-free: " in caplog.text
    caplog.clear()
    assert main([*common, "eval.perplexity=true", f"output.dir={artifacts / 'walk'}"]) == 0
    assert "model-free" not in caplog.text  # the baseline's perplexity needs the model: the layer walk
    (free,), (walk,) = ((artifacts / side).glob("*/checkpoint/model.safetensors") for side in ("free", "walk"))
    tensors, expected = load_file(free), load_file(walk)
    assert tensors.keys() == expected.keys()
    assert [key for key in expected if not torch.equal(tensors[key], expected[key])] == []
