import copy

import pytest
import torch
from helpers import wide_init_model

from compress.compression.in_memory import compress_model
from compress.engine import LLM, SamplingParams
from compress.engine.fusion import FusedProjections, fuse_sibling_projections
from compress.formats import QuantizedLinear

pytestmark = pytest.mark.gpu  # the stacked launch runs the compiled kernel under COMPRESS_TEST_DEVICE=cuda


def quantized_model(stages=None):
    model = wide_init_model()
    compress_model(model, stages or [{"type": "rtn", "bits": 4, "group_size": 32}], torch.zeros(1, 8, dtype=torch.long))
    return model


def test_stacked_projections_give_the_separate_outputs():
    model = quantized_model()
    separate = copy.deepcopy(model)
    assert fuse_sibling_projections(model) == 2 * len(model.model.layers)  # q/k/v and gate/up in each layer
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        fused_logits, separate_logits = model(ids).logits, separate(ids).logits
    assert torch.allclose(fused_logits, separate_logits, rtol=1e-4, atol=1e-4)


def test_engine_with_stacked_projections_decodes_like_transformers():
    model = quantized_model()
    separate = copy.deepcopy(model)
    fuse_sibling_projections(model)
    prompt = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    (output,) = LLM(model, num_kv_blocks=64, attention_backend="torch").generate(
        [prompt], SamplingParams(max_tokens=10, ignore_eos=True)
    )
    ids = torch.tensor([prompt])
    expected = separate.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    assert output.token_ids == expected[0, len(prompt) :].tolist()


def test_a_member_handed_another_input_computes_its_own():
    attention = quantized_model().model.layers[0].self_attn
    reference = copy.deepcopy(attention)
    fuse_sibling_projections(attention)
    x, y = torch.randn(1, 4, 64), torch.randn(1, 4, 64)
    with torch.no_grad():
        attention.q_proj(x)  # leaves k and v of x pending
        assert torch.allclose(attention.k_proj(y), reference.k_proj(y), rtol=1e-4, atol=1e-5)
        attention.q_proj(x)
        x.add_(1.0)  # the same tensor, changed in place: its pending outputs are stale
        assert torch.allclose(attention.v_proj(x), reference.v_proj(x), rtol=1e-4, atol=1e-5)


def test_members_of_different_schemes_stay_separate():
    model = quantized_model()
    attention = model.model.layers[0].self_attn
    other = QuantizedLinear(64, attention.v_proj.out_features, 4, 64, True)  # group 64 where q and k use 32
    attention.v_proj = other
    assert fuse_sibling_projections(model) == 2 * len(model.model.layers) - 1
    assert "forward" not in vars(attention.q_proj) and "forward" not in vars(other)


def test_stacked_weight_is_a_view_for_the_reference_path():
    """The reference path reads the on-disk layout through a view of the repacked words: no third copy."""
    layer = quantized_model().model.layers[0].mlp
    group = FusedProjections([layer.gate_proj, layer.up_proj])
    assert group.weight_packed.data_ptr() == group.packed_kn.data_ptr()
    assert torch.equal(group.weight_packed, torch.cat([layer.gate_proj.weight_packed, layer.up_proj.weight_packed]))
