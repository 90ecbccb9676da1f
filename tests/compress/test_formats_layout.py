"""compress/formats/ mirrors kernels/: one module per stored format, ``<kernel>_linear.py`` beside the kernel module
``kernels/<kernel>.py`` that runs it (a file name says its role: the linear layer, not the kernel), and
each quantized linear prices its own storage the way the mixed-precision search predicts it."""

from pathlib import Path

import torch
from torch import nn

from compress import formats
from compress.formats import w4a16_linear, w8a8_linear
from compress.grids.int_grid import WeightScheme, quantize
from compress.stages.mixed import candidate

ROOT = Path(__file__).resolve().parents[2]


def test_every_format_module_is_named_after_its_kernel_module():
    names = sorted(
        p.stem for p in (ROOT / "compress" / "formats").glob("*.py") if p.stem not in ("__init__", "moe_experts")
    )
    assert names == ["fp4_linear", "fp8_block_linear", "w4a16_linear", "w8a8_linear"]
    assert all((ROOT / "kernels" / f"{name.removesuffix('_linear')}.py").exists() for name in names)
    assert {cls.__module__ for cls in formats.QUANTIZED_LINEARS} == {f"compress.formats.{n}" for n in names}


def test_the_search_predicts_the_bits_each_module_stores():
    linear = nn.Linear(256, 48, bias=False)
    codes, scale, zero = quantize(linear.weight.detach(), WeightScheme(4, 64, True), scale_dtype=torch.bfloat16)
    int4 = formats.QuantizedLinear.from_codes(codes, scale, zero, num_bits=4, group_size=64)
    assert candidate("int4_g64").stored_bits(48, 256, dtype_bits=int4.weight_scale.element_size() * 8) == (
        int4.stored_bits()
    )
    fp8 = formats.Fp8Linear.from_float(linear)
    assert candidate("fp8").stored_bits(48, 256, dtype_bits=16) == fp8.stored_bits() == w8a8_linear.stored_bits(48, 256)
    assert w4a16_linear.stored_bits(48, 256, 4, 64, 16) == 48 * (256 // 8 * 32 + 4 * 16)
