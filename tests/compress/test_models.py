import json

import pytest
import torch

from compress.errors import CompressError
from compress.models import (
    ModelSpec,
    _verify_conversion,
    convert_gguf,
    load_model,
    resolve_model_path,
    smollm2_gguf_path,
)


def test_pickle_weights_refused_unless_allowed(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(CompressError, match="pickle .* model.allow_pickle=true"):
        resolve_model_path(ModelSpec(path=str(tmp_path)))
    assert resolve_model_path(ModelSpec(path=str(tmp_path), allow_pickle=True)) == str(tmp_path)


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(CompressError, match="has no config.json"):
        resolve_model_path(ModelSpec(path=str(tmp_path)))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CompressError, match="contains no weights"):
        resolve_model_path(ModelSpec(path=str(tmp_path)))


def test_local_folder_loads(tiny_model_dir):
    model, tokenizer = load_model(ModelSpec(path=str(tiny_model_dir)))
    assert model.config.num_hidden_layers == 2 and len(tokenizer) == model.config.vocab_size


@pytest.mark.slow
def test_default_model_conversion_matches_the_gguf(tmp_path):
    """The real SmolLM2 GGUF → HF folder (the conversion itself compares logits with the GGUF-loaded original)."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    convert_gguf(gguf, tmp_path / "smollm2")
    config = json.loads((tmp_path / "smollm2" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert json.loads((tmp_path / "smollm2" / "config.json").read_text()).get("quantization_config") is None
    text = "Perplexity measures how surprised a model is by text."
    reference_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    converted_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "smollm2")
    assert converted_tokenizer(text)["input_ids"] == reference_tokenizer(text)["input_ids"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind


def test_conversion_check_catches_a_different_model(tiny_model_dir, tmp_path):
    """The verification step must fail when the written folder's logits differ from the source's."""
    model, tokenizer = load_model(ModelSpec(path=str(tiny_model_dir)))
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    with pytest.raises(CompressError, match="logits differ from the GGUF original"):
        _verify_conversion(model, tokenizer, tiny_model_dir)
