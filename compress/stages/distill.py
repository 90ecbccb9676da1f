"""Knowledge distillation: the model as it was before compression teaches the compressed student.

The teacher is a copy of the model taken just before the chain's first pruning or quantizing stage (after any LoRA
merge, so it is the fine-tuned model). The student's decoder linears learn, for a bounded number of steps and wall
time, to match the teacher's softened next-token distribution on the calibration corpus — KL(teacher ‖ student) at
temperature T, scaled by T² so gradients keep their size — plus, optionally, the mean squared error of every decoder
layer's hidden state (normalised by the teacher's). Embeddings, norms and the head stay frozen.

Compression survives training. ``trains: weights`` (the default): pruned weights are multiplied by their mask after
every optimizer step, and a quantized student trains a latent float weight through fake quantization with a
straight-through estimator against its *fixed* scales and zero points, so at the end it rounds back to codes on the
same grid and exports as before. ``trains: scales`` is EfficientQAT's end-to-end stage (E2E-QP, Chen et al. 2024):
every code stays as the quantizer chose it (pruned zeros included) and only the per-group scales of the quantized
linears learn — about one parameter per group, so a few thousand calibration tokens cannot overfit the weights, and
the checkpoint keeps its layout and size. Plain linears stay frozen then. ``scale_steps: relative`` (not
EfficientQAT's) trains each scale as a factor on its start, so ``learning_rate`` is a share of the scale and one rate
fits models whose weights differ in size; ``absolute`` (the default, EfficientQAT's) trains the scale itself.

Training is kept only if it pays: the KL on held-out calibration sequences (never trained on) must fall, else the
student leaves the stage as it came in, with a warning — a rate too high for the model cannot make it worse.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from compress.base.errors import CompressError
from compress.formats import QuantizedLinear
from compress.grids.sparsity import mask_of
from compress.kernels.dequant import group_index
from compress.model.layer_walk import decoder_layers
from compress.stages.base import FP32_BYTES, LayerWork, ModelWork, Stage
from compress.stages.weights import replace_module

log = logging.getLogger(__name__)


TRAINS = ("weights", "scales")
SCALE_STEPS = ("absolute", "relative")


@dataclass
class DistillConfig:
    steps: int = 200  # optimizer steps
    max_minutes: float | None = 15.0  # wall-time budget: the steps (and their decay) shrink to fit it
    learning_rate: float = 1e-4  # AdamW's peak rate: linear warm-up, then cosine decay to zero
    warmup_steps: int = 5  # steps of linear warm-up
    temperature: float = 2.0  # softens both next-token distributions before their KL (scaled back by T²)
    hidden_weight: float = 0.0  # weight of the per-layer hidden-state MSE next to the logit KL
    batch_size: int = 2  # sequences per step
    seq_len: int = 256  # calibration samples are cut into sequences of this length
    held_out: int = 4  # sequences kept out of training: the KL before and after, and the check that keeps it
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~30% more time
    trains: str = "weights"  # weights: latent weights through the fixed grid; scales: the codes fixed, group scales
    scale_steps: str = "absolute"  # trains: scales: absolute (EfficientQAT: lr in scale units); relative: lr a share

    def __post_init__(self):
        if self.trains not in TRAINS:
            raise ValueError(f"trains must be one of {', '.join(TRAINS)}, not {self.trains!r}")
        if self.scale_steps not in SCALE_STEPS:
            raise ValueError(f"scale_steps must be one of {', '.join(SCALE_STEPS)}, not {self.scale_steps!r}")
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 2:
            raise ValueError("steps and batch_size must be ≥ 1 and seq_len ≥ 2")
        if self.temperature <= 0 or self.learning_rate <= 0:
            raise ValueError("temperature and learning_rate must be positive")
        if self.hidden_weight < 0 or self.held_out < 0:
            raise ValueError("hidden_weight and held_out must be ≥ 0")


class FakeQuantLinear(nn.Module):
    """A ``QuantizedLinear`` made trainable: a latent float weight, rounded to the layer's fixed grid in the forward
    pass and passed straight through in the backward pass (STE)."""

    def __init__(self, source: QuantizedLinear):
        super().__init__()
        self.source = [source]  # a list: not a submodule, so its buffers are neither trained nor moved twice
        weight = source.dequantized_weight().float()
        group_of = group_index(source.in_features, source.group_size, source.weight_g_idx, weight.device)
        self.register_buffer("scale", source.weight_scale.float()[:, group_of])
        zero = source.weight_zero_point
        self.register_buffer("zero", torch.zeros_like(self.scale) if zero is None else zero.float()[:, group_of])
        self.weight = nn.Parameter(weight)
        self.bias = None if source.bias is None else nn.Parameter(source.bias.data.float(), requires_grad=False)
        self.qmin, self.qmax = -(1 << (source.num_bits - 1)), (1 << (source.num_bits - 1)) - 1

    def codes(self) -> torch.Tensor:
        return (torch.round(self.weight / self.scale) + self.zero).clamp(self.qmin, self.qmax)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rounded = (self.codes() - self.zero) * self.scale
        weight = self.weight + (rounded - self.weight).detach()
        return F.linear(x, weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    @torch.no_grad()
    def to_quantized(self) -> QuantizedLinear:
        return _on_grid_of(self.source[0], self.codes(), self.source[0].weight_scale)


class ScaleTrainedLinear(nn.Module):
    """A ``QuantizedLinear`` whose codes are frozen and whose per-group scales train: ``W = (q − z)·u·p`` is
    differentiable in ``p``, so no straight-through estimate is needed and the codes cannot move. ``relative``:
    ``u`` is the start scale and ``p`` a factor from 1, so an optimizer step moves every scale by the same share of
    itself, whatever its size; else ``u = 1`` and ``p`` is the scale itself (EfficientQAT), whose steps are absolute."""

    def __init__(self, source: QuantizedLinear, relative: bool = False):
        super().__init__()
        self.source = [source]
        weight = source.dequantized_weight().float()
        self.register_buffer(
            "group_of", group_index(source.in_features, source.group_size, source.weight_g_idx, weight.device)
        )
        zero = source.weight_zero_point
        scale = source.weight_scale.float().clone()
        self.register_buffer("zero", torch.zeros_like(scale) if zero is None else zero.float())
        expanded = scale[:, self.group_of]
        self.register_buffer("frozen_codes", torch.round(weight / expanded) + self.zero[:, self.group_of])
        self.register_buffer("unit", scale if relative else torch.ones_like(scale))
        self.scale_factor = nn.Parameter(torch.ones_like(scale) if relative else scale)  # scale: a copy already
        self.bias = None if source.bias is None else nn.Parameter(source.bias.data.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.unit * self.scale_factor
        weight = (self.frozen_codes - self.zero[:, self.group_of]) * scale[:, self.group_of]
        return F.linear(x, weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    @torch.no_grad()
    def to_quantized(self) -> QuantizedLinear:
        return _on_grid_of(self.source[0], self.frozen_codes, self.unit * self.scale_factor)


def _on_grid_of(source: QuantizedLinear, codes: torch.Tensor, scale: torch.Tensor) -> QuantizedLinear:
    """A packed layer like ``source`` (bits, groups, zero points, order, bias) with these codes and scales."""

    def host(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.detach().cpu()

    return QuantizedLinear.from_codes(
        codes.detach().to(torch.int8).cpu(),
        scale.detach().to(source.weight_scale.dtype).cpu(),
        host(source.weight_zero_point),
        source.num_bits,
        source.group_size,
        None if source.bias is None else host(source.bias.data),
        host(source.weight_g_idx),
    )


def distillation_loss(student_out, teacher_out, temperature: float, hidden_weight: float) -> dict[str, torch.Tensor]:
    """``{"loss", "kl", "hidden_mse"}``: T²·KL(teacher ‖ student) per token (+ weighted hidden-state MSE)."""
    vocab = student_out.logits.shape[-1]
    student = F.log_softmax(student_out.logits.float().reshape(-1, vocab) / temperature, -1)
    teacher = F.log_softmax(teacher_out.logits.float().reshape(-1, vocab) / temperature, -1)
    kl = F.kl_div(student, teacher, log_target=True, reduction="batchmean") * temperature**2
    parts = {"kl": kl, "loss": kl}
    if hidden_weight > 0:
        pairs = list(zip(student_out.hidden_states[1:], teacher_out.hidden_states[1:], strict=True))
        mse = sum(F.mse_loss(s.float(), t.float()) / t.float().pow(2).mean().clamp(min=1e-12) for s, t in pairs)
        parts["hidden_mse"] = mse / len(pairs)
        parts["loss"] = kl + hidden_weight * parts["hidden_mse"]
    return parts


@torch.no_grad()
def mean_kl(
    student: nn.Module, teacher: nn.Module, sequences: torch.Tensor, batch_size: int, temperature: float = 1.0
) -> float:
    """KL(teacher ‖ student) per token on ``sequences``: what distillation lowers."""
    total, count = 0.0, 0
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start : start + batch_size]
        kl = distillation_loss(student(input_ids=batch), teacher(input_ids=batch), temperature, 0.0)["kl"]
        total += float(kl) * batch.numel()
        count += batch.numel()
    return total / max(count, 1)


class DistillStage(Stage):
    name = "distill"
    Config = DistillConfig
    layerwise = False
    heals = True

    def __init__(self, config):
        super().__init__(config)
        self.teacher: nn.Module | None = None

    @property
    def needs_quantized_weights(self) -> bool:
        """Scale training keeps a weight quantizer's codes: without one before it, it has nothing to train."""
        return self.config.trains == "scales"

    def layer_seconds(self, work: LayerWork) -> float:
        return 0.0  # no per-layer work: model_seconds prices the training

    def model_seconds(self, work: ModelWork) -> float:
        """Each step a teacher forward, a student forward and its backward (~2 forwards), up to the time budget;
        the held-out KL before and after (teacher and student each time)."""
        c = self.config
        training = c.steps * 4 * work.forward_seconds(c.batch_size * c.seq_len)
        if c.max_minutes is not None:
            training = min(training, 60 * c.max_minutes)
        return training + 4 * work.forward_seconds(c.held_out * c.seq_len)

    def model_working_bytes(self, work: ModelWork) -> float:
        """The teacher and the student in fp32 (trained linears widen their codes for the step), a step's
        activations for the backward and the teacher's logits, and AdamW's gradient and two moments of what
        trains, plus its start kept to fall back on where a held-out check may undo the training: every decoder
        linear's weights, or one scale per group (fewer than 1 in 32 weights)."""
        c = self.config
        tokens = c.batch_size * c.seq_len
        trained = work.linear_params if c.trains == "weights" else work.linear_params / 32
        copies = 4 if c.held_out else 3  # AdamW's gradient and two moments, and the start
        models = 2 * work.params * FP32_BYTES
        logits = 2 * tokens * work.vocab * FP32_BYTES
        return models + work.backward_bytes(tokens) + logits + copies * trained * FP32_BYTES

    def before_stage(self, model: nn.Module, position: int) -> None:
        if position == self.teacher_position:
            self.teacher = copy.deepcopy(model).eval().requires_grad_(False)

    def prepare(self, model: nn.Module) -> None:
        self.summary: dict = {}

    def process_model(self, model: nn.Module, samples: torch.Tensor, device: torch.device) -> None:
        if self.teacher is None:
            raise CompressError("distill has no teacher: it must come after a pruning or quantizing stage")
        c = self.config
        sequences = _cut(samples, c.seq_len)
        if len(sequences) <= c.held_out:
            raise CompressError(
                f"distill: {len(sequences)} calibration sequences of {c.seq_len} tokens leave none for training after "
                f"{c.held_out} held out; raise data.num_samples or lower distill seq_len/held_out"
            )
        held_out, train = sequences[: c.held_out].to(device), sequences[c.held_out :]
        teacher = self.teacher.to(device)
        fake_quant = _make_trainable(model, c.trains, relative=c.scale_steps == "relative")
        model.to(device)
        trainable = _trainable_linears(model, c.trains)
        params = [_trained_parameter(module) for module in trainable.values()]
        masks = {  # trained scales multiply frozen codes: their zeros stay zero
            name: mask_of(module)
            for name, module in trainable.items()
            if mask_of(module) is not None and c.trains == "weights"
        }
        model.requires_grad_(False)
        for param in params:
            param.requires_grad_(True)
        start_values = [param.detach().to("cpu", copy=True) for param in params] if c.held_out else []  # the undo's
        kl_before = mean_kl(model, teacher, held_out, c.batch_size) if c.held_out else None
        optimizer = torch.optim.AdamW(params, lr=c.learning_rate, weight_decay=0.0)
        planned = {"steps": c.steps}  # shrinks to what the time budget allows, so the decay ends inside it
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: _lr_factor(step, c.warmup_steps, planned["steps"])
        )
        if c.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        generator = torch.Generator().manual_seed(0)
        order = torch.randperm(len(train), generator=generator)
        budget = None if c.max_minutes is None else 60 * c.max_minutes
        deadline = None if budget is None else time.perf_counter() + budget
        start, losses, step = time.perf_counter(), [], 0
        try:
            progress = tqdm(range(c.steps), desc="distill", unit="step")
            for step in progress:
                if step >= planned["steps"]:
                    break
                picks = [order[(step * c.batch_size + k) % len(order)].item() for k in range(c.batch_size)]
                batch = train[picks].to(device)
                with torch.no_grad():
                    teacher_out = teacher(input_ids=batch, output_hidden_states=c.hidden_weight > 0, use_cache=False)
                student_out = model(input_ids=batch, output_hidden_states=c.hidden_weight > 0, use_cache=False)
                parts = distillation_loss(student_out, teacher_out, c.temperature, c.hidden_weight)
                if not torch.isfinite(parts["loss"]):
                    raise CompressError(
                        f"distill: loss became {parts['loss'].item()} at step {step}; lower learning_rate"
                    )
                optimizer.zero_grad(set_to_none=True)
                parts["loss"].backward()
                optimizer.step()
                schedule.step()
                with torch.no_grad():
                    for name, keep in masks.items():
                        trainable[name].weight.mul_(keep.to(trainable[name].weight.dtype))
                values = {f"distill_{k}": float(v.detach()) for k, v in parts.items()}
                losses.append(values["distill_loss"])
                progress.set_postfix(loss=f"{losses[-1]:.4f}")
                if self.metrics_sink is not None:
                    self.metrics_sink({**values, "distill_lr": schedule.get_last_lr()[0]}, step)
                planned["steps"] = steps_within(budget, time.perf_counter() - start, step + 1, c.steps)
                if (step + 1) % max(1, c.steps // 10) == 0:  # the log keeps what a disabled or cleared bar does not
                    pace = (time.perf_counter() - start) / (step + 1)
                    shown = (step + 1, planned["steps"], losses[-1], pace)
                    log.info("distill: step %d/%d, loss %.4f, %.1f s/step", *shown)
                if deadline is not None and time.perf_counter() > deadline:
                    log.info("distill: %.1f-minute budget reached after %d steps", c.max_minutes, step + 1)
                    break
        finally:
            model.eval()
            if c.gradient_checkpointing:
                model.gradient_checkpointing_disable()
            model.requires_grad_(False)
        kl_trained = mean_kl(model, teacher, held_out, c.batch_size) if c.held_out else None
        kept, kl_after = "trained", kl_trained
        if kl_trained is not None and not kl_trained < kl_before:  # worse than no training: undo it
            with torch.no_grad():
                for param, value in zip(params, start_values, strict=True):
                    param.copy_(value)
            kept, kl_after = "start", kl_before
            log.warning(
                "distill: held-out KL rose from %.4f to %.4f over %d steps, so the student keeps its weights from "
                "before the stage; lower learning_rate",
                kl_before,
                kl_trained,
                len(losses),
            )
        _restore_quantized(model, fake_quant)
        model.to("cpu")
        self.teacher = None  # free it: the teacher is as large as the student
        self.summary = {
            "steps": len(losses),
            "steps_asked": c.steps,
            "seconds": time.perf_counter() - start,
            "train_sequences": len(train),
            "seq_len": c.seq_len,
            "first_loss": losses[0],
            "last_loss": sum(losses[-10:]) / len(losses[-10:]),
            "held_out_kl_before": kl_before,
            "held_out_kl_after": kl_after,
            "held_out_kl_trained": kl_trained,
            "kept": kept,
            "trains": c.trains,
            "trained_linears": len(params),
            "fake_quantized_linears": len(fake_quant),
        }

    def finalize(self, model: nn.Module) -> dict:
        return self.summary


def _cut(samples: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Calibration samples ``[n, L]`` → ``[n·⌊L/seq_len⌋, seq_len]``."""
    per_sample = samples.shape[1] // seq_len
    if per_sample == 0:
        raise CompressError(f"distill seq_len={seq_len} is longer than the calibration samples ({samples.shape[1]})")
    return samples[:, : per_sample * seq_len].reshape(-1, seq_len)


def steps_within(budget_s: float | None, elapsed_s: float, done: int, steps: int) -> int:
    """The steps that fit ``budget_s`` at the pace of the ``done`` steps so far (never fewer than done, never more
    than ``steps``): the cosine schedule then decays to zero as the budget runs out instead of being cut mid-way at
    a high learning rate, which leaves a quantized student's latent weights in the middle of a rounding flip."""
    if budget_s is None or done == 0 or elapsed_s <= 0:
        return steps
    return max(done, min(steps, int(budget_s * done / elapsed_s)))


def _lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to zero at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def _trainable_linears(model: nn.Module, trains: str) -> dict[str, nn.Module]:
    kinds = (ScaleTrainedLinear,) if trains == "scales" else (nn.Linear, FakeQuantLinear)
    return {
        f"model.layers.{index}.{name}": module
        for index, layer in enumerate(decoder_layers(model))
        for name, module in layer.named_modules()
        if type(module) in kinds
    }


def _trained_parameter(module: nn.Module) -> nn.Parameter:
    return module.scale_factor if isinstance(module, ScaleTrainedLinear) else module.weight


def _make_trainable(model: nn.Module, trains: str, relative: bool) -> list[str]:
    """Swap every packed quantized linear for a ``FakeQuantLinear`` (or, training scales, a ``ScaleTrainedLinear``,
    whose frozen codes already hold any mask); returns their names."""
    swapped = []
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantizedLinear):
            if trains == "scales":
                replace_module(model, name, ScaleTrainedLinear(module, relative), enforce_mask=False)
            else:
                replace_module(model, name, FakeQuantLinear(module))  # carries the sparsity mask
            swapped.append(name)
        elif hasattr(module, "dequantized_weight") and not isinstance(module, (FakeQuantLinear, ScaleTrainedLinear)):
            raise CompressError(
                f"distill cannot train {name} ({type(module).__name__}); put distill before that quantizer"
            )
    if trains == "scales" and not swapped:  # a quantizer came first (build_chain checks) but packed nothing here
        raise CompressError(
            "distill trains=scales found no int4/int3 quantized linear to train (fp8/int8 layers keep no group "
            "scales, and ignore: may have left every linear dense); use trains=weights"
        )
    return swapped


def _restore_quantized(model: nn.Module, names: list[str]) -> None:
    """Round every ``FakeQuantLinear`` back to codes on its original grid."""
    for name in names:
        replace_module(model, name, model.get_submodule(name).to_quantized())
