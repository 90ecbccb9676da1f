"""One llm-compressor compression of a model on given calibration token ids; run inside the peer venv
(``artifacts/peer-venv``, llm-compressor pins its own transformers), driven by ``benchmarks/peer_comparison.py``.

Writes the compressed checkpoint (``save_compressed=True``) to ``--output``, and beside it the ``calibration.json``
our checkpoints carry (the windows' digest, so a pair with our run of the same seed is known to share its ids), and
nothing else, so the driver's wall time and peak RSS of this process are the toolkit's cost: model load,
calibration, quantization, save.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from compress.base.data import CALIBRATION_FILE, calibration_json


def int_weights(bits: int, observer: str = "minmax") -> dict:
    """Integer weights, group 64 symmetric, 16-bit activations: our recipes' scheme on the default model. The
    ``mse`` observer searches each group's range (shrinking it by up to 20% on a grid of 100) for the least
    quantization error, the peer's counterpart of our GPTQ's clipping search; ``minmax``, its default, does not."""
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
    return {"group_0": {"targets": ["Linear"], "weights": {**weights, "observer": observer}}}


W4A16_G64 = int_weights(4)


FP4_PRESETS = {"nvfp4a16": "NVFP4A16", "nvfp4": "NVFP4", "mxfp4": "MXFP4"}


def recipe(scheme: str, alpha: float) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if scheme == "rtn_w4a16":
        return [QuantizationModifier(config_groups=W4A16_G64, ignore=["lm_head"])]
    if scheme == "gptq_w4a16":
        return [GPTQModifier(config_groups=W4A16_G64, ignore=["lm_head"])]
    if scheme == "gptq_w4a16_mse":  # like for like with our clipping search
        return [GPTQModifier(config_groups=int_weights(4, "mse"), ignore=["lm_head"])]
    if scheme in ("gptq_w3a16", "gptq_w3a16_mse"):  # `_mse`: like for like with gptq_int3's clipping search
        observer = "mse" if scheme.endswith("_mse") else "minmax"
        return [GPTQModifier(config_groups=int_weights(3, observer), ignore=["lm_head"])]
    if scheme == "awq_w4a16":
        from llmcompressor.modifiers.transform.awq import AWQModifier

        # In llm-compressor 0.14 AWQ only searches and applies scales; the quantizer that follows sets the scheme.
        return [AWQModifier(duo_scaling=True), QuantizationModifier(config_groups=W4A16_G64, ignore=["lm_head"])]
    # AWQ's scales, then GPTQ rounds the scaled weights: the chain awq_int4 runs; `_mse` is like for like, its
    # rounding searching clipping as ours does
    if scheme in ("awq_gptq_w4a16", "awq_gptq_w4a16_mse"):
        from llmcompressor.modifiers.transform.awq import AWQModifier

        observer = "mse" if scheme.endswith("_mse") else "minmax"
        return [AWQModifier(duo_scaling=True), GPTQModifier(config_groups=int_weights(4, observer), ignore=["lm_head"])]
    if scheme == "smoothquant_w8a8":
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        return [
            SmoothQuantModifier(smoothing_strength=alpha),
            GPTQModifier(scheme="W8A8", targets="Linear", ignore=["lm_head"]),
        ]
    if scheme == "sparsegpt_2of4":
        from llmcompressor.modifiers.pruning import SparseGPTModifier

        return [SparseGPTModifier(sparsity=0.5, mask_structure="2:4", targets=["Linear"], ignore=["lm_head"])]
    if scheme == "fp8_dynamic":
        return [QuantizationModifier(scheme="FP8_DYNAMIC", targets="Linear", ignore=["lm_head"])]
    if scheme == "fp8_block":  # no calibration: the preset as llm-compressor's FP8_BLOCK example runs it
        return [QuantizationModifier(scheme="FP8_BLOCK", targets="Linear", ignore=["lm_head"])]
    if scheme in FP4_PRESETS:  # GPTQ onto the FP4 grid, as our recipes of the same names
        return [GPTQModifier(scheme=FP4_PRESETS[scheme], targets="Linear", ignore=["lm_head"])]
    if scheme == "spinquant_gptq_w4a16":
        from llmcompressor.modifiers.transform import SpinQuantModifier

        return [  # random-hadamard (random signs, as ours): "hadamard" is 2^n only and refuses a 576-wide stream
            SpinQuantModifier(rotations=["R1", "R2"], transform_type="random-hadamard"),
            GPTQModifier(config_groups=W4A16_G64, ignore=["lm_head"]),
        ]
    raise SystemExit(f"unknown scheme {scheme}")


def allow_cpu_only_awq() -> None:
    """llm-compressor 0.14's AWQ pins its cached block inputs before each scale search, which raises without a CUDA
    driver. Pinning only speeds host-to-device copies, so on a CPU-only machine it is skipped: the search, its
    inputs and its results are unchanged."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


def write_calibration(output: Path, samples: torch.Tensor) -> None:
    """The checkpoint's ``calibration.json``, as ``compress.compression.saving`` writes ours."""
    (output / CALIBRATION_FILE).write_text(calibration_json(samples))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scheme", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--samples", required=True, help="torch file holding an int64 [N, L] tensor of token ids")
    parser.add_argument("--output", required=True)
    parser.add_argument("--alpha", type=float, default=0.5)
    args = parser.parse_args()

    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not torch.cuda.is_available():
        allow_cpu_only_awq()
    samples = torch.load(args.samples, weights_only=True)
    dataset = Dataset.from_dict({"input_ids": samples.tolist(), "attention_mask": torch.ones_like(samples).tolist()})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    oneshot(
        model=model,
        dataset=dataset,
        recipe=recipe(args.scheme, args.alpha),
        max_seq_length=samples.shape[1],
        num_calibration_samples=len(samples),
        shuffle_calibration_samples=False,
    )
    model.save_pretrained(Path(args.output), save_compressed=True)
    tokenizer.save_pretrained(Path(args.output))
    write_calibration(Path(args.output), samples)


if __name__ == "__main__":
    main()
