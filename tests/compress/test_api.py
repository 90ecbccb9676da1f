"""``compress.oneshot``: the library call gives the checkpoint ``compress_model`` + save would, for every stage family,
from a recipe name, a recipe file or a stage list, and refuses bad input before loading anything."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from helpers import build_tiny_llama, build_tiny_model, build_tiny_tokenizer

from compress import oneshot
from compress.base.data import token_digest
from compress.base.errors import CompressError
from compress.checkpoint import load_checkpoint
from compress.compression.in_memory import compress_model
from compress.stages.lora import save_adapter
from tests.compress.stages.test_lora import _random_factors

SAMPLES = torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(0))
TOKENS = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
FAMILIES = {
    "weights (gptq)": [{"type": "gptq", "bits": 4, "group_size": 32}],
    "activations (smoothquant + w8a8)": [{"type": "smoothquant"}, {"type": "w8a8"}],
    "fp8": [{"type": "fp8", "activations": "dynamic"}],
    "kv cache": [{"type": "kv_cache", "dtype": "int8"}],
    "pruning (wanda) + distillation": [{"type": "wanda"}, {"type": "distill", "steps": 2, "seq_len": 16}],
}


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("chain", FAMILIES.values(), ids=FAMILIES.keys())
def test_oneshot_checkpoint_equals_compress_model_then_save(chain, tmp_path):
    given = build_tiny_llama(seed=3)
    checkpoint = oneshot(given, chain, data=SAMPLES, output_dir=tmp_path / "ckpt")
    expected = build_tiny_llama(seed=3)
    compress_model(expected, chain, SAMPLES, batch_size=8)
    loaded, _ = load_checkpoint(checkpoint)
    assert torch.allclose(_logits(loaded), _logits(expected), atol=1e-4)
    assert torch.allclose(_logits(given), _logits(expected), atol=1e-4)  # a module passed in stays whole and usable
    assert yaml.safe_load((checkpoint / "recipe.yaml").read_text())["stages"] == chain


def test_a_checkpoint_names_the_windows_it_was_calibrated_on(tmp_path):
    """Two checkpoints are paired on the same calibration only if their windows are the same token for token; windows
    a model samples itself can differ from one processor to another, so the checkpoint records what it saw."""
    chain = [{"type": "gptq", "bits": 4, "group_size": 32}]
    checkpoint = oneshot(build_tiny_llama(seed=3), chain, data=SAMPLES, output_dir=tmp_path / "ckpt")
    recorded = json.loads((checkpoint / "calibration.json").read_text())
    assert recorded == {"windows": 4, "seq_len": 32, "token_sha256": token_digest(SAMPLES)}
    other = oneshot(build_tiny_llama(seed=3), chain, data=SAMPLES.flip(0), output_dir=tmp_path / "flipped")
    assert json.loads((other / "calibration.json").read_text())["token_sha256"] != recorded["token_sha256"]


def test_oneshot_merges_adapters(tmp_path):
    model = build_tiny_llama(seed=3)
    save_adapter(tmp_path / "adapter", _random_factors(model, rank=4, seed=1), rank=4, alpha=8)
    chain = [{"type": "lora_merge", "adapters": [str(tmp_path / "adapter")]}]
    checkpoint = oneshot(model, chain, data=SAMPLES, output_dir=tmp_path / "ckpt")
    expected = build_tiny_llama(seed=3)
    compress_model(expected, chain, SAMPLES)
    loaded, _ = load_checkpoint(checkpoint)
    assert torch.allclose(_logits(loaded), _logits(expected), atol=1e-5)


def test_oneshot_composes_a_named_recipe_with_overrides_on_a_model_folder(tiny_model_dir, tmp_path, artifacts):
    """The recipe as the CLI composes it (its default text, the pydoc topics, tokenized by the folder's tokenizer)."""
    checkpoint = oneshot(
        str(tiny_model_dir),
        "rtn_int4",
        overrides=["stages.0.group_size=32", "data.num_samples=2", "data.seq_len=32"],
        output_dir=tmp_path / "rtn",
    )
    stages = yaml.safe_load((checkpoint / "recipe.yaml").read_text())["stages"]
    assert stages[0]["type"] == "rtn" and stages[0]["group_size"] == 32
    loaded, tokenizer = load_checkpoint(checkpoint)
    assert tokenizer is not None and torch.isfinite(_logits(loaded)).all()


def test_oneshot_calibrates_on_a_list_of_strings(tmp_path):
    tokenizer = build_tiny_tokenizer()
    texts = ["The quick brown fox jumps over the lazy dog. " * 40] * 2
    chain = [{"type": "gptq", "bits": 4, "group_size": 32}]
    checkpoint = oneshot(
        build_tiny_llama(), chain, data=texts, tokenizer=tokenizer, output_dir=tmp_path / "c",
        overrides=["data.num_samples=2", "data.seq_len=32", "stages.0.group_size=16"],
    )  # fmt: skip
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "tokenizer.json").is_file()
    assert yaml.safe_load((checkpoint / "recipe.yaml").read_text())["stages"][0]["group_size"] == 16


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        ("no_such_recipe", [], "neither a recipe name"),
        ([{"type": "gptq", "gruop_size": 32}], [], "did you mean 'group_size'"),
        ([{"type": "rtn"}, {"type": "lora_merge", "adapters": ["x"]}], [], "merge adapters first"),
        ("rtn_int4", ["stages.0.bits=five"], "stages.0.bits"),
    ],
)
def test_bad_recipes_fail_in_one_line_before_any_work(recipe, overrides, message, tmp_path):
    with pytest.raises(CompressError, match=message):
        oneshot(build_tiny_llama(), recipe, data=SAMPLES, overrides=overrides, output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_existing_output_folder_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(CompressError, match="already exists"):
        oneshot(build_tiny_llama(), [{"type": "rtn", "group_size": 32}], data=SAMPLES, output_dir=tmp_path / "out")


def test_a_gemma_model_is_calibrated_on_windows_opening_with_its_bos(tmp_path):
    model = build_tiny_model("gemma3")
    seen: list[torch.Tensor] = []
    model.model.embed_tokens.register_forward_hook(lambda _module, args, _output: seen.append(args[0]))
    text = [" ".join(f"word{i % 37}" for i in range(3000))]
    overrides = ["data.num_samples=4", "data.seq_len=32"]
    chain = [{"type": "gptq", "bits": 4, "group_size": 32}]
    oneshot(model, chain, data=text, tokenizer=build_tiny_tokenizer(), overrides=overrides, output_dir=tmp_path / "o")
    assert seen and all((ids[:, 0] == model.config.bos_token_id).all() for ids in seen)
