"""``bench engine``: both modes run end to end on a tiny model and write their tables."""

import json

from compress.commands.bench import load_target

bench = load_target("engine")


def test_decode_mode_times_dense_and_every_converted_format(tiny_model_dir, tmp_path, monkeypatch):
    """On the torch attention a CPU takes outside this suite: the interpreted Triton attention (the engine tests
    cover it) would take 95% of the time here, writing and reading 128-token prompts one program at a time."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read per call by the engine's attention; kernels stay imported
    argv = [
        f"checkpoint={tiny_model_dir}",
        "mode=decode",
        "decode_tokens=4",
        "decode_weights=w4a16,w4a16-unfused,int8,fp8",
        f"out={tmp_path}",
    ]
    assert bench.main(argv) == 0
    (result,) = tmp_path.glob("engine-decode-*.json")
    rates = json.loads(result.read_text())["decode_tok_s"]
    assert set(rates) == {"dense", "w4a16", "w4a16-unfused", "int8", "fp8"} and all(rate > 0 for rate in rates.values())
    assert "| w4a16 |" in result.with_suffix(".md").read_text()


def test_converted_linears_are_restored(tiny_model_dir):
    import torch

    model, _ = bench.load(bench.EngineBenchOptions(checkpoint=str(tiny_model_dir)), "cpu")
    ids = torch.tensor([[1, 2, 3, 4]])
    before = model(ids).logits
    replaced = bench.convert_linears(model, "w4a16", 128)  # 64-wide tiny layers fall back to group 64
    assert replaced and type(model.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    assert not torch.equal(model(ids).logits, before)
    bench.restore(replaced)
    assert torch.equal(model(ids).logits, before)


def test_bad_options_are_refused():
    assert bench.main(["mode=fast"]) == 2
    assert bench.main(["unknown=1"]) == 2


def test_unknown_decode_weights_are_refused_before_the_model_loads(capsys):
    assert bench.main(["checkpoint=/nonexistent", "mode=decode", "decode_weights=w4a16,int3"]) == 2
    assert "unknown ['int3']" in capsys.readouterr().err


def test_decode_profile_splits_a_step_by_kind_of_kernel(tiny_model_dir, tmp_path, monkeypatch):
    """On a CPU the profile reads aten ops' self times (a smoke check); on a GPU the kernels' device times."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    argv = [f"checkpoint={tiny_model_dir}", "mode=decode", "decode_tokens=4", "decode_weights=w4a16"]
    assert bench.main([*argv, "profile=true", "profile_steps=3", f"out={tmp_path}"]) == 0
    (result,) = tmp_path.glob("engine-decode-*.json")
    profiles = json.loads(result.read_text())["decode_profile"]
    assert set(profiles) == {"dense", "w4a16"}
    for profile in profiles.values():
        assert profile["steps"] == 3 and profile["step_wall_us"] > 0
        assert abs(sum(profile["by_kind_us"].values()) - profile["kernel_us"]) < 1e-6 * profile["kernel_us"] + 1e-9
    assert any("GEMM" in kind for kind in profiles["dense"]["by_kind_us"])
    assert "Where a decode step goes (3 steps profiled" in result.with_suffix(".md").read_text()


def test_kernel_kinds_name_our_kernels_before_the_gemms():
    assert bench.kernel_kind("gemv_kernel") == "quantized linears (ours)"
    assert bench.kernel_kind("_paged_attention_kernel") == "attention"
    assert bench.kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n").startswith("bf16 GEMMs")
    assert bench.kernel_kind("triton_red_fused_rms_norm") == "norms"
    assert bench.kernel_kind("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>") == (
        "elementwise"
    )
