"""Pre-flight plan: what a run will need (peak host RAM, accelerator memory, disk, wall time per phase), predicted
before any weight is read, from the model's ``config.json``, its safetensors headers and a short measured probe of this
machine.

The model (``docs/run.md``, "The plan"):
- **RAM**: this process as it stands (interpreter, torch, transformers: measured, not guessed) plus the largest of
  the run's phases. The pipeline streams the model layer by layer in every phase, so a phase holds the parts outside
  the decoder stack, one layer widened to fp32, the activations of every calibration (or evaluation) token at the
  hidden width, and the phase's own working set (an evaluation's logits; in compression, what each stage declares it
  holds: Hessians, autograd, ...).
- **Disk**: the checkpoint as the formats store it (``compress.formats``: codes, scales, zero points), plus what
  stays dense in the save dtype; the run folder is staged next to its final place and renamed, so nothing doubles.
- **Time**: floating-point operations per phase divided by the probe's measured fp32 matmul rate, times an
  efficiency factor per kind of work fitted once on the default model on a 2-core CPU; each stage prices its own
  work per layer (``Stage.layer_seconds``, ``working_bytes``, ``extra_streams``), so no stage is named here.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compress.base.errors import CompressError, EnvironmentFailure
from compress.base.memory import current_rss_mb
from compress.compression.model_free import goes_model_free
from compress.formats import w4a16_linear, w8a8_linear
from compress.grids.int_grid import FP4_GROUP_SIZES
from compress.model.calibration_set import DECODE_BATCHES, SAMPLING_BATCH, generated_windows, spec_for_chain
from compress.stages.base import FORWARD_EFFICIENCY, LayerWork, ModelWork

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I8": 1}
DTYPE_BYTES.update({"U8": 1, "I16": 2, "BOOL": 1})
MB = 2**20
log = logging.getLogger(__name__)
# Reached rate ÷ probe rate of sampling calibration windows from the model: one token per forward pass of a batch.
# Fit on SmolLM2-135M, fp32, 2 CPU cores, 32 windows of 512 decoded together: 99-110 s where the probe's rate gives
# 32 s (benchmarks/results/loop-cache.md; 0.2 before the loop decoded two batches at once over a preallocated cache).
# A forward's and each stage's own are declared with the stages.
SAMPLE_EFFICIENCY = 0.3
# Sampling on a GPU (compress.model.calibration_set): each batched decode step reads every weight once, so a step
# costs the weights' bytes at an effective HBM rate (a third of an H100's 3.35 TB/s peak: small batches, launches,
# sampling).
GPU_SAMPLING_BYTES_PER_SECOND = 1e12
READ_BYTES_PER_SECOND = 200 * MB  # a layer read from its weight file and widened (lazy loading)
HEAD_CHUNK = 128  # positions whose logits exist at once in a perplexity pass (evals/perplexity.py)


class UnreadableHeader(CompressError):
    """A weight file whose safetensors header cannot be read (truncated, not safetensors)."""


@dataclass
class ModelShape:
    """What the plan needs of a model, read from ``config.json`` and the safetensors headers only."""

    layers: int
    hidden: int
    vocab: int
    layer_params: int  # one decoder layer's parameters (all experts)
    outside_params: int  # embeddings, final norm, head (a tied head counted once)
    linears: list[tuple[int, int]]  # (out, in) of one layer's linears, experts one by one, routers excluded
    stored_bytes: int  # the weight files on disk
    other_files_bytes: int  # tokenizer and config files, which the checkpoint copies
    dtype_bytes: int  # the checkpoint's float width

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.outside_params


def read_headers(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """``{tensor name: (dtype, shape)}`` from every ``*.safetensors`` file's header (8-byte length + JSON)."""
    tensors = {}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CompressError(f"{folder}: no *.safetensors files; the plan reads their headers (convert the model first)")
    for file in files:
        try:
            with file.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                if length > file.stat().st_size:
                    raise ValueError("header length beyond the end of the file")
                header = json.loads(handle.read(length))
        except (OSError, ValueError, struct.error) as error:
            raise UnreadableHeader(f"{file}: no readable safetensors header ({error})") from None
        tensors.update({k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return tensors


def model_shape(folder: Path) -> ModelShape:
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    tensors = read_headers(folder)
    routers = (".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".shared_expert_gate.weight")
    layer_params = outside = 0
    linears: list[tuple[int, int]] = []
    widths = {}
    for name, (dtype, shape) in tensors.items():
        count = int(torch.Size(shape).numel())
        widths[dtype] = widths.get(dtype, 0) + count
        if ".layers.0." in name:
            layer_params += count
            if name.endswith("weight") and len(shape) >= 2 and not name.endswith(routers):
                experts = shape[0] if len(shape) == 3 else 1
                linears += [(shape[-2], shape[-1])] * experts
        elif ".layers." not in name:
            outside += count
    float_dtype = max((d for d in widths if d in ("F32", "F16", "BF16")), key=widths.get, default="F32")
    return ModelShape(
        layers=int(config["num_hidden_layers"]),
        hidden=int(config["hidden_size"]),
        vocab=int(config["vocab_size"]),
        layer_params=layer_params,
        outside_params=outside,
        linears=linears,
        stored_bytes=sum(f.stat().st_size for f in folder.glob("*.safetensors")),
        other_files_bytes=sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and f.suffix != ".safetensors"),
        dtype_bytes=DTYPE_BYTES[float_dtype],
    )


@dataclass
class Probe:
    """This machine's fp32 matmul rate now (under whatever else runs on it), measured in a third of a second."""

    gflops: float

    @classmethod
    def measure(cls, size: int = 1024, seconds: float = 0.3) -> Probe:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up: thread pool, allocator
        start, runs = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            a @ b
            runs += 1
        return cls(2 * size**3 * runs / (time.perf_counter() - start) / 1e9)


@dataclass
class Plan:
    model: str
    host_ram_mb: float
    phases_ram_mb: dict[str, float]
    disk_mb: float
    seconds: dict[str, float]
    probe_gflops: float
    accelerator_mb: float | None = None
    notes: list[str] = field(default_factory=list)
    progress_mb: float = 0.0  # the layer walk's progress kept to resume from (compress.model.resume), at its largest

    def lines(self) -> list[str]:
        phases = ", ".join(f"{name} {mb:.0f}" for name, mb in self.phases_ram_mb.items())
        total = sum(self.seconds.values())
        times = ", ".join(f"{name} {s:.0f} s" for name, s in self.seconds.items())
        device = "none (CPU run)" if self.accelerator_mb is None else f"{self.accelerator_mb:.0f} MB"
        return [
            f"plan for {self.model} (probe: {self.probe_gflops:.0f} GFLOP/s fp32 matmul on this machine)",
            f"  peak host RAM {self.host_ram_mb:.0f} MB (largest phase above this process: {phases} MB)",
            f"  peak accelerator memory: {device}",
            f"  disk: {self.disk_mb + self.progress_mb:.0f} MB (checkpoint {self.disk_mb:.0f}, staged in place and "
            f"renamed; progress kept to resume from {self.progress_mb:.0f})",
            f"  wall time ~{total:.0f} s: {times}",
            *(f"  note: {note}" for note in self.notes),
        ]

    def check(self, free_disk_mb: float, available_ram_mb: float) -> None:
        """One line, before any work, when this machine has less disk or RAM than the plan needs."""
        needed = self.disk_mb + self.progress_mb
        if free_disk_mb < needed:
            raise EnvironmentFailure(
                f"plan: the run needs ~{needed:.0f} MB of disk and {free_disk_mb:.0f} MB are free where it writes; "
                "free space, set output.dir elsewhere, resume=false, or plan.enforce=false to try anyway"
            )
        if available_ram_mb < self.host_ram_mb:
            raise EnvironmentFailure(
                f"plan: the run needs ~{self.host_ram_mb:.0f} MB of host RAM and {available_ram_mb:.0f} MB are "
                "available; lower data.num_samples / eval.batch_size, or plan.enforce=false to try anyway"
            )


def linear_bytes(stage_config, out_features: int, in_features: int, dtype_bits: int) -> float:
    """Bytes one quantized linear's weight takes in the checkpoint under a weight quantizer's config."""
    fmt = getattr(stage_config, "format", "int")
    if fmt in FP4_GROUP_SIZES:  # e2m1 pairs in a byte, one 8-bit scale per group
        return out_features * in_features / 2 + out_features * in_features / FP4_GROUP_SIZES[fmt]
    if getattr(stage_config, "strategy", "") == "block":
        return out_features * in_features + (out_features // 128 + 1) * (in_features // 128 + 1) * 4
    bits = getattr(stage_config, "bits", 8)
    group = getattr(stage_config, "group_size", None) or in_features
    if bits == 8 and not hasattr(stage_config, "group_size"):
        return w8a8_linear.stored_bits(out_features, in_features) / 8
    stored = w4a16_linear.stored_bits(out_features, in_features, bits, group, dtype_bits)
    if not getattr(stage_config, "symmetric", True):
        stored += out_features * (in_features // group) * bits
    return stored / 8


def estimate(
    shape: ModelShape, stages: list, config, model_name: str, probe: Probe, eval_tokens: int, accelerated: bool = False
) -> Plan:
    """The plan of ``run`` for a checked ``RunConfig`` ``config`` and its built ``stages``; ``accelerated``: layers
    are calibrated and evaluated on a GPU (the probe then still times the CPU: GPU times are not predicted yet)."""
    fp32 = 4
    data, evaluation = config.data, config.eval
    calibration_tokens = data.num_samples * data.seq_len
    quantizer = next((s for s in stages if s.quantizes_weights), None)
    save_bits = 8 * ({"bfloat16": 2, "float16": 2}.get(config.output.save_dtype or "", shape.dtype_bytes))
    layer_linear_params = sum(o * i for o, i in shape.linears)
    if quantizer is None:
        layer_bytes = shape.layer_params * save_bits / 8
    else:
        packed = sum(linear_bytes(quantizer.config, o, i, save_bits) for o, i in shape.linears)
        layer_bytes = packed + (shape.layer_params - layer_linear_params) * save_bits / 8
    disk = shape.layers * layer_bytes + shape.outside_params * save_bits / 8 + shape.other_files_bytes

    outside = shape.outside_params * fp32  # widened for the whole phase (fp32_compute)
    layer_stored = shape.layer_params * shape.dtype_bytes
    layer32 = shape.layer_params * fp32
    hidden_act = shape.hidden * fp32
    logits = HEAD_CHUNK * shape.vocab * fp32 * 2  # evals/perplexity.py: logits and log-softmax of one chunk
    # Model weights held on the host: a perplexity pass materialises every layer as stored; the layer walk keeps
    # the embeddings and head as stored and each finished layer as compressed (a lazily read 3.6 B bf16 model
    # stayed at 1.7-3.4 GB through compression, benchmarks/results/host-memory-4b.md, while its file is 6.9 GB).
    stored_model = min(shape.stored_bytes, shape.outside_params * shape.dtype_bytes + shape.layers * layer_stored)
    held = {"evaluate": stored_model, "compress": shape.outside_params * shape.dtype_bytes + shape.layers * layer_bytes}
    phases = {}
    if evaluation.perplexity:
        window_batch = evaluation.batch_size * evaluation.seq_len * hidden_act * 8  # a layer's activations
        phases["evaluate"] = held["evaluate"] + outside + layer32 + eval_tokens * hidden_act * 2 + window_batch + logits
    sampled = generated_windows(spec_for_chain(data, stages, config.recipe))  # sampled by the model: all its layers
    rows = min(sampled, SAMPLING_BATCH * DECODE_BATCHES)  # windows decoded together
    if sampled:
        cache = 2 * shape.layers * rows * data.seq_len * shape.hidden * shape.dtype_bytes  # keys and values
        phases["sample"] = shape.params * shape.dtype_bytes + cache + rows * shape.vocab * fp32 * 2
    rate = probe.gflops * 1e9
    work = LayerWork(shape.layer_params, shape.hidden, shape.linears, calibration_tokens, data.seq_len, rate)
    streams = 2 + sum(s.extra_streams() for s in stages)
    working = max((s.working_bytes(work) for s in stages), default=0)
    phases["compress"] = held["compress"] + 2 * layer32 + calibration_tokens * hidden_act * streams + working
    whole = ModelWork(work, shape.layers, shape.params, shape.vocab)  # a whole-model stage runs outside the walk
    trainer = max((s.model_working_bytes(whole) for s in stages), default=0.0)
    phases["compress"] = max(phases["compress"], held["compress"] + trainer)
    model_free = goes_model_free(config, stages)
    if model_free:  # one group of linears (or the embedding) read, widened and quantized
        embedding = shape.vocab * shape.hidden * (shape.dtype_bytes + fp32)
        phases["compress"] = max(2 * work.largest * (shape.dtype_bytes + fp32), embedding)
    host = current_rss_mb() + max(phases.values()) / MB
    # on an accelerator each phase holds the same working set there, less the weights the host keeps (sampling
    # moves the whole model there)
    accelerator = max(v - held.get(k, 0) for k, v in phases.items()) / MB if accelerated else None

    layer_flops = 2 * shape.layer_params + 2 * data.seq_len * shape.hidden  # per token: weights + attention
    token_flops = shape.layers * layer_flops + 2 * shape.hidden * shape.vocab
    seconds = {}
    if evaluation.perplexity:
        passes = 2 + (evaluation.reference == "rtn")
        seconds["evaluate"] = passes * eval_tokens * token_flops / (rate * FORWARD_EFFICIENCY)
    if sampled:  # one token per forward pass of a batch: far below the matmul rate (0 when cached)
        seconds["sample"] = sampled * data.seq_len * token_flops / (rate * SAMPLE_EFFICIENCY)
        if accelerated:  # on the device: bound by reading the weights once per step of a batch
            steps = -(-sampled // rows) * data.seq_len
            seconds["sample"] = steps * shape.params * shape.dtype_bytes / GPU_SAMPLING_BYTES_PER_SECOND
    calibrated = any(stage.needs_calibration for stage in stages)
    walk = calibration_tokens * layer_flops / (rate * FORWARD_EFFICIENCY) if calibrated else 0.0  # the forward
    compress = shape.layers * (walk + shape.layer_params * shape.dtype_bytes / READ_BYTES_PER_SECOND)
    for stage in stages:
        compress += shape.layers * stage.layer_seconds(work) + stage.model_seconds(whole)
    seconds["compress"] = compress
    seconds["save"] = disk / (200 * MB)  # writing the checkpoint: ~200 MB/s including serialization
    notes = []
    if sampled and seconds["sample"] > sum(seconds.values()) / 2:
        notes.append(
            f"sampling {sampled} calibration windows of {data.seq_len} tokens is most of the run "
            f"(~{seconds['sample']:.0f} s): data.generated=0 or data=<your text> calibrates on text instead"
        )
    if not evaluation.perplexity:
        notes.append("no evaluation (eval.perplexity=false)")
    phases_mb = {k: v / MB for k, v in phases.items()}
    progress = 0.0
    if model_free:
        notes.append("model-free: quantized from the safetensors files, no model built")
    elif config.resume:  # every finished layer as the walk holds it, and each rank's last two cursors of inputs
        progress = shape.layers * layer_bytes + 2 * calibration_tokens * hidden_act * (streams - 1) * calibrated
    return Plan(model_name, host, phases_mb, disk / MB, seconds, probe.gflops, accelerator, notes, progress / MB)


def plan_for(config, stages: list, model_folder: Path) -> Plan:
    """The plan of ``run`` for the checked ``config``: reads the model's config and headers, loads its tokenizer to
    count the evaluation tokens (no weights), and measures the probe."""
    from compress.base.data import load_corpus, tokenize
    from compress.base.distributed import select_device
    from compress.checkpoint.loading import load_tokenizer

    shape = model_shape(model_folder)
    eval_tokens = 0
    if config.eval.perplexity:
        tokenizer = load_tokenizer(model_folder, config.model.trust_remote_code)
        texts = [load_corpus(config.data).evaluation]
        if config.eval.data is not None:
            texts.append(load_corpus(config.eval.data).evaluation)
        cap = None if config.eval.max_windows is None else config.eval.max_windows * config.eval.seq_len
        for text in texts:
            count = int(tokenize(tokenizer, "\n\n".join(text)).numel())
            eval_tokens += count if cap is None else min(count, cap)
    accelerated = select_device(config.device).type != "cpu"
    plan = estimate(shape, stages, config, config.model.path, Probe.measure(), eval_tokens, accelerated)
    if accelerated:
        plan.notes.append("times but sampling's are for this machine's CPU; on the accelerator not predicted yet")
    return plan


def preflight(config, stages: list, runs_dir: Path) -> Plan | None:
    """Print the run's plan (``compress.app.preflight``) and, with ``plan.enforce``, refuse in one line when this
    machine has less free disk or available RAM than it predicts; None (nothing printed) for a model that is not a local
    folder, whose headers cannot be read before the load."""
    from compress.model.sources import local_model_folder

    folder = local_model_folder(config.model)
    if folder is None or not any(folder.glob("*.safetensors")):
        log.info(
            "plan: skipped (the model is not on this machine yet: a hub id, or the default model before its "
            "one-time conversion)"
        )
        return None
    try:
        plan = plan_for(config, stages, folder)
    except UnreadableHeader as error:  # the loader says what is wrong with the files, in its own words
        log.warning("plan: skipped (%s)", error)
        return None
    log.info("\n".join(plan.lines()))
    if config.plan.enforce:
        plan.check(free_disk_mb(runs_dir), available_ram_mb())
    return plan


def free_disk_mb(path: Path) -> float:
    """Free space on the file system that will hold ``path`` (its nearest existing parent)."""
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free / MB


def available_ram_mb() -> float:
    """What the kernel says a new allocation can get without swapping (``MemAvailable``), or no limit."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("inf")
