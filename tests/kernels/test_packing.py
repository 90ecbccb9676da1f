"""Our pack-quantized bit layout must equal compressed-tensors' own, or vLLM/transformers read garbage."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from compress.kernels.packing import pack_int32, unpack_int32


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(5, 64), (7, 96), (3, 576), (9, 40)])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_matches_compressed_tensors(bits, shape, dim):
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = torch.randint(low, high + 1, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(bits))
    ours = pack_int32(codes, bits, dim)
    assert torch.equal(ours, pack_to_int32(codes, bits, packed_dim=dim))
    assert torch.equal(unpack_int32(ours, bits, shape[dim], dim), codes)
    assert torch.equal(unpack_from_int32(ours, bits, torch.Size(shape), packed_dim=dim), codes)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="int8"):
        pack_int32(torch.zeros(2, 8, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="1..8 bits"):
        pack_int32(torch.zeros(2, 8, dtype=torch.int8), 9)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_int32(torch.zeros(2, 3, dtype=torch.int32), 4, 64)
