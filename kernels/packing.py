"""Bit packing in the compressed-tensors ``pack-quantized`` layout, in plain torch.

Layout (what vLLM and transformers read): signed b-bit codes are offset to unsigned (``q + 2**(b-1)``) and
written as one dense little-endian bit stream per row: code ``j`` occupies bits ``j*b .. j*b+b-1`` of the row,
word ``w`` holds bits ``32*w .. 32*w+31``. For b=4 that is eight nibbles per int32, code ``j`` in word ``j // 8``
at shift ``4 * (j % 8)``; for b=3 codes straddle word boundaries. Weights are packed along the input dimension
(``[out, ceil(in*b/32)]``); zero points along the output dimension (``[ceil(out*b/32), groups]``).

Kept free of anything but torch so that kernels and the engine can use it on a bare GPU box.
"""

from __future__ import annotations

import math

import torch


def packed_width(num_values: int, num_bits: int) -> int:
    """Number of int32 words holding ``num_values`` codes of ``num_bits`` bits."""
    return math.ceil(num_values * num_bits / 32)


def _check_bits(num_bits: int) -> None:
    if not 1 <= num_bits <= 8:
        raise ValueError(f"packing supports 1..8 bits, got {num_bits}")


def pack_int32(codes: torch.Tensor, num_bits: int, dim: int = 1) -> torch.Tensor:
    """Pack signed int8 ``codes`` (range ``[-2**(b-1), 2**(b-1)-1]``) of a 2-D tensor along ``dim``."""
    _check_bits(num_bits)
    if codes.dtype != torch.int8 or codes.ndim != 2:
        raise ValueError(f"pack_int32 expects a 2-D int8 tensor, got {codes.dtype} {tuple(codes.shape)}")
    rows = codes.transpose(0, 1) if dim == 0 else codes
    unsigned = rows.to(torch.int64) + (1 << (num_bits - 1))
    n_rows, n_cols = unsigned.shape
    if 32 % num_bits == 0 and n_cols % (32 // num_bits) == 0:  # codes never straddle words: shift and sum
        per_word = 32 // num_bits
        shifts = torch.arange(per_word, device=codes.device) * num_bits
        words = (unsigned.reshape(n_rows, -1, per_word) << shifts).sum(-1)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        return words.transpose(0, 1).contiguous() if dim == 0 else words.contiguous()
    bit_index = torch.arange(num_bits, device=codes.device)
    bits = (unsigned.unsqueeze(-1) >> bit_index) & 1  # [rows, cols, b]: the row's bit stream
    stream = bits.reshape(n_rows, n_cols * num_bits)
    n_words = packed_width(n_cols, num_bits)
    stream = torch.nn.functional.pad(stream, (0, n_words * 32 - stream.shape[1]))
    weights = torch.ones(32, dtype=torch.int64, device=codes.device) << torch.arange(32, device=codes.device)
    words = (stream.reshape(n_rows, n_words, 32) * weights).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.transpose(0, 1).contiguous() if dim == 0 else words.contiguous()


def unpack_int32(packed: torch.Tensor, num_bits: int, length: int, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: ``length`` signed int8 codes per row (``dim=1``) or column (``dim=0``)."""
    _check_bits(num_bits)
    if packed.dtype != torch.int32 or packed.ndim != 2:
        raise ValueError(f"unpack_int32 expects a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    rows = packed.transpose(0, 1) if dim == 0 else packed
    if rows.shape[1] != packed_width(length, num_bits):
        raise ValueError(
            f"{rows.shape[1]} packed words cannot hold {length} codes of {num_bits} bits "
            f"(expected {packed_width(length, num_bits)})"
        )
    if 32 % num_bits == 0 and length % (32 // num_bits) == 0:
        # int32 all the way: an arithmetic shift drags the sign bit in from the left, and the mask drops it
        shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=packed.device)
        unsigned = ((rows.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)).to(torch.int8)
        codes = unsigned.reshape(rows.shape[0], length).sub_(1 << (num_bits - 1))
        return codes.transpose(0, 1).contiguous() if dim == 0 else codes
    words = rows.to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(-1) >> torch.arange(32, device=packed.device)) & 1
    stream = bits.reshape(rows.shape[0], -1)[:, : length * num_bits]
    place = torch.ones(num_bits, dtype=torch.int64, device=packed.device) << torch.arange(
        num_bits, device=packed.device
    )
    unsigned = (stream.reshape(rows.shape[0], length, num_bits) * place).sum(-1)
    codes = (unsigned - (1 << (num_bits - 1))).to(torch.int8)
    return codes.transpose(0, 1).contiguous() if dim == 0 else codes
