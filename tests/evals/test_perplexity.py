"""Perplexity on CPU computes a 16-bit model in fp32 without widening the whole model at once, and never holds a
whole batch's logits."""

import pytest
import torch
from helpers import build_tiny_llama, build_tiny_model, build_tiny_moe, build_tiny_tokenizer

from compress.base.data import open_with, window_start_token
from compress.evals.perplexity import HEAD_CHUNK, perplexity, streamed_perplexity
from compress.model.layer_walk import decoder_layers, fp32_compute, restore_dtypes, upcast


def test_fp32_compute_one_layer_at_a_time_equals_widening_the_whole_model():
    model = build_tiny_llama(seed=4).to(torch.bfloat16)
    ids = torch.randint(0, 320, (6 * 32,), generator=torch.Generator().manual_seed(0))
    stored = upcast(model)
    expected = perplexity(model, ids, 32, batch_size=4, progress=False)
    restore_dtypes(model, stored)
    widest: list[int] = []

    def count_fp32_layers(_layer, _args):
        widest.append(sum(layer.mlp.down_proj.weight.dtype == torch.float32 for layer in decoder_layers(model)))

    handles = [layer.register_forward_pre_hook(count_fp32_layers) for layer in decoder_layers(model)]
    with fp32_compute(model):
        result = perplexity(model, ids, 32, batch_size=4, progress=False)
    for handle in handles:
        handle.remove()
    assert result.mean_nll == expected.mean_nll  # the same fp32 arithmetic
    assert widest and max(widest) == 0  # as each layer starts, no other layer is held in fp32
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight or not model.config.tie_word_embeddings


def _full_logits_nll(model, windows: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=windows).logits.float()
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()))


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
def test_the_head_runs_on_a_few_positions_at_a_time_with_the_full_forwards_result(family):
    """The logits of a whole batch never exist at once (gemma2: the final logit soft-capping is kept)."""
    model = build_tiny_moe(family) if family.endswith("moe") else build_tiny_model(family)
    ids = torch.randint(0, 320, (5 * 300,), generator=torch.Generator().manual_seed(0))
    head_positions: list[int] = []
    model.get_output_embeddings().register_forward_hook(
        lambda _module, args, _output: head_positions.append(args[0].shape[:-1].numel())
    )
    result = perplexity(model, ids, 300, batch_size=4, progress=False)
    assert max(head_positions) == HEAD_CHUNK
    expected = _full_logits_nll(model, open_with(ids.view(5, 300), window_start_token(model.config)))
    assert result.mean_nll == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "llama"])
def test_a_gemma_window_opens_with_bos_on_both_scoring_paths(family):
    """Gemma is trained with <bos> first (without it gemma-3-270m scores perplexity 158 instead of 57): each window's
    first token, context only, is its <bos>, on the whole-model and the layer-by-layer path; other families read the
    text as it is."""
    model = build_tiny_model(family)
    ids = torch.randint(3, 320, (4 * 64,), generator=torch.Generator().manual_seed(0))
    windows = ids.view(4, 64).clone()
    if family.startswith("gemma"):
        windows[:, 0] = model.config.bos_token_id
    expected = _full_logits_nll(model, windows)
    assert perplexity(model, ids, 64, batch_size=2, progress=False).mean_nll == pytest.approx(expected, rel=1e-5)
    streamed = streamed_perplexity(model, ids, 64, batch_size=2, progress=False)
    assert streamed.mean_nll == pytest.approx(expected, rel=1e-5)
    assert streamed.tokens == 4 * 63  # the same tokens scored as without a <bos>


def test_a_model_whose_forward_changes_the_heads_logits_is_scored_by_its_full_forward():
    model = build_tiny_llama(seed=4)
    plain_forward = model.forward

    def scaled_forward(*args, **kwargs):
        output = plain_forward(*args, **kwargs)
        output.logits = output.logits * 0.5  # what e.g. a logit_scale in a custom model's forward does
        return output

    model.forward = scaled_forward
    ids = torch.randint(0, 320, (4 * 32,), generator=torch.Generator().manual_seed(0))
    result = perplexity(model, ids, 32, progress=False)
    assert result.mean_nll == pytest.approx(_full_logits_nll(model, ids.view(4, 32)), rel=1e-5)


