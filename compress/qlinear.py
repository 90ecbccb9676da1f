"""Quantized linear modules: what stages produce, what the checkpoint stores and what the engine runs.

Imports only torch, ``kernels`` and ``compress.fp4`` (FP4 activation rounding, itself torch and kernels only) so
that a GPU box without the pipeline's dependencies can run them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compress.fp4 import fake_quantize_fp4_activations
from compress.kernels import fp4, fp8_block, ops
from compress.kernels.backend import requested_backend
from compress.kernels.dequant import dequantize_packed
from compress.kernels.dtypes import FP8_MAX, INT8_MAX
from compress.kernels.packing import pack_int32, packed_width
from compress.kernels.w4a16 import repack_n_contiguous
from compress.kernels.w8a8 import SCALE_EPS


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is group-quantized to ``num_bits`` and stored packed (compressed-tensors
    ``pack-quantized``): ``W[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)]``; symmetric layers have no ``z``."""

    # On CPU (no int4 kernel) the weight is dequantized for every call unless this is on: then the dense weight is
    # kept between calls, costing its memory. The engine turns it on (decoding one token per call would otherwise
    # run ~6x slower than the dense model); evaluation and calibration, whose calls carry thousands of tokens, keep
    # no dense copy of every layer.
    keep_dense_on_cpu: bool = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_bits: int,
        group_size: int,
        symmetric: bool,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        act_order: bool = False,
    ):
        super().__init__()
        if in_features % group_size:
            raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")
        self.in_features, self.out_features = in_features, out_features
        self.num_bits, self.group_size, self.symmetric = num_bits, group_size, symmetric
        groups = in_features // group_size
        self.register_buffer(
            "weight_packed", torch.zeros(out_features, packed_width(in_features, num_bits), dtype=torch.int32)
        )
        self.register_buffer("weight_scale", torch.ones(out_features, groups, dtype=dtype))
        self.register_buffer(
            "weight_zero_point", None if symmetric else torch.zeros(out_features, groups, dtype=torch.int8)
        )
        self.register_buffer("weight_g_idx", torch.arange(in_features) // group_size if act_order else None)
        zeros = torch.zeros(out_features, dtype=dtype)
        self.bias = nn.Parameter(zeros, requires_grad=False) if bias else None

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor | None,
        num_bits: int,
        group_size: int,
        bias: torch.Tensor | None = None,
        g_idx: torch.Tensor | None = None,
    ) -> QuantizedLinear:
        """Build from int8 codes ``[out, in]`` and per-group ``scale``/``zero_point`` ``[out, groups]``."""
        packed = pack_int32(codes.to(torch.int8), num_bits)
        zero_point = None if zero_point is None else zero_point.to(torch.int8)
        return cls.from_packed(packed, scale, zero_point, num_bits, group_size, tuple(codes.shape), bias, g_idx)

    @classmethod
    def from_packed(
        cls,
        packed: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor | None,
        num_bits: int,
        group_size: int,
        shape: tuple[int, int],
        bias: torch.Tensor | None = None,
        g_idx: torch.Tensor | None = None,
    ) -> QuantizedLinear:
        """Build from codes packed as the checkpoint stores them (int32 words along the input dim) and the unpacked
        int8 ``zero_point``; ``shape`` is the dense weight's ``(out, in)``. The one constructor of a packed layer:
        the compression builds through ``from_codes``, the checkpoint reader straight from the stored tensors."""
        out_features, in_features = shape
        with torch.device(scale.device):  # build where the codes live: no host round trip for large models
            module = cls(
                in_features,
                out_features,
                num_bits,
                group_size,
                symmetric=zero_point is None,
                bias=bias is not None,
                dtype=scale.dtype,
                act_order=g_idx is not None,
            )
        module.weight_packed.copy_(packed)
        module.weight_scale.copy_(scale)
        if zero_point is not None:
            module.weight_zero_point.copy_(zero_point)
        if g_idx is not None:
            module.weight_g_idx.copy_(g_idx)
        if bias is not None:
            module.bias.data.copy_(bias)
        return module

    def _apply(self, fn, recurse=True):
        """Moving or casting the module drops the copies derived from its buffers (kernel layout, CPU dense
        weight): they would pin memory where the module no longer is, e.g. a GPU repack of every layer the
        compression walk already sent back to the CPU, or a dense fp32 copy of every calibrated layer."""
        for cache in ("_layout", "_layout_source", "_dense", "_dense_source"):
            self.__dict__.pop(cache, None)
        return super()._apply(fn, recurse)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_packed(
            self.weight_packed,
            self.weight_scale,
            self.weight_zero_point,
            self.num_bits,
            self.in_features,
            self.group_size,
            self.weight_g_idx,
        )

    def packed_for_kernels(self) -> torch.Tensor | None:
        """On CUDA, the N-contiguous repack of ``weight_packed`` that the Triton kernels read coalesced; made
        once per weight (rebuilt if the buffer moves or is overwritten) and never saved: the checkpoint keeps
        the on-disk layout."""
        return self._kernel_layout()[0]

    def _kernel_layout(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """``(packed [K/8, N], scale, zero)`` for the kernels. On CUDA the scales and zero points are also
        stored N-contiguous (same ``[N, groups]`` shape, strides ``(1, N)``) so a tile's scale loads coalesce."""
        if not self.weight_packed.is_cuda:
            return None, self.weight_scale, self.weight_zero_point
        source = self._buffers_key()
        if getattr(self, "_layout_source", None) != source:

            def n_contiguous(t):
                return None if t is None else t.t().contiguous().t()

            self._layout = (
                repack_n_contiguous(self.weight_packed),
                n_contiguous(self.weight_scale),
                n_contiguous(self.weight_zero_point),
            )
            self._layout_source = source
        return self._layout

    def _buffers_key(self) -> tuple:
        """Changes when the packed weight or its scales are moved or overwritten: what the derived copies (kernel
        layout, CPU dense weight) depend on. Inference tensors keep no version counter; their storage decides."""
        return tuple(
            (t.data_ptr(), -1 if t.is_inference() else t._version) for t in (self.weight_packed, self.weight_scale)
        )

    def _cpu_dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight in ``dtype`` (fp32 scales, as the reference path); with ``keep_dense_on_cpu``
        kept between calls, never saved, rebuilt when the buffers change."""
        source = (dtype, *self._buffers_key())
        if getattr(self, "_dense_source", None) == source:
            return self._dense
        with torch.inference_mode(False), torch.no_grad():  # a kept copy must outlive an inference_mode call
            dense = dequantize_packed(
                self.weight_packed,
                self.weight_scale.float(),
                self.weight_zero_point,
                self.num_bits,
                self.in_features,
                self.group_size,
                self.weight_g_idx,
            ).to(dtype)
        if self.keep_dense_on_cpu:
            self._dense, self._dense_source = dense, source
        return dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda and requested_backend() != "triton":  # same numbers as the reference path
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self._cpu_dense_weight(x.dtype), bias)
        packed, scale, zero = self._kernel_layout()
        return ops.weight_only_linear(
            x,
            self.weight_packed,
            scale,
            zero,
            self.num_bits,
            self.in_features,
            self.group_size,
            self.weight_g_idx,
            self.bias,
            packed,
        )

    def extra_repr(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        return (
            f"in={self.in_features}, out={self.out_features}, int{self.num_bits} {kind} g{self.group_size}"
            f"{', act_order' if self.weight_g_idx is not None else ''}"
        )


def _per_channel_codes(weight: torch.Tensor, qmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest per-output-channel absmax quantization of a dense ``[out, in]`` weight."""
    values = weight.detach().float()
    scale = values.abs().amax(dim=1, keepdim=True).clamp(min=SCALE_EPS) / qmax
    scaled = (values / scale).clamp(-qmax, qmax)
    codes = torch.round(scaled).to(torch.int8) if dtype == torch.int8 else scaled.to(dtype)
    return codes, scale


class _ActivationQuantizedLinear(nn.Module):
    """Shared body of the W8A8 modules: an 8-bit ``weight [out, in]`` with fp32 ``weight_scale [out, 1]``
    (compressed-tensors names, so checkpoints load by name) and an optional bias."""

    weight_dtype: torch.dtype
    qmax: float

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=self.weight_dtype))
        self.register_buffer("weight_scale", torch.ones(out_features, 1, dtype=torch.float32))
        zeros = torch.zeros(out_features, dtype=dtype)
        self.bias = nn.Parameter(zeros, requires_grad=False) if bias else None

    def _load_dense(self, linear: nn.Linear) -> None:
        codes, scale = _per_channel_codes(linear.weight, self.qmax, self.weight_dtype)
        self.weight.copy_(codes)
        self.weight_scale.copy_(scale)
        if linear.bias is not None:
            self.bias.data.copy_(linear.bias.detach())

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale.float()


