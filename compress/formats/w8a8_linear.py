"""8-bit weights with activations quantized at run time, per output channel: compressed-tensors ``int-quantized``
(int8, dynamic per-token activations) and ``float-quantized`` (FP8 e4m3, per-token or static per-tensor
activations). Runs on ``kernels/w8a8.py``."""

from __future__ import annotations

import torch
from torch import nn

from compress.kernels import ops
from compress.kernels.dtypes import FP8_MAX, INT8_MAX
from compress.kernels.w8a8 import SCALE_EPS

INT_FORMAT = "int-quantized"  # W8A8 int8: int8 `weight`, `weight_scale [out, 1]`, activations quantized per token
FLOAT_FORMAT = "float-quantized"  # FP8 e4m3 `weight`, `weight_scale [out, 1]`, optional static `input_scale`
SCALE_BITS = 32  # fp32 per-channel weight scales


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

    def stored_bits(self) -> int:
        """Bits the checkpoint stores for this weight: 8-bit codes and the per-channel scales."""
        return self.weight.numel() * 8 + self.weight_scale.numel() * self.weight_scale.element_size() * 8

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


def scheme_key(module: Int8Linear | Fp8Linear) -> tuple[str, bool]:
    """What makes two modules share a config group: int or float codes, static or dynamic activations."""
    kind = "int" if isinstance(module, Int8Linear) else "float"
    return kind, getattr(module, "input_scale", None) is not None


def config_group(kind: str, static: bool) -> dict:
    """The compressed-tensors config group (less its targets) of one :func:`scheme_key`."""
    return {
        "weights": {
            "num_bits": 8,
            "type": kind,
            "symmetric": True,
            "strategy": "channel",
            "group_size": None,
            "dynamic": False,
            "actorder": None,
        },
        "input_activations": {
            "num_bits": 8,
            "type": kind,
            "symmetric": True,
            "strategy": "tensor" if static else "token",
            "group_size": None,
            "dynamic": not static,
            "actorder": None,
        },
        "output_activations": None,
        "format": INT_FORMAT if kind == "int" else FLOAT_FORMAT,
    }


def stored_bits(out_features: int, in_features: int) -> int:
    """Bits the checkpoint stores for one weight: 8-bit codes plus an fp32 scale per row."""
    return out_features * (in_features * 8 + SCALE_BITS)
