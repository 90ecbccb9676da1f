"""Quantized linear modules through the kernel path (Triton interpreter) and the reference path."""

import os

import pytest
import torch
from helpers import build_tiny_llama
from torch import nn

from compress.formats import Fp8Linear, Int8Linear, QuantizedLinear
from compress.kernels.accuracy import relative_error
from compress.kernels.backend import use_backend

pytestmark = pytest.mark.gpu  # also run against the compiled kernels: COMPRESS_TEST_DEVICE=cuda pytest -m gpu

ON_GPU = os.environ.get("COMPRESS_TEST_DEVICE") == "cuda"  # tests/cuda_shim.py runs the kernels compiled


def rtn_group_quantize(weight: torch.Tensor, group_size: int, asym: bool, act_order: bool, num_bits: int = 4):
    """Round-to-nearest group quantization of a dense weight, enough to build realistic test modules."""
    out_features, in_features = weight.shape
    g_idx = None
    if act_order:  # static act-order: groups follow a column permutation
        g_idx = torch.argsort(torch.randperm(in_features, generator=torch.Generator().manual_seed(0)))
        g_idx = (g_idx // group_size).to(torch.int32)
    groups = g_idx.long() if g_idx is not None else torch.arange(in_features) // group_size
    low, high = -(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1
    members = [weight[:, groups == g] for g in range(in_features // group_size)]
    if asym:
        w_min = torch.stack([m.amin(dim=1) for m in members], dim=1)
        w_max = torch.stack([m.amax(dim=1) for m in members], dim=1)
        scale = ((w_max - w_min) / (high - low)).clamp(min=1e-8)
        zero = (low - torch.round(w_min / scale)).clamp(low, high).to(torch.int8)
        codes = torch.round(weight / scale[:, groups]) + zero[:, groups]
    else:
        absmax = torch.stack([m.abs().amax(dim=1) for m in members], dim=1)
        scale, zero = (absmax / high).clamp(min=1e-8), None
        codes = torch.round(weight / scale[:, groups])
    return codes.clamp(low, high).to(torch.int8), scale, zero, g_idx


def quantized_from_linear(linear: nn.Linear, group_size: int, asym: bool, act_order: bool) -> QuantizedLinear:
    codes, scale, zero, g_idx = rtn_group_quantize(linear.weight.detach().float(), group_size, asym, act_order)
    bias = None if linear.bias is None else linear.bias.detach()
    return QuantizedLinear.from_codes(codes, scale, zero, 4, group_size, bias=bias, g_idx=g_idx)


def test_rtn_helper_is_a_faithful_quantizer():
    linear = nn.Linear(64, 16, bias=True)
    for asym, act_order in [(False, False), (True, True)]:
        module = quantized_from_linear(linear, 32, asym, act_order)
        assert relative_error(module.dequantized_weight(), linear.weight) < 0.15


@pytest.mark.parametrize("asym,act_order", [(False, False), (True, False), (True, True)])
def test_quantized_linear_kernel_path_equals_reference_path(asym, act_order):
    module = quantized_from_linear(nn.Linear(128, 40, bias=True), 32, asym, act_order)
    x = torch.randn(3, 7, 128)
    with use_backend("triton"):
        kernel = module(x)
    with use_backend("reference"):
        reference = module(x)
    assert module.packed_for_kernels() is None  # the N-contiguous repack is a CUDA-only cache
    assert relative_error(kernel, reference) < 1e-5


@pytest.mark.parametrize("cls", [Int8Linear, Fp8Linear])
def test_activation_quantized_modules_from_float(cls):
    linear = nn.Linear(96, 40, bias=True)
    module = cls.from_float(linear)
    assert set(module.state_dict()) == {"weight", "weight_scale", "bias"}
    assert module.weight.dtype == (torch.int8 if cls is Int8Linear else torch.float8_e4m3fn)
    assert module.weight_scale.shape == (40, 1) and module.weight_scale.dtype == torch.float32
    assert relative_error(module.dequantized_weight(), linear.weight) < 0.05
    x = torch.randn(4, 96)
    with use_backend("triton"):
        kernel = module(x)
    with use_backend("reference"):
        reference = module(x)
    fp8_on_gpu = ON_GPU and cls is Fp8Linear  # Hopper's fp8 tensor cores sum with fewer mantissa bits
    assert relative_error(kernel, reference) < (2e-4 if fp8_on_gpu else 1e-5)
    assert relative_error(reference, linear(x)) < 0.06


def test_fp8_static_input_scale_is_a_compressed_tensors_buffer():
    linear = nn.Linear(64, 24)
    module = Fp8Linear.from_float(linear, input_scale=0.02)
    assert set(module.state_dict()) == {"weight", "weight_scale", "bias", "input_scale"}
    restored = Fp8Linear(64, 24, bias=True, static_input_scale=True)
    restored.load_state_dict(module.state_dict())
    x = torch.randn(5, 64)
    assert torch.equal(restored(x), module(x))
    assert relative_error(module(x), linear(x)) < 0.06
    with pytest.raises(ValueError, match="input_scale must be positive"):
        Fp8Linear.from_float(linear, input_scale=0.0)


def swap_linears(model: nn.Module, make) -> int:
    """Replace every decoder-layer linear (not the LM head) by ``make(name, linear)``."""
    swapped = 0
    for name, module in list(model.model.layers.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, make(f"{name}.{child_name}", child))
                swapped += 1
    return swapped


@pytest.mark.parametrize("kind", ["w4a16", "int8", "fp8"])
def test_tiny_llama_logits_kernel_path_equal_reference_path(kind):
    model = build_tiny_llama(vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense_logits = model(tokens).logits

    def make(name, linear):
        if kind == "int8":
            return Int8Linear.from_float(linear)
        if kind == "fp8":
            return Fp8Linear.from_float(linear)
        asym, act_order = "mlp" in name, "down_proj" in name  # mix sym / asym / act-order layers
        return quantized_from_linear(linear, 32, asym, act_order)

    assert swap_linears(model, make) == 14
    with torch.no_grad(), use_backend("triton"):
        kernel_logits = model(tokens).logits
    with torch.no_grad(), use_backend("reference"):
        reference_logits = model(tokens).logits
    # On a GPU, fp8 kernel sums differ from the reference in the last bits; where an activation sits on an fp8
    # rounding boundary the next layer's code moves one e4m3 step (up to 6%), so the logits drift more.
    assert relative_error(kernel_logits, reference_logits) < (3e-2 if ON_GPU and kind == "fp8" else 1e-4)
    assert 0 < relative_error(reference_logits, dense_logits) < 0.2  # quantized, yet still the same model


def test_cpu_dense_weight_follows_its_buffers_and_inference_mode():
    codes = torch.randint(-8, 8, (8, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    x = torch.randn(2, 64)
    with torch.inference_mode():  # inference tensors keep no version counter
        module = QuantizedLinear.from_codes(codes, torch.rand(8, 2) * 0.1, None, 4, 32)
        module.keep_dense_on_cpu = True
        inside = module(x)
    assert torch.equal(module(x), inside)
    module = QuantizedLinear.from_codes(codes, torch.rand(8, 2) * 0.1, None, 4, 32)
    module.keep_dense_on_cpu = True  # what the engine sets
    before = module(x)
    with torch.no_grad():
        module.weight_scale.mul_(2)  # an in-place change must rebuild the cached dense weight
    assert torch.allclose(module(x), 2 * before)
    with use_backend("reference"):  # the cached dense weight computes exactly what the reference path does
        reference = module(x)
    assert torch.equal(module(x), reference)
