import json

import pytest
import torch
from helpers import build_tiny_llama
from transformers import AutoModelForCausalLM

from compress.base.errors import CompressError
from compress.checkpoint import save_checkpoint
from compress.compression.in_memory import compress_model
from compress.formats import QuantizedLinear
from compress.grids.kv_quant import calibrated_kv_cache_dtype
from compress.model.sources import (
    GEMMA3_PARTS,
    VERIFY_TEXT,
    ModelSpec,
    _verify_conversion,
    check_model_source,
    convert_gguf,
    gemma3_model_dir,
    load,
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
    model, tokenizer = load(tiny_model_dir, lazy=False)
    assert model.config.num_hidden_layers == 2 and len(tokenizer) == model.config.vocab_size
    assert not any(t.is_meta for t in model.state_dict().values())


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(2, 14).view(2, 6)).logits


def test_load_dispatches_on_the_quantization_config(tmp_path, tiny_model_dir):
    """One entry point: a plain folder loads lazily (a forward pass reads each layer itself), our compressed-tensors
    checkpoint comes back with its QuantizedLinear modules and K/V scales, whatever ``lazy`` says."""
    lazy, _ = load(str(tiny_model_dir))
    assert lazy.lazy_weights is not None and any(t.is_meta for t in lazy.state_dict().values())
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert torch.equal(_logits(lazy), _logits(eager))
    assert not any(t.is_meta for t in lazy.state_dict().values())

    model = build_tiny_llama(seed=3)
    stages = [{"type": "rtn", "bits": 4, "group_size": 32}, {"type": "kv_cache", "dtype": "int8"}]
    summaries = compress_model(model, stages, torch.randint(0, 320, (2, 8)), torch.device("cpu"), 2)
    save_checkpoint(model, None, tmp_path / "ckpt", kv_cache_scheme=summaries[-1]["kv_cache_scheme"])
    loaded, tokenizer = load(tmp_path / "ckpt")
    assert tokenizer is None  # saved without one
    assert sum(isinstance(m, QuantizedLinear) for m in loaded.modules()) == 14
    assert calibrated_kv_cache_dtype(loaded) == "int8"
    assert torch.equal(_logits(loaded), _logits(model))
    with pytest.raises(CompressError, match="saved in torch.float32; it loads in that dtype only"):
        load(tmp_path / "ckpt", dtype="bfloat16")


def test_a_model_spec_brings_its_own_options(tiny_model_dir):
    model, _ = load(ModelSpec(path=str(tiny_model_dir), dtype="bfloat16", lazy=False))
    assert model.dtype == torch.bfloat16 and not any(t.is_meta for t in model.state_dict().values())


def test_a_missing_path_is_one_clear_error(tmp_path):
    with pytest.raises(CompressError, match="does not exist; give an existing folder or a hub id"):
        load(tmp_path / "nowhere")


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
    model, tokenizer = load(tiny_model_dir, lazy=False)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    ids = tokenizer(VERIFY_TEXT)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    with pytest.raises(CompressError, match="logits differ from the GGUF original"):
        _verify_conversion(ids, logits, tiny_model_dir)
    with pytest.raises(CompressError, match="tokenizer disagrees"):
        _verify_conversion(ids[1:], logits, tiny_model_dir)


def test_the_gemma3_model_without_its_packages_is_one_clear_error(artifacts, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(CompressError, match="model=gemma3-270m needs its four PyPI packages: run `pip install"):
        check_model_source(ModelSpec(path="gemma3-270m"))


def test_gemma3_pieces_that_join_into_another_file_are_refused_and_leave_nothing(artifacts, tmp_path, monkeypatch):
    for package, name in GEMMA3_PARTS:
        (tmp_path / "site" / package / "data").mkdir(parents=True)
        (tmp_path / "site" / package / "__init__.py").write_text("")
        (tmp_path / "site" / package / "data" / name).write_bytes(b"not a gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(CompressError, match="the joined Gemma-3 GGUF has sha256 .*; reinstall its packages"):
        gemma3_model_dir()
    assert not any((artifacts / "models").iterdir())  # neither the joined file nor a model folder
