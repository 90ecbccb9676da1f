"""Stored formats, one module per compressed-tensors format, named like the kernel module that runs it:

=================  ==========================================  =======================
module             compressed-tensors format                   kernel
=================  ==========================================  =======================
``w4a16``          ``pack-quantized`` (int2-8 weights)          ``kernels/w4a16.py``
``w8a8``           ``int-quantized``, ``float-quantized``       ``kernels/w8a8.py``
``fp8_block``      ``float-quantized``, 128x128 blocks          ``kernels/fp8_block.py``
``fp4``            ``nvfp4-pack-quantized``, ``mxfp4-...``      ``kernels/fp4.py``
=================  ==========================================  =======================

Each module owns its quantized linear (what stages produce, the checkpoint stores and the engine runs), the config
group config.json describes it with and, where the search prices it, its stored bits. Adding a format is a module
here plus its kernel. Imports only torch, ``compress.kernels`` and ``compress.grids.fp4_grid``, so a bare GPU box runs
them.
"""

from compress.formats.fp4_linear import Fp4Linear
from compress.formats.fp8_block_linear import Fp8BlockLinear
from compress.formats.w4a16_linear import QuantizedLinear
from compress.formats.w8a8_linear import Fp8Linear, Int8Linear

QUANTIZED_LINEARS = (QuantizedLinear, Int8Linear, Fp8Linear, Fp8BlockLinear, Fp4Linear)  # each has stored_bits()

__all__ = ["QUANTIZED_LINEARS", "Fp4Linear", "Fp8BlockLinear", "Fp8Linear", "Int8Linear", "QuantizedLinear"]
