"""Packed integer weights, compressed-tensors ``pack-quantized`` (W4A16, W3A16, W8A16 ...): int32 words of codes,
group or channel scales, optional zero points and act-order ``g_idx``. Runs on ``kernels/w4a16.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compress.kernels import ops
from compress.kernels.backend import requested_backend
from compress.kernels.dequant import dequantize_packed
from compress.kernels.packing import pack_int32, packed_width
from compress.kernels.w4a16 import repack_n_contiguous

FORMAT = "pack-quantized"


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

    def stored_bits(self) -> int:
        """Bits the checkpoint stores for this weight: the words, the scales and the zero points (``num_bits``
        each: compressed-tensors packs them like the codes)."""
        bits = self.weight_packed.numel() * 32 + self.weight_scale.numel() * self.weight_scale.element_size() * 8
        if self.weight_zero_point is not None:
            bits += self.weight_zero_point.numel() * self.num_bits
        return bits

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
        return tuple((t.data_ptr(), tensor_version(t)) for t in (self.weight_packed, self.weight_scale))

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


def tensor_version(t: torch.Tensor) -> int:
    """How many in-place writes ``t`` has seen, -1 for an inference tensor (which keeps no counter): half of the
    key that tells a derived copy (kernel layout, dense weight, a fused group's pending output) it went stale."""
    return -1 if t.is_inference() else t._version


def scheme_key(module: QuantizedLinear) -> tuple[int, bool, int | None, bool]:
    """What makes two modules share a config group: bits, symmetry, group size (None: per channel), act order."""
    channel = module.group_size == module.in_features
    return (module.num_bits, module.symmetric, None if channel else module.group_size, module.weight_g_idx is not None)


def config_group(bits: int, symmetric: bool, group_size: int | None, act_order: bool) -> dict:
    """The compressed-tensors config group (less its targets) of one :func:`scheme_key`."""
    return {
        "weights": {
            "num_bits": bits,
            "type": "int",
            "symmetric": symmetric,
            "strategy": "channel" if group_size is None else "group",
            "group_size": group_size,
            "dynamic": False,
            "actorder": "group" if act_order else None,
        },
        "input_activations": None,
        "output_activations": None,
        "format": FORMAT,
    }


def stored_bits(out_features: int, in_features: int, bits: int, group_size: int, scale_bits: int) -> int:
    """Bits the checkpoint stores for one weight: int32 words of codes plus one scale per group and row."""
    groups = in_features // group_size
    return out_features * (packed_width(in_features, bits) * 32 + groups * scale_bits)
