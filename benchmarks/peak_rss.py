"""Peak host memory of `compress run` on a ~1B-parameter bf16 model: the old eager fp32 load vs lazy source-dtype.

    python -m benchmarks.peak_rss              # hidden 2048, 16 layers, intermediate 5632 (~1B params, ~2 GB bf16)
    python -m benchmarks.peak_rss --tiny       # a few-MB shape, to check that the script works
    python -m benchmarks.peak_rss --shape 4b --modes lazy_source_dtype   # 3.9B params, 7.4 GiB bf16
    python -m benchmarks.peak_rss --shape 4b --modes lazy_source_dtype --recipe gptq_int4   # → peak-rss-4b-gptq_int4

A random Llama-shaped model is written as bf16 safetensors into a temporary folder, then `python -m compress run
recipe=rtn_int4` runs on it twice in fresh processes: (a) `model.dtype=float32 model.lazy=false` (what every run did
before source-dtype loading) and (b) the defaults (`model.dtype=auto model.lazy=true`). Each child's peak RSS comes
from GNU time (that child alone) and is divided by the bf16 weight file size. Results go to
``benchmarks/results/peak-rss.{json,md}`` (``--tiny`` writes nothing unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.peer_comparison import measured_run  # noqa: E402

SHAPES = {
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=5632,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
    ),
    "4b": dict(
        hidden_size=3072,
        num_hidden_layers=36,
        intermediate_size=8192,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=32000,
    ),
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
}
MODES = {
    "eager_fp32": ["model.dtype=float32", "model.lazy=false"],
    "lazy_source_dtype": ["model.dtype=auto", "model.lazy=true"],
}


def byte_tokenizer():
    """A byte-level tokenizer with no merges (ids 0..256): real text, diverse ids, nothing to train or download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate([*alphabet, "<eos>"])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


@torch.no_grad()
def save_random_llama(folder: Path, shape: dict, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> int:
    """A random ``LlamaForCausalLM`` of ``shape`` saved as ``dtype`` safetensors (+ config, tokenizer) without ever
    holding an fp32 copy; returns the parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, **shape)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


# every run: the compression alone, on 4 x 128 calibration tokens (a 4B model's walk on the default 64 x 512 takes
# hours on this CPU and holds 402 MB per copy of its hidden states)
FIXED_OVERRIDES = (
    "tracking.enabled=false",
    "gate=none",
    "eval.perplexity=false",
    "device=cpu",
    "data.num_samples=4",
    "data.seq_len=128",
)


def measure(model_dir: Path, mode: str, work: Path, extra: list[str], recipe: str) -> dict:
    """One `compress run` in a fresh process; its own peak RSS from GNU time."""
    runs = work / f"runs-{mode}"
    command = [
        sys.executable,
        "-m",
        "compress",
        "run",
        f"recipe={recipe}",
        f"model={model_dir}",
        *MODES[mode],
        *FIXED_OVERRIDES,
        f"output.dir={runs}",
        *extra,
    ]
    os.environ["COMPRESS_ARTIFACTS"] = str(work / "artifacts")
    # GNU time measures the child from a fresh process: this one still holds the random model it wrote, and a
    # child's rusage would start from that high-water mark (the old results of this script were inflated by it)
    result = measured_run(command, work / f"{mode}.log", timeout=24 * 3600, tree=REPO)
    if not result["ok"]:
        raise SystemExit(f"{mode}: compress run failed: {result['error']}")
    [report_file] = runs.glob("*/report.json")
    report = json.loads(report_file.read_text())
    return {
        "overrides": MODES[mode],
        "peak_rss_mb": result["peak_rss_mb"],
        "report_peak_rss_mb": report["peak_rss_mb"],
        "wall_s": result["wall_s"],
        "timings_s": report["timings_s"],
        "checkpoint_mb": report["checkpoint"]["size_mb"],
    }


def markdown(result: dict) -> str:
    lines = [
        f"# Peak RSS of `compress run recipe={result['recipe']}` ({result['shape_name']} shape)",
        "",
        f"Random Llama, {result['params'] / 1e9:.2f} B parameters, bf16 safetensors {result['weights_mb']:.0f} MB; "
        f"{result['machine']}. Peak RSS is the `compress run` process's, by GNU time (`%M`). Every run also sets "
        f"`{' '.join(FIXED_OVERRIDES)}`: 512 calibration tokens, no evaluation.",
        "",
        "| load path | overrides | peak RSS MB | peak RSS / bf16 file | wall s |",
        "|---|---|---|---|---|",
    ]
    for mode, row in result["modes"].items():
        lines.append(
            f"| {mode} | `{' '.join(row['overrides'])}` | {row['peak_rss_mb']:.0f} | "
            f"{row['ratio_to_bf16_file']:.2f}x | {row['wall_s']:.0f} |"
        )
    if "lazy_vs_eager" in result:
        lines += ["", f"Lazy source-dtype peak is {result['lazy_vs_eager']:.2f}x the eager fp32 peak."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a few-MB model: checks the script, measures nothing")
    parser.add_argument("--shape", choices=[name for name in SHAPES if name != "tiny"], default="1b")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--recipe", default="rtn_int4")
    parser.add_argument("--layers", type=int, help="override the number of decoder layers")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results; none for --tiny)")
    args = parser.parse_args(argv)
    shape_name = "tiny" if args.tiny else args.shape
    shape = dict(SHAPES[shape_name])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    out = args.out or (None if args.tiny else REPO / "benchmarks" / "results")
    with tempfile.TemporaryDirectory(prefix="peak-rss-") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        params = save_random_llama(model_dir, shape, torch.bfloat16)
        weights_mb = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20
        extra = ["stages.0.group_size=32"] if args.tiny else []
        modes = {mode: measure(model_dir, mode, work, extra, args.recipe) for mode in args.modes}
    for row in modes.values():
        row["ratio_to_bf16_file"] = row["peak_rss_mb"] / weights_mb
    result = {
        "shape_name": shape_name,
        "shape": shape,
        "params": params,
        "weights_mb": weights_mb,
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}",
        "recipe": args.recipe,
        "modes": modes,
    }
    if len(modes) == len(MODES):
        result["lazy_vs_eager"] = modes["lazy_source_dtype"]["peak_rss_mb"] / modes["eager_fp32"]["peak_rss_mb"]
    print(markdown(result))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        name = "peak-rss" if shape_name == "1b" else f"peak-rss-{shape_name}"
        name += "" if args.recipe == "rtn_int4" else f"-{args.recipe}"
        (out / f"{name}.json").write_text(json.dumps(result, indent=2))
        (out / f"{name}.md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
