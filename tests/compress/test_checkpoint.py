import json

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig
from helpers import build_tiny_llama
from transformers import AutoModelForCausalLM

from compress.base.errors import CompressError
from compress.checkpoint import load_checkpoint, save_checkpoint
from compress.compression.in_memory import compress_model
from compress.formats import QuantizedLinear
from tests.reliability.faults import injected


def _quantized(symmetric: bool, bits: int = 4):
    model = build_tiny_llama(seed=3)
    rtn = {"type": "rtn", "bits": bits, "group_size": 32, "symmetric": symmetric}
    compress_model(model, [rtn], torch.zeros(1, 8, dtype=torch.long), batch_size=1)
    return model


def _dequantized_reference(model, tokens):
    """Our own reference: every QuantizedLinear replaced by a dense Linear holding its dequantized weight."""
    import copy

    dense = copy.deepcopy(model)
    for name, module in list(dense.named_modules()):
        if isinstance(module, QuantizedLinear):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=False)
            linear.weight.data = module.dequantized_weight()
            parent, _, child = name.rpartition(".")
            setattr(dense.get_submodule(parent), child, linear)
    with torch.no_grad():
        return dense(tokens).logits


@pytest.mark.parametrize(("symmetric", "bits"), [(True, 4), (False, 4), (True, 3)])
def test_transformers_loads_our_checkpoint_with_matching_logits(tmp_path, symmetric, bits):
    model = _quantized(symmetric, bits)
    summary = save_checkpoint(model, None, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(config)  # the schema compressed-tensors itself enforces
    assert config["format"] == "pack-quantized" and config["ignore"] == ["lm_head"]
    assert summary.quantized_linears == 14
    tokens = torch.randint(0, 320, (2, 24))
    expected = _dequantized_reference(model, tokens)
    ours, _ = load_checkpoint(tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.allclose(ours(tokens).logits, expected, atol=1e-5)
        if symmetric:
            # transformers 5.23 + compressed-tensors 0.20 re-initialise packed asymmetric zero points on load
            # (shape check against the unpacked size), so only symmetric checkpoints round-trip through it.
            theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
            assert torch.allclose(theirs(tokens).logits, expected, atol=1e-5)
    assert isinstance(ours.model.layers[0].mlp.down_proj, QuantizedLinear)
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()  # still tied


def test_save_refuses_existing_folder_and_leaves_no_partial_output(tmp_path, monkeypatch):
    model = _quantized(True)
    (tmp_path / "taken").mkdir()
    with pytest.raises(CompressError, match="already exists"):
        save_checkpoint(model, None, tmp_path / "taken")

    def disk_full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("compress.checkpoint.writer.shutil.copyfileobj", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(model, None, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    injected("disk full", "the checkpoint writer's copy (ENOSPC raised in it)", "refused", "raised, no partial output")


def test_corrupt_safetensors_gives_one_clear_error(tmp_path):
    save_checkpoint(_quantized(True), None, tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CompressError, match=r"model.safetensors is corrupt or truncated .* re-create the checkpoint"):
        load_checkpoint(tmp_path / "ckpt")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CompressError, match="no config.json"):
        load_checkpoint(tmp_path)


def test_a_plain_folder_loads_through_transformers_with_its_ties(tmp_path):
    """No quantization_config: the runtime's loader hands the folder to from_pretrained, tied head included."""
    model = build_tiny_llama(seed=4)
    model.save_pretrained(tmp_path / "plain")
    loaded, tokenizer = load_checkpoint(tmp_path / "plain", dtype="bfloat16")
    assert tokenizer is None and loaded.dtype == torch.bfloat16
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight.to(torch.bfloat16))


def test_an_unreadable_compressed_tensors_format_is_refused(tmp_path):
    save_checkpoint(_quantized(True), None, tmp_path / "ckpt")
    config_file = tmp_path / "ckpt" / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"]["format"] = "marlin-24"
    config_file.write_text(json.dumps(config))
    with pytest.raises(CompressError, match="compressed-tensors/marlin-24 is not readable here"):
        load_checkpoint(tmp_path / "ckpt")


def test_shards_are_plain_safetensors_and_several_hold_what_one_does(tmp_path, monkeypatch):
    """Our streaming shard writer writes safetensors files that safetensors itself reads back exactly."""
    from safetensors.torch import load_file

    import compress.checkpoint.writer as checkpoint

    model = _quantized(symmetric=False)
    save_checkpoint(model, None, tmp_path / "one", dtype=torch.bfloat16)
    stored = load_file(tmp_path / "one" / "model.safetensors")
    packed = model.model.layers[0].self_attn.q_proj
    assert torch.equal(stored["model.layers.0.self_attn.q_proj.weight_packed"], packed.weight_packed)
    assert stored["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(stored["model.norm.weight"], model.model.norm.weight.to(torch.bfloat16))
    assert torch.equal(stored["model.layers.0.self_attn.q_proj.weight_shape"], torch.tensor([64, 64]))
    monkeypatch.setattr(checkpoint, "MAX_SHARD_BYTES", 20_000)
    save_checkpoint(model, None, tmp_path / "many", dtype=torch.bfloat16)
    shards = sorted((tmp_path / "many").glob("*.safetensors"))
    assert len(shards) > 2 and not [p for p in (tmp_path / "many").iterdir() if p.name.startswith(".shard")]
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    many = {}
    for shard in shards:
        many.update(load_file(shard))
    assert set(index["weight_map"]) == set(many) == set(stored)
    assert all(torch.equal(many[key], stored[key]) for key in stored)


def test_loading_a_quantized_checkpoint_never_builds_its_dense_weights(tmp_path, monkeypatch):
    """The model skeleton is built with its parameters on the meta device: no dense linear is allocated or randomly
    initialised before the packed weights replace it (on the default model that was 540 MB held for nothing)."""
    save_checkpoint(_quantized(symmetric=True), None, tmp_path / "ckpt")
    initialised = []
    reset = torch.nn.Linear.reset_parameters

    def recording_reset(linear):
        initialised.append(linear.weight.is_meta)
        reset(linear)

    monkeypatch.setattr(torch.nn.Linear, "reset_parameters", recording_reset)
    model, _ = load_checkpoint(tmp_path / "ckpt")
    assert initialised and all(initialised)
    assert not any(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()])
    assert model.model.rotary_emb.inv_freq.abs().sum() > 0  # built, not read from the file


def test_allow_pickle_still_prefers_safetensors_where_both_exist(tmp_path):
    """allow_pickle lets a pickle-only folder load; it must not make transformers pick the pickle over safetensors
    (use_safetensors=False did: the .bin, which can run code, won)."""
    model = build_tiny_llama()
    model.save_pretrained(tmp_path)
    doctored = {name: tensor + 1.0 for name, tensor in model.state_dict().items()}
    torch.save(doctored, tmp_path / "pytorch_model.bin")
    loaded, _ = load_checkpoint(tmp_path, allow_pickle=True)
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(loaded.state_dict()[name], model.state_dict()[name])