class Int8Linear(_ActivationQuantizedLinear):
    """W8A8 int8 (compressed-tensors ``int-quantized``): per-channel int8 weight, activations quantized per
    token at run time, int32 accumulation."""

    weight_dtype = torch.int8
    qmax = INT8_MAX

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Int8Linear:
        """Quantize a dense linear (round to nearest, per-channel absmax scale)."""
        with torch.device(linear.weight.device):
            module = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype)
        module._load_dense(linear)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.int8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, w8a8 int8 per-channel, dynamic per-token"


class Fp8Linear(_ActivationQuantizedLinear):
    """FP8 W8A8 (e4m3, compressed-tensors ``float-quantized``): per-channel weight scales; activations per
    token at run time, or per tensor when an ``input_scale`` buffer (static, calibrated) is present."""

    weight_dtype = torch.float8_e4m3fn
    qmax = FP8_MAX

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        static_input_scale: bool = False,
    ):
        super().__init__(in_features, out_features, bias, dtype)
        input_scale = torch.ones(1, dtype=torch.float32) if static_input_scale else None
        self.register_buffer("input_scale", input_scale)

    @classmethod
    def from_float(cls, linear: nn.Linear, input_scale: float | torch.Tensor | None = None) -> Fp8Linear:
        """Quantize a dense linear (round to nearest, per-channel absmax); ``input_scale`` makes activations
        static per-tensor (``x / input_scale`` must fit in +-448)."""
        with torch.device(linear.weight.device):
            module = cls(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                linear.weight.dtype,
                static_input_scale=input_scale is not None,
            )
        module._load_dense(linear)
        if input_scale is not None:
            scale = torch.as_tensor(input_scale, dtype=torch.float32).reshape(1)
            if not bool(scale > 0):
                raise ValueError(f"input_scale must be positive, got {scale.item()}")
            module.input_scale.copy_(scale)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.fp8_linear(x, self.weight, self.weight_scale, self.bias, self.input_scale)

    def extra_repr(self) -> str:
        activations = "static per-tensor" if self.input_scale is not None else "dynamic per-token"
        return f"in={self.in_features}, out={self.out_features}, w8a8 fp8 e4m3 per-channel, {activations}"


