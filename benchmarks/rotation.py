"""Does the rotation stage make 4-bit weights less lossy on the default model? Perplexity of RTN (and optionally
GPTQ) int4 g64 with and without ``rotate`` in front, every checkpoint made by ``compress.oneshot`` and scored as
reloaded from disk on the same evaluation windows, against the baseline measured in the same run; then why RTN
loses: the residual channels with massive activations, and the output error of each reader of the stream.

    python -m benchmarks.rotation                                      # RTN, 16 evaluation windows of 512 tokens
    python -m benchmarks.rotation --gptq --num-samples 32 --windows 16  # GPTQ recipes too (minutes per run on a CPU)
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch

from compress import oneshot
from compress.base.data import DataSpec, calibration_samples, load_corpus, tokenize
from compress.checkpoint import load_checkpoint
from compress.compression.in_memory import compress_model
from compress.evals.perplexity import perplexity
from compress.grids.int_grid import WeightScheme, fake_quantize
from compress.model.sources import default_model_dir, load

RESULTS = Path(__file__).parent / "results"
INT4 = {"bits": 4, "group_size": 64, "symmetric": True, "ignore": ["lm_head"]}
READERS = {  # one linear per position in a decoder layer: what it reads
    "self_attn.q_proj": "input_layernorm",
    "mlp.gate_proj": "post_attention_layernorm",
    "self_attn.o_proj": "attention output",
    "mlp.down_proj": "MLP activation",
}
DIAGNOSIS_SAMPLES = 4  # calibration windows of 512 tokens for the activation statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=16, help="evaluation windows of 512 tokens")
    parser.add_argument("--gptq", action="store_true", help="also the GPTQ recipes (minutes per run on a CPU)")
    parser.add_argument("--num-samples", type=int, default=64, help="calibration windows of 512 tokens (GPTQ)")
    args = parser.parse_args()
    model_dir = default_model_dir()
    model, tokenizer = load(model_dir, lazy=False)
    corpus = load_corpus(DataSpec())
    eval_ids = tokenize(tokenizer, corpus.evaluation_text)
    diagnosis = diagnose(
        model, calibration_samples(tokenize(tokenizer, corpus.calibration_text), DIAGNOSIS_SAMPLES, 512, 0)
    )

    def ppl(candidate, label: str) -> float:
        return perplexity(candidate, eval_ids, 512, 4, args.windows, label=label).perplexity

    rows = {"baseline": {"ppl": ppl(model, "baseline"), "seconds": 0.0}}
    del model
    calibration = [f"data.num_samples={args.num_samples}"]
    runs = {"rtn": ([{"type": "rtn", **INT4}], []), "rotate+rtn": ([{"type": "rotate"}, {"type": "rtn", **INT4}], [])}
    if args.gptq:
        runs |= {
            "gptq (gptq_int4)": ("gptq_int4", calibration),
            "gptq act_order": ("gptq_int4", [*calibration, "stages.0.act_order=true"]),
            "rotate+gptq (rotate_gptq_int4)": ("rotate_gptq_int4", calibration),
            "rotate+gptq without act_order": ("rotate_gptq_int4", [*calibration, "stages.1.act_order=false"]),
        }
    with tempfile.TemporaryDirectory(prefix="rotation-") as workdir:
        for index, (label, (recipe, overrides)) in enumerate(runs.items()):
            start = time.perf_counter()
            output = Path(workdir) / str(index)
            checkpoint = oneshot(str(model_dir), recipe, output_dir=output, overrides=overrides, device="cpu")
            seconds = time.perf_counter() - start
            candidate, _ = load_checkpoint(checkpoint)
            rows[label] = {"ppl": ppl(candidate, label), "seconds": seconds}
            print(label, rows[label], flush=True)
    write_results(args, model_dir.name, rows, diagnosis)


@torch.no_grad()
def diagnose(model: torch.nn.Module, samples: torch.Tensor) -> dict:
    """The residual stream's largest channels (and the scale each layer's post-attention norm gives them), and per
    reader of the stream the relative output error ‖X ΔWᵀ‖² / ‖X Wᵀ‖² of RTN int4 g64 on the same tokens, mean over
    the layers, before and after rotation."""
    states = model(samples, output_hidden_states=True).hidden_states[1:-1]  # the stream between decoder layers
    channel_max = torch.stack([state.abs().flatten(0, 1).amax(0) for state in states])  # [layers, hidden]
    median = channel_max.median(1).values
    top = channel_max.amax(0).topk(4).indices.tolist()
    norms = torch.stack([layer.post_attention_layernorm.weight.abs() for layer in model.model.layers])
    channels = {
        str(c): {
            "max_abs": float(channel_max[:, c].max()),
            "max_over_median_channel": float((channel_max[:, c] / median).max()),
            "post_attention_norm_scale": float(norms[:, c].median()),
        }
        for c in top
    }
    unrotated = _reader_errors(model, samples)
    rotated_model = copy.deepcopy(model)
    compress_model(rotated_model, [{"type": "rotate"}], samples)
    rotated = _reader_errors(rotated_model, samples)
    readers = {
        name: {
            "unrotated": sum(unrotated[name]) / len(unrotated[name]),
            "rotated": sum(rotated[name]) / len(rotated[name]),
            "worst_layer": max(range(len(rotated[name])), key=lambda i: rotated[name][i] / unrotated[name][i]),
            "worst_ratio": max(r / u for r, u in zip(rotated[name], unrotated[name], strict=True)),
        }
        for name in READERS
    }
    return {
        "median_norm_scale": float(norms.median()),
        "median_channel_max": float(median.median()),
        "channels": channels,
        "readers": readers,
    }


def _reader_errors(model: torch.nn.Module, samples: torch.Tensor) -> dict[str, list[float]]:
    """Per reader name, per layer: the RTN int4 g64 output error relative to the output, on ``samples``."""
    scheme = WeightScheme(4, 64, True)
    errors: dict[str, list[float]] = {name: [] for name in READERS}
    hooks = []
    for layer in model.model.layers:
        for name in READERS:
            linear = layer.get_submodule(name)
            delta = fake_quantize(linear.weight, scheme) - linear.weight

            def hook(_module, args, output, name=name, delta=delta):
                errors[name].append(float((args[0] @ delta.T).pow(2).sum() / output.pow(2).sum()))

            hooks.append(linear.register_forward_hook(hook))
    model(samples)
    for hook in hooks:
        hook.remove()
    return errors


def write_results(args: argparse.Namespace, model_name: str, rows: dict, diagnosis: dict) -> None:
    base = rows["baseline"]["ppl"]
    command = f"python -m benchmarks.rotation{' --gptq' if args.gptq else ''} --num-samples {args.num_samples}"
    lines = [
        f"# Rotation before int4 g64 on `{model_name}` ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command} --windows {args.windows}`: {args.windows} evaluation windows of 512 tokens (pydoc evaluation "
        f"split); GPTQ rows run the recipes with {args.num_samples} x 512 calibration tokens (RTN needs none); "
        "checkpoints reloaded from disk; 2-core CPU shared with other jobs (seconds are noisy).",
        "",
        "| model | perplexity | increase over baseline | oneshot seconds |",
        "|---|---|---|---|",
        *(
            f"| {k} | {r['ppl']:.3f} | {100 * (r['ppl'] / base - 1):+.1f}% | {r['seconds']:.0f} |"
            for k, r in rows.items()
        ),
        "",
        f"## Why rotation hurts RTN ({DIAGNOSIS_SAMPLES} calibration windows)",
        "",
        f"Largest residual-stream channels (inputs of decoder layers 1–29; the median channel's max is "
        f"{diagnosis['median_channel_max']:.1f}; the median |post-attention norm scale| is "
        f"{diagnosis['median_norm_scale']:.3f}):",
        "",
        "| channel | max abs | max / median channel (worst layer) | median post-attention norm scale |",
        "|---|---|---|---|",
        *(
            f"| {c} | {s['max_abs']:.0f} | {s['max_over_median_channel']:.0f}x | {s['post_attention_norm_scale']:.4f} |"
            for c, s in diagnosis["channels"].items()
        ),
        "",
        "RTN int4 g64 output error ‖XΔWᵀ‖²/‖XWᵀ‖² of each reader, mean over the 30 layers:",
        "",
        "| linear (reads) | unrotated | rotated | worst layer (rotated / unrotated) |",
        "|---|---|---|---|",
        *(
            f"| {name} ({READERS[name]}) | {r['unrotated']:.4f} | {r['rotated']:.4f} | "
            f"{r['worst_layer']} ({r['worst_ratio']:.1f}x) |"
            for name, r in diagnosis["readers"].items()
        ),
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rotation.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "rotation.json").write_text(json.dumps({"rows": rows, "diagnosis": diagnosis}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
