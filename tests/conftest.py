"""Shared test setup. TRITON_INTERPRET must be set before any kernel module is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

if os.environ.get("COMPRESS_TEST_DEVICE") == "cuda":  # the kernel tests against the compiled kernels on a GPU
    from cuda_shim import install

    install()


def build_tiny_tokenizer(vocab_size: int = 320):
    """A real byte-level BPE tokenizer trained in a second on pydoc text (no hub, no download)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([topics[k] for k in sorted(topics)[:20]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def build_tiny_llama(vocab_size: int = 320, seed: int = 0, **overrides):
    """A random Llama-family model small enough to calibrate in seconds (GQA: 4 query heads, 2 KV heads)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab_size, max_position_embeddings=512, tie_word_embeddings=True,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**settings)).eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama model folder (safetensors + config + fast tokenizer), as `model=<folder>` expects."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_llama(vocab_size=len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def artifacts(tmp_path, monkeypatch) -> Path:
    """Isolated artifacts dir and MLflow store for one test."""
    monkeypatch.setenv("COMPRESS_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path / "artifacts"