class Fp8BlockLinear(nn.Module):
    """FP8 block-wise W8A8 (compressed-tensors ``float-quantized``, ``strategy: block``): e4m3 ``weight [out, in]``
    with one scale per 128x128 block, ``weight_scale [ceil(out/128), ceil(in/128)]`` (edge blocks partial);
    activations quantized per token and group of 128 input channels at run time."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        scale_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        blocks = (-(-out_features // fp8_block.BLOCK[0]), -(-in_features // fp8_block.BLOCK[1]))
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale", torch.ones(blocks, dtype=scale_dtype))
        zeros = torch.zeros(out_features, dtype=dtype)
        self.bias = nn.Parameter(zeros, requires_grad=False) if bias else None

    @classmethod
    def from_float(cls, linear: nn.Linear, scale_dtype: torch.dtype = torch.float32) -> Fp8BlockLinear:
        """Round to nearest per block; ``scale_dtype`` is what the checkpoint stores (the model's dtype there)."""
        codes, scale = fp8_block.quantize_weight_fp8_blocks(linear.weight.detach(), scale_dtype=scale_dtype)
        with torch.device(linear.weight.device):
            bias = linear.bias is not None
            module = cls(linear.in_features, linear.out_features, bias, linear.weight.dtype, scale.dtype)
        module.weight.copy_(codes)
        module.weight_scale.copy_(scale)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module

    def dequantized_weight(self) -> torch.Tensor:
        return fp8_block.dequantize_fp8_blocks(self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.fp8_block_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 e4m3 128x128 blocks, dynamic per-token-group 128"


class Fp4Linear(nn.Module):
    """FP4 e2m1 weights (compressed-tensors ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized``): ``weight_packed``
    uint8 ``[out, in/2]`` with NVFP4 fp8 group-16 scales and an fp32 ``weight_global_scale``, or MXFP4 e8m0
    group-32 scales. With ``quantize_activations`` (W4A4: NVFP4, MXFP4 presets) the inputs are quantized per token
    and group too, NVFP4's against the calibrated ``input_global_scale``; the product itself runs on 16-bit
    activations (a GPU with FP4 tensor cores gets the same numbers from FP4 operands)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        quantize_activations: bool = False,
    ):
        super().__init__()
        groups = {"nvfp4": fp4.NVFP4_GROUP, "mxfp4": fp4.MXFP4_GROUP}
        if fmt not in groups:
            raise ValueError(f"unknown FP4 format {fmt!r}; use nvfp4 or mxfp4")
        if in_features % groups[fmt]:
            raise ValueError(f"in_features {in_features} is not a multiple of the {fmt} group {groups[fmt]}")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.quantize_activations = quantize_activations
        nv = fmt == "nvfp4"
        scale_dtype = fp4.FP8_SCALE if nv else fp4.MX_SCALE
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.ones(out_features, in_features // groups[fmt]).to(scale_dtype))
        self.register_buffer("weight_global_scale", torch.ones(1) if nv else None)
        self.register_buffer("input_global_scale", torch.ones(1) if nv and quantize_activations else None)
        zeros = torch.zeros(out_features, dtype=dtype)
        self.bias = nn.Parameter(zeros, requires_grad=False) if bias else None

    @classmethod
    def from_packed(
        cls,
        packed: torch.Tensor,
        scale: torch.Tensor,
        global_scale: torch.Tensor | None,
        bias: torch.Tensor | None = None,
        quantize_activations: bool = False,
        input_global_scale: torch.Tensor | None = None,
    ) -> Fp4Linear:
        """Build from checkpoint-layout tensors (see :class:`compress.fp4.Fp4Weight`)."""
        fmt = "mxfp4" if fp4.uses_mx_scales(scale, global_scale) else "nvfp4"
        out_features, in_features = packed.shape[0], packed.shape[1] * 2
        dtype = torch.float32 if bias is None else bias.dtype
        with torch.device(packed.device):
            module = cls(in_features, out_features, fmt, bias is not None, dtype, quantize_activations)
        module.weight_packed.copy_(packed)
        module.weight_scale.copy_(scale)
        if global_scale is not None:
            module.weight_global_scale.copy_(global_scale.reshape(1))
        if module.input_global_scale is not None:
            if input_global_scale is None:
                raise ValueError("NVFP4 with quantized activations needs the calibrated input_global_scale")
            module.input_global_scale.copy_(input_global_scale.reshape(1))
        if bias is not None:
            module.bias.data.copy_(bias)
        return module

    def dequantized_weight(self) -> torch.Tensor:
        return fp4.dequantize_fp4_reference(self.weight_packed, self.weight_scale, self.weight_global_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantize_activations:
            x = fake_quantize_fp4_activations(x, self.fmt, self.input_global_scale)
        return ops.fp4_linear(x, self.weight_packed, self.weight_scale, self.weight_global_scale, self.bias)

    def extra_repr(self) -> str:
        activations = f"{self.fmt} activations" if self.quantize_activations else "16-bit activations"
        return f"in={self.in_features}, out={self.out_features}, {self.fmt} weights, {activations}"
