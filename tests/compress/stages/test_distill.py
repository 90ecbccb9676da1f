"""Distillation: the KL to the dense teacher falls on held-out text, masks and quantization grids survive training."""

import copy

import pytest
import torch
from helpers import build_tiny_llama, build_tiny_tokenizer

from compress.base.errors import CompressError
from compress.compression.in_memory import compress_model
from compress.formats import QuantizedLinear
from compress.grids.sparsity import mask_of
from compress.stages import build_chain
from compress.stages.distill import ScaleTrainedLinear, _lr_factor, _trained_parameter, mean_kl, steps_within

CPU = torch.device("cpu")
DISTILL = {
    "type": "distill",
    "steps": 30,
    "seq_len": 32,
    "batch_size": 4,
    "held_out": 2,
    "learning_rate": 3e-3,
    "warmup_steps": 2,
    "max_minutes": None,
}


def _confident_model():
    """Random init at a larger scale: peaked next-token distributions, so pruning moves them measurably."""
    return build_tiny_llama(seed=2, initializer_range=0.1)


def _text_ids(topic_names, rows, length):
    from pydoc_data.topics import topics

    ids = _TOKENIZER(" ".join(topics[name] for name in topic_names), return_tensors="pt").input_ids[0]
    return ids[: rows * length].reshape(rows, length)


_TOKENIZER = build_tiny_tokenizer()


def _held_out_text():
    """pydoc prose the training samples below do not contain."""
    from pydoc_data.topics import topics

    return _text_ids(sorted(topics)[-3:], 8, 32)


def _samples():
    from pydoc_data.topics import topics

    return _text_ids(sorted(topics)[20:40], 8, 64)


def _chain(chain, model) -> list[dict]:
    return compress_model(model, chain, _samples(), CPU, batch_size=4)


def test_distillation_lowers_held_out_kl_and_keeps_the_mask():
    teacher = _confident_model()
    held_out = _held_out_text()
    pruned = _confident_model()
    _chain([{"type": "magnitude_prune"}], pruned)
    student = _confident_model()
    summaries = _chain([{"type": "magnitude_prune"}, DISTILL], student)  # the pruner's finalize re-checks every mask

    kl_pruned = mean_kl(pruned, teacher, held_out, 4)
    kl_distilled = mean_kl(student, teacher, held_out, 4)
    assert kl_distilled < 0.9 * kl_pruned, (kl_pruned, kl_distilled)
    assert summaries[1]["steps"] == 30 and summaries[1]["held_out_kl_after"] < summaries[1]["held_out_kl_before"]
    for name in ("self_attn.k_proj", "mlp.down_proj"):
        linear = student.model.layers[1].get_submodule(name)
        assert torch.equal(linear.weight != 0, mask_of(linear))
        assert not torch.equal(linear.weight, pruned.model.layers[1].get_submodule(name).weight)  # it trained


def test_teacher_is_the_model_before_the_first_compression():
    model = _confident_model()
    [stage] = [s for s in build_chain([{"type": "rtn", "group_size": 32}, DISTILL]) if s.name == "distill"]
    dense = copy.deepcopy(model)
    stage.before_stage(model, 0)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.zero_()
    assert torch.equal(stage.teacher.model.layers[0].mlp.up_proj.weight, dense.model.layers[0].mlp.up_proj.weight)


def test_quantized_student_trains_through_fake_quant_and_stays_on_its_grid():
    teacher = _confident_model()
    held_out = _held_out_text()
    quantized = _confident_model()
    _chain([{"type": "wanda"}, {"type": "rtn", "bits": 4, "group_size": 32}], quantized)
    student = _confident_model()
    summary = _chain([{"type": "wanda"}, {"type": "rtn", "bits": 4, "group_size": 32}, DISTILL], student)[2]
    assert summary["fake_quantized_linears"] == 14
    before = quantized.model.layers[0].mlp.gate_proj
    after = student.model.layers[0].mlp.gate_proj
    assert isinstance(after, QuantizedLinear)
    assert torch.equal(after.weight_scale, before.weight_scale)  # same grid: exportable as it was
    assert not torch.equal(after.weight_packed, before.weight_packed)  # but the codes learned
    assert not (after.dequantized_weight()[~mask_of(after)] != 0).any()
    assert mean_kl(student, teacher, held_out, 4) < mean_kl(quantized, teacher, held_out, 4)


def test_scale_training_keeps_every_code_and_learns_the_group_scales():
    """``trains: scales`` (EfficientQAT's end-to-end stage): the codes stay as the quantizer chose them, pruned
    zeros included, and only the per-group scales move, so the checkpoint keeps its layout and size."""
    teacher = _confident_model()
    held_out = _held_out_text()
    chain = [{"type": "wanda"}, {"type": "rtn", "bits": 4, "group_size": 32}]
    quantized = _confident_model()
    _chain(chain, quantized)
    student = _confident_model()
    summary = _chain([*chain, {**DISTILL, "trains": "scales", "learning_rate": 1e-3}], student)[2]
    assert summary["trains"] == "scales" and summary["trained_linears"] == 14
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        before = quantized.model.layers[1].get_submodule(name)
        after = student.model.layers[1].get_submodule(name)
        assert torch.equal(after.weight_packed, before.weight_packed)  # the codes, as quantized
        assert after.weight_scale.dtype == before.weight_scale.dtype
        assert not torch.equal(after.weight_scale, before.weight_scale)  # the scales learned
        assert torch.equal(mask_of(after), mask_of(before))
    assert mean_kl(student, teacher, held_out, 4) < mean_kl(quantized, teacher, held_out, 4)