@pytest.mark.parametrize(
    ("family", "dtype"),
    [("llama", torch.bfloat16), ("gemma2", torch.float32), ("phi3", torch.float32), ("gemma3", torch.float32)],
)
def test_a_lazily_loaded_model_is_scored_layer_by_layer_as_the_whole_model_scores(tmp_path, family, dtype):
    """The streamed evaluation holds one decoder layer at a time, leaves the model lazy for the walk after it, and
    gives the perplexity of the whole model computed in fp32 (gemma2: soft-capped logits; bf16 storage widened)."""
    from compress.evals.perplexity import can_stream, stored_model_perplexity
    from compress.model.sources import load

    build_tiny_model(family).to(dtype).save_pretrained(tmp_path, safe_serialization=True)
    lazy, _ = load(tmp_path)
    eager, _ = load(tmp_path, lazy=False)
    assert can_stream(lazy) and not can_stream(eager)
    ids = torch.randint(0, 320, (7 * 64,), generator=torch.Generator().manual_seed(0))
    resident: list[int] = []
    for layer in decoder_layers(lazy):
        layer.register_forward_pre_hook(
            lambda _module, _args: resident.append(sum(not p.is_meta for p in lazy.model.layers.parameters()))
        )
    cpu = torch.device("cpu")
    streamed = stored_model_perplexity(lazy, ids, 64, 4, None, label="streamed", device=cpu)
    whole = stored_model_perplexity(eager, ids, 64, 4, None, label="whole", device=cpu)
    per_layer = sum(1 for _ in decoder_layers(eager)[0].parameters())
    assert max(resident) == per_layer  # one layer's parameters at a time
    assert lazy.lazy_weights.loaded == set()
    assert streamed.tokens == whole.tokens and streamed.mean_nll == pytest.approx(whole.mean_nll, rel=1e-5)


def test_a_lazy_model_compressed_in_place_is_scored_with_its_layers_kept_and_stays_usable(tmp_path):
    """A lazily loaded model quantized by the walk (the RTN reference off the streamed path): its layers are no longer
    the file's, so they must not be dropped (that would lose them, and re-reading would bring back dense weights)."""
    from compress.compression.in_memory import compress_model
    from compress.evals.perplexity import can_stream, stored_model_perplexity
    from compress.model.sources import load

    build_tiny_llama(seed=5).save_pretrained(tmp_path, safe_serialization=True)
    model, _ = load(tmp_path)
    ids = torch.randint(0, 320, (4 * 32,), generator=torch.Generator().manual_seed(0))
    compress_model(model, [{"type": "rtn", "bits": 4, "group_size": 32}], ids.view(4, 32), batch_size=1)
    assert not can_stream(model)
    first = stored_model_perplexity(model, ids, 32, 4, None, label="rtn", device=torch.device("cpu"))
    again = stored_model_perplexity(model, ids, 32, 4, None, label="rtn", device=torch.device("cpu"))
    assert first.mean_nll == again.mean_nll


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_reference_quantized_layer_by_layer_as_streamed_scores_as_the_whole_quantized_model(tmp_path, dtype):
    """The run's round-to-nearest reference: each layer is quantized on a copy as the streamed evaluation reads it.
    Its perplexity is the whole RTN-compressed model's, and neither the compressed model nor any read layer is left
    in memory (the model stays lazy)."""
    from compress.compression.in_memory import compress_model
    from compress.evals.perplexity import stored_model_perplexity
    from compress.model.sources import load
    from compress.stages.rtn import RTNConfig, RTNStage

    build_tiny_llama(seed=5).to(dtype).save_pretrained(tmp_path, safe_serialization=True)
    ids = torch.randint(0, 320, (4 * 32,), generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    whole, _ = load(tmp_path)
    compress_model(whole, [RTNStage(RTNConfig(bits=3, group_size=32))], ids.view(4, 32), batch_size=1)
    expected = stored_model_perplexity(whole, ids, 32, 4, None, label="rtn", device=cpu)
    streamed, _ = load(tmp_path)
    quantized = RTNStage(RTNConfig(bits=3, group_size=32)).quantized_copies(streamed)
    result = stored_model_perplexity(streamed, ids, 32, 4, None, label="rtn", device=cpu, transform=quantized)
    dense = stored_model_perplexity(streamed, ids, 32, 4, None, label="dense", device=cpu)
    assert result.mean_nll == pytest.approx(expected.mean_nll, rel=1e-5)
    assert abs(result.mean_nll - dense.mean_nll) > 1e-4  # the transform did quantize (tolerance above: 6e-5)
    assert not streamed.lazy_weights.loaded
    assert all(p.is_meta for layer in decoder_layers(streamed) for p in layer.parameters())


def test_a_checkpoint_in_memory_is_scored_layer_by_layer_as_its_whole_forward_scores(tmp_path):
    """The run's candidate, loaded whole from its checkpoint: evaluated layer-major (never a whole-model forward,
    whose per-batch heap use cost ~300 MB more on the default model), with the whole forward's perplexity."""
    from compress.checkpoint import load_checkpoint, save_checkpoint
    from compress.compression.in_memory import compress_model
    from compress.evals.perplexity import stored_model_perplexity

    model = build_tiny_llama(seed=4)
    ids = torch.randint(0, 320, (6 * 32,), generator=torch.Generator().manual_seed(0))
    compress_model(model, [{"type": "rtn", "bits": 4, "group_size": 32}], ids.view(6, 32), batch_size=2)
    save_checkpoint(model, build_tiny_tokenizer(), tmp_path / "checkpoint")
    candidate, _ = load_checkpoint(tmp_path / "checkpoint")
    whole = perplexity(candidate, ids, 32, 4, None)
    forwards = []
    candidate.register_forward_hook(lambda *_: forwards.append(1))
    layered = stored_model_perplexity(candidate, ids, 32, 4, None, label="candidate", device=torch.device("cpu"))
    assert forwards == []
    assert layered.tokens == whole.tokens and layered.mean_nll == pytest.approx(whole.mean_nll, rel=1e-5)
