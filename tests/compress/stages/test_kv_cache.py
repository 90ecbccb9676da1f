import json

import pytest
import torch
from helpers import build_tiny_llama
from transformers import AutoModelForCausalLM

from compress.base.errors import CompressError
from compress.checkpoint import load_checkpoint, save_checkpoint
from compress.compression.in_memory import compress_model
from compress.grids.kv_quant import KVCacheScheme, fake_quantize_kv
from compress.stages import build_chain

CPU = torch.device("cpu")


def _calibrated(stage_args, samples, seed=4):
    model = build_tiny_llama(seed=seed)
    stages = build_chain(stage_args)
    compress_model(model, stages, samples, CPU, batch_size=4)
    return model, stages


@pytest.mark.parametrize(("dtype", "strategy"), [("int8", "attn_head"), ("fp8", "tensor")])
def test_kv_scales_are_serialized_and_reloaded(tmp_path, dtype, strategy):
    samples = torch.randint(0, 320, (4, 32))
    tokens = torch.randint(0, 320, (2, 24))
    model, [stage] = _calibrated([{"type": "kv_cache", "dtype": dtype, "strategy": strategy}], samples)
    attention = model.model.layers[1].self_attn
    assert attention.k_scale.shape == ((2, 1, 1) if strategy == "attn_head" else (1,))
    with torch.no_grad():
        expected = model(tokens).logits
    save_checkpoint(model, None, tmp_path / "ckpt", kv_cache_scheme=stage.kv_cache_scheme)
    qconfig = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    scheme = qconfig["kv_cache_scheme"]
    assert scheme["type"] == ("int" if dtype == "int8" else "float") and scheme["strategy"] == strategy
    ours, _ = load_checkpoint(tmp_path / "ckpt")
    reloaded = ours.model.layers[1].self_attn
    assert torch.equal(reloaded.k_scale, attention.k_scale) and torch.equal(reloaded.v_scale, attention.v_scale)
    with torch.no_grad():
        assert torch.allclose(ours(tokens).logits, expected, atol=1e-5)  # K/V quantized on reload, as when calibrated
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert torch.allclose(theirs.model.layers[1].self_attn.k_scale.float().flatten(), attention.k_scale.flatten())


def test_kv_quantization_error_is_small_but_real():
    samples = torch.randint(0, 320, (4, 32))
    tokens = torch.randint(0, 320, (2, 24))
    reference = build_tiny_llama(seed=4)
    with torch.no_grad():
        expected = reference(tokens).logits
    errors = {}
    for dtype in ("int8", "fp8"):
        model, _ = _calibrated([{"type": "kv_cache", "dtype": dtype}], samples)
        with torch.no_grad():
            errors[dtype] = (model(tokens).logits - expected).abs().max().item()
    assert 0 < errors["int8"] < 0.05 and 0 < errors["fp8"] < 0.1


def test_fake_quantize_kv_round_trip_is_bounded_per_head():
    states = torch.randn(2, 3, 16, 8) * torch.tensor([1.0, 10.0, 100.0]).view(1, 3, 1, 1)
    scale = states.abs().amax(dim=(0, 2, 3)).view(3, 1, 1)
    for scheme in (KVCacheScheme("int", "attn_head"), KVCacheScheme("float", "attn_head")):
        per_head_scale = scale / scheme.qmax
        error = (fake_quantize_kv(states, scheme.storage_dtype, per_head_scale) - states).abs()
        if scheme.type == "int":
            assert (error <= per_head_scale / 2 + 1e-6).all()
        else:  # e4m3: 3 mantissa bits, relative error ≤ 2^-4 above the subnormal range
            assert (error <= states.abs() / 16 + per_head_scale * 2**-9).all()


def test_two_kv_quantizers_are_rejected():
    with pytest.raises(CompressError, match=r"stages.1 \(kv_cache\) would overwrite the KV-cache scales of stages.0"):
        build_chain([{"type": "kv_cache"}, {"type": "kv_cache", "dtype": "int8"}])
    with pytest.raises(CompressError, match=r"stages.0 \(kv_cache\): dtype='int4' must be one of fp8, int8"):
        build_chain([{"type": "kv_cache", "dtype": "int4"}])


def test_awq_then_kv_int8_chain_writes_both():
    samples = torch.randint(0, 320, (4, 32))
    model, stages = _calibrated(
        [{"type": "awq", "bits": 4, "group_size": 32}, {"type": "kv_cache", "dtype": "int8"}], samples
    )
    assert [s.name for s in stages] == ["awq", "kv_cache"]
    assert hasattr(model.model.layers[0].self_attn, "k_scale")


def test_cli_run_with_kv_cache_writes_scheme_and_scores_with_quantized_kv(tiny_model_dir, artifacts):
    from compress.__main__ import main

    small = [
        "data.num_samples=4",
        "data.seq_len=64",
        "eval.seq_len=64",
        "eval.max_windows=3",
        "tracking.enabled=false",
        "stages.0.group_size=32",
        "stages.0.grid=2",
        "stages.0.clip=false",
        "eval.reference=null",
        "gate=none",
    ]
    assert main(["run", "recipe=awq_int4_kv_int8", f"model={tiny_model_dir}", *small]) == 0
    [run_dir] = (artifacts / "runs").iterdir()
    report = json.loads((run_dir / "report.json").read_text())
    qconfig = json.loads((run_dir / "checkpoint" / "config.json").read_text())["quantization_config"]
    assert qconfig["format"] == "pack-quantized" and qconfig["kv_cache_scheme"]["type"] == "int"
    assert report["stages"]["1:kv_cache"]["calibrated_layers"] == 2
    candidate, _ = load_checkpoint(run_dir / "checkpoint")
    assert candidate.model.layers[0].self_attn.kv_scheme.type == "int"  # the candidate was scored with int8 K/V