def _scale_shares(relative: bool, lr: float, steps: int) -> list[torch.Tensor]:
    """Each group scale after ``steps`` AdamW steps over its start, for one layer as quantized and for the same codes
    on scales 10x smaller (a layer whose weights are that much smaller), trained towards outputs 5% larger."""
    quantized = _confident_model()
    _chain([{"type": "rtn", "bits": 4, "group_size": 32}], quantized)
    source = quantized.model.layers[0].mlp.up_proj
    inputs = torch.randn(16, source.in_features, generator=torch.Generator().manual_seed(0))
    shares = []
    for factor in (1.0, 0.1):
        layer = copy.deepcopy(source)
        layer.weight_scale.data.mul_(factor)
        start = layer.weight_scale.clone()
        module = ScaleTrainedLinear(layer, relative)
        assert torch.equal(module.to_quantized().weight_scale, start)  # untrained: the start, bit for bit
        target = 1.05 * module(inputs).detach()
        optimizer = torch.optim.AdamW([_trained_parameter(module)], lr=lr, weight_decay=0.0)
        for _ in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(module(inputs), target).backward()
            optimizer.step()
        shares.append(module.to_quantized().weight_scale.float() / start.float())
    return shares


def test_scale_training_moves_each_scale_by_the_same_share_whatever_its_size():
    """One learning rate must fit models whose weights differ in size: gemma-3-270m's group scales are ~5.6x smaller
    than SmolLM2-135M's, and the absolute rate tuned on SmolLM2 (5e-5) raised Gemma's held-out KL from 0.27 to 0.43.
    The same training signal on a layer 10x smaller must move its scales by the same share of themselves."""
    shares = _scale_shares(relative=True, lr=1e-2, steps=5)
    assert (shares[0] - 1).abs().mean() > 1e-3  # it trained
    torch.testing.assert_close(shares[0], shares[1], rtol=0, atol=5e-3)  # Adam's eps: not exactly


def test_absolute_scale_steps_are_efficientqats_and_move_small_scales_further():
    """``scale_steps: absolute`` (the default, EfficientQAT's): the scale itself trains, so the same step is a
    larger share of a smaller scale (what the relative steps above are for). One step: Adam's first is lr times the
    gradient's sign, whatever its size."""
    moved = [(share - 1).abs().mean() for share in _scale_shares(relative=False, lr=1e-4, steps=1)]
    assert moved[1] > 5 * moved[0]


@pytest.mark.parametrize("trains", ["scales", "weights"])
def test_training_that_raises_the_held_out_kl_keeps_the_start(trains):
    """Distillation is kept only if it lowers the KL on the held-out sequences it never trained on; a rate far too
    high for the model makes it worse, and the student then leaves the stage exactly as it came in."""
    chain = [{"type": "rtn", "bits": 4, "group_size": 32}]
    quantized = _confident_model()
    _chain(chain, quantized)
    student = _confident_model()
    summary = _chain([*chain, {**DISTILL, "trains": trains, "learning_rate": 3.0, "steps": 10}], student)[1]
    assert summary["kept"] == "start"
    assert summary["held_out_kl_trained"] > summary["held_out_kl_before"] == summary["held_out_kl_after"]
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        before = quantized.model.layers[1].get_submodule(name)
        after = student.model.layers[1].get_submodule(name)
        assert torch.equal(after.weight_packed, before.weight_packed)
        assert torch.equal(after.weight_scale, before.weight_scale)


def test_progress_reaches_the_log_every_tenth_of_the_steps(caplog):
    """A run's log (and a benchmark's, whose tqdm is off) shows how far a long distillation is and its pace."""
    with caplog.at_level("INFO", logger="compress.stages.distill"):
        _chain([{"type": "rtn", "group_size": 32}, {**DISTILL, "steps": 20, "held_out": 0}], _confident_model())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("distill: step")]
    assert [line.split(",")[0] for line in lines] == [f"distill: step {n}/20" for n in range(2, 21, 2)]
    assert all(" loss " in line and " s/step" in line for line in lines), lines


def test_scale_training_without_a_quantizer_before_it_is_refused_before_any_work():
    with pytest.raises(CompressError, match=r"stages.1 \(distill\) trains what a weight quantizer packs"):
        build_chain([{"type": "magnitude_prune"}, {**DISTILL, "trains": "scales"}])
    build_chain([{"type": "magnitude_prune"}, {**DISTILL, "trains": "weights"}])  # latent weights: a pruner will do


def test_an_unknown_training_target_is_refused():
    with pytest.raises(CompressError, match=r"stages.1 \(distill\): trains must be one of weights, scales"):
        build_chain([{"type": "rtn"}, {**DISTILL, "trains": "codes"}])
    with pytest.raises(CompressError, match=r"scale_steps must be one of absolute, relative"):
        build_chain([{"type": "rtn"}, {**DISTILL, "trains": "scales", "scale_steps": "log"}])


def test_distillation_without_compression_before_it_is_refused():
    with pytest.raises(CompressError, match=r"stages.1 \(distill\) has nothing to heal"):
        build_chain([{"type": "lora_merge", "adapters": ["x"]}, {"type": "distill"}])


def test_the_schedule_fits_the_time_budget_so_the_rate_reaches_zero_inside_it():
    """10 steps in 6 s with a 60 s budget: 100 steps fit, so the cosine decays to zero at step 100, not at the 200
    asked (which a deadline would cut at a rate near its peak)."""
    assert steps_within(60.0, 6.0, 10, 200) == 100
    assert steps_within(600.0, 6.0, 10, 200) == 200  # the budget allows more than asked: as asked
    assert steps_within(1.0, 6.0, 10, 200) == 10  # already past it: stop where it is
    assert steps_within(None, 6.0, 10, 200) == 200
    assert _lr_factor(100, 5, 100) == 0.0 and _lr_factor(50, 5, 200) > 0.8
