"""``python -m compress bench engine [checkpoint=PATH] [requests=48 rate=2 batch=8 ...]``: the engine against
transformers ``generate`` (static batches) on the same model, same workload, same run.

Workload: Poisson arrivals of a mixed-length workload (mostly short prompts, some long; varied output lengths),
random token ids, EOS ignored so both systems produce exactly the requested tokens. Reports TTFT, TPOT and ITL
percentiles, throughput and goodput (requests/s meeting the TTFT and TPOT objectives), the prefix-cache TTFT gain
for a shared system prompt, and perplexity with each KV cache dtype. Results go to
``benchmarks/results/engine-<device>.{json,md}``.

``mode=decode`` instead times batch-1 decoding of the model as loaded (dense) against the same model with its
decoder linears converted on the fly (``decode_weights=w4a16,int8,fp8``, round to nearest: speed only, not
quality), in our engine, in the same run; ``w4a16-unfused`` runs W4A16 with one launch per projection instead of
stacked q/k/v and gate/up (``EngineConfig.fuse_projections``), the A/B of that fusion. ``profile=true`` also
profiles ``profile_steps`` batch-1 decode steps of each (torch profiler, CUDA graphs on as in the timing) and splits
a step's device time by kind of kernel (our quantized linears, bf16 GEMMs such as the ``lm_head``, attention, norms,
sampling, elementwise and copies), beside the step's wall time: where a step's time goes, and how much of it no
kernel fills (launches, Python).
``checkpoint=random:<preset>`` builds a random-weight model of a real architecture on the device (no download; the
speed of a forward pass does not depend on the weight values).
"""

from __future__ import annotations

import json
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
from transformers.generation.streamers import BaseStreamer

from benchmarks.serving_workload import summarize, workload
from compress.base.errors import CompressError
from compress.commands.args import parse_options, show_value, usage, wants_help
from compress.engine.llm import LLM
from compress.engine.sequence import SamplingParams
from compress.model.sources import load as load_model

SYNOPSIS = "python -m compress bench engine [checkpoint=PATH mode=serve|decode requests=48 rate=2 ...]"


@dataclass
class EngineBenchOptions:
    checkpoint: str = "artifacts/models/smollm2-135m-instruct"  # or random:<preset>
    mode: Literal["serve", "decode"] = "serve"
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # auto: bf16 on a GPU, as stored on CPU
    requests: int = 48
    rate: float = 2.0
    batch: int = 8
    max_num_seqs: int = 32
    seed: int = 0
    slo_ttft: float = 2.0
    slo_tpot: float = 0.25
    system_tokens: int = 1024
    kv_dtypes: list[str] = field(default_factory=lambda: ["bf16", "int8", "fp8"])
    text: str = "docs/engine.md"
    out: Path = Path("benchmarks/results")
    decode_weights: list[str] = field(default_factory=lambda: ["w4a16", "int8", "fp8"])
    decode_tokens: int = 256
    group_size: int = 128
    profile: bool = False  # mode=decode: split a decode step's device time by kind of kernel
    profile_steps: int = 32


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Real architectures with random weights (``checkpoint=random:<name>``).
PRESETS = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
}


def log(message: str) -> None:
    print(f"[bench engine {time.strftime('%H:%M:%S')}] {message}", flush=True)


def random_model(preset: str, device: str, dtype: torch.dtype):
    """A ``LlamaForCausalLM`` of a preset's shape with random weights, built directly on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset random:{preset}; choose one of {', '.join(PRESETS)}")
    return build_random(LlamaForCausalLM, LlamaConfig(max_position_embeddings=8192, **PRESETS[preset]), device, dtype)


def build_random(model_class, config, device: str, dtype: torch.dtype):
    """``model_class(config)`` with seeded random weights, built directly on ``device`` in ``dtype`` (an 8B model is
    never materialised in fp32 on the host)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


DECODE_WEIGHTS = ("w4a16", "w4a16-unfused", "int8", "fp8")


def convert_linears(model, weights: str, group_size: int) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """Replace every decoder ``nn.Linear`` with our quantized module (round to nearest). For speed measurements:
    quality comes from the pipeline's stages. Returns ``(parent, name, dense)`` so :func:`restore` can undo it."""
    from compress.formats import Fp8Linear, Int8Linear, QuantizedLinear
    from compress.grids.int_grid import WeightScheme, quantize

    if weights not in ("w4a16", "int8", "fp8"):
        raise ValueError(f"decode_weights: unknown format {weights!r}; choose w4a16, int8 or fp8")
    scheme = WeightScheme(bits=4, group_size=group_size, symmetric=True)
    replaced = []
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                if weights == "w4a16":
                    group = group_size
                    while child.in_features % group:  # 576-wide SmolLM2 layers take group 64
                        group //= 2
                    codes, scale, _ = quantize(child.weight.data, replace(scheme, group_size=group))
                    bias = None if child.bias is None else child.bias.data
                    replacement = QuantizedLinear.from_codes(codes, scale, None, 4, group, bias)
                elif weights == "int8":
                    replacement = Int8Linear.from_float(child)
                else:
                    replacement = Fp8Linear.from_float(child)
                setattr(parent, name, replacement)
                replaced.append((parent, name, child))
    return replaced


def restore(replaced: list[tuple[torch.nn.Module, str, torch.nn.Module]]) -> None:
    for parent, name, dense in replaced:
        setattr(parent, name, dense)


def run_engine(llm: LLM, requests, params_for) -> tuple[list[float], list[list[float]]]:
    start = time.perf_counter()
    pending, ids = list(requests), []
    while pending or llm.has_unfinished():
        now = time.perf_counter()
        while pending and start + pending[0][0] <= now:
            offset, prompt, tokens = pending.pop(0)
            ids.append(llm.add_request(prompt, params_for(tokens), arrival_time=start + offset))
        if llm.has_unfinished():
            llm.step()
        elif pending:
            time.sleep(max(0.0, start + pending[0][0] - time.perf_counter()))
    outputs = [llm.output(i) for i in ids]
    return [o.arrival_time for o in outputs], [o.token_times for o in outputs]


class _StepClock(BaseStreamer):
    """Records when ``generate`` produces each step's tokens (the first ``put`` is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value):
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self):
        pass


@torch.inference_mode()
def run_transformers(model, requests, batch_size: int) -> tuple[list[float], list[list[float]]]:
    """Static batching: whatever has arrived (up to ``batch_size``) runs to the longest request's end."""
    start = time.perf_counter()
    pending, arrivals, token_times = list(requests), [], []
    while pending:
        wait = start + pending[0][0] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        now = time.perf_counter()
        batch = [r for r in pending[:batch_size] if start + r[0] <= now]
        pending = pending[len(batch) :]
        width = max(len(p) for _, p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for _, p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, p, _ in batch])
        steps = max(n for _, _, n in batch)
        clock = _StepClock()
        model.generate(
            ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
            streamer=clock,
        )
        for offset, _, n in batch:
            arrivals.append(start + offset)
            token_times.append(clock.times[:n])
    return arrivals, token_times


def prefix_cache_gain(llm: LLM, system_tokens: int, vocab: int) -> dict:
    """TTFT of requests sharing a ``system_tokens`` system prompt: the first (cold) against later ones."""
    rng = random.Random(1)
    system = [rng.randrange(vocab) for _ in range(system_tokens)]
    looked, hit = llm.block_manager.prompt_tokens_looked_up, llm.block_manager.prompt_tokens_hit
    ttfts = []
    for _ in range(5):
        question = [rng.randrange(vocab) for _ in range(24)]
        output = llm.generate([system + question], SamplingParams(max_tokens=1, ignore_eos=True))[0]
        ttfts.append(output.token_times[0] - output.arrival_time)
    warm = statistics.median(ttfts[1:])
    hits = (llm.block_manager.prompt_tokens_hit - hit) / (llm.block_manager.prompt_tokens_looked_up - looked)
    return {"cold_ttft_s": ttfts[0], "warm_ttft_s": warm, "speedup": ttfts[0] / warm, "hit_rate": hits}


def load(options: EngineBenchOptions, device: str):
    """``(model, tokenizer)`` on ``device`` in the requested dtype (auto: bf16 on a GPU, as stored on CPU)."""
    dtype = DTYPES.get(options.dtype) or (torch.bfloat16 if device == "cuda" else None)
    checkpoint = options.checkpoint
    if checkpoint.startswith("random:"):
        return random_model(checkpoint.removeprefix("random:"), device, dtype or torch.float32), None
    model, tokenizer = load_model(checkpoint, lazy=False)
    model = model.to(device)
    return (model.to(dtype) if dtype else model).eval(), tokenizer


def main(argv: list[str]) -> int:
    if wants_help(argv):
        print(usage(EngineBenchOptions, SYNOPSIS))
        return 0
    try:
        options, _ = parse_options(EngineBenchOptions, argv, SYNOPSIS)
    except CompressError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    unknown = [weights for weights in options.decode_weights if weights not in DECODE_WEIGHTS]
    if unknown:  # before the model loads: an 8B random model takes a minute of GPU time
        print(f"error: decode_weights: unknown {unknown}; choose from {', '.join(DECODE_WEIGHTS)}", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log(f"loading {options.checkpoint} on {device}")
    model, tokenizer = load(options, device)
    if options.mode == "decode":
        results = decode_speed(model, tokenizer, options, device)
    else:
        results = serve(model, tokenizer, options, device)
    write_results(results, options.out)
    print(json.dumps(results, indent=2))
    return 0


def serve(model, tokenizer, options: EngineBenchOptions, device: str) -> dict:
    """Poisson workload through the engine, then through transformers ``generate``; prefix cache; KV dtypes."""
    vocab = model.config.vocab_size
    requests = workload(options.requests, options.rate, vocab, options.seed)
    slo = options.slo_ttft, options.slo_tpot
    engine_options = dict(max_num_seqs=options.max_num_seqs)

    def params_for(tokens):
        return SamplingParams(max_tokens=tokens, ignore_eos=True)

    log("engine warm-up (kernels, CUDA graphs, allocator)")
    llm = LLM(model, tokenizer, **engine_options)
    run_engine(llm, requests[:4], params_for)
    del llm
    log(f"engine: {len(requests)} requests at {options.rate}/s")
    llm = LLM(model, tokenizer, **engine_options)
    engine = summarize(*run_engine(llm, requests, params_for), *slo)
    engine["preemptions"] = llm.scheduler.num_preemptions
    del llm
    log(f"engine: {engine['throughput_tok_s']:.1f} tok/s; transformers generate, static batches of {options.batch}")
    baseline = summarize(*run_transformers(model, requests, options.batch), *slo)
    log(f"transformers: {baseline['throughput_tok_s']:.1f} tok/s; prefix cache")
    prefix = prefix_cache_gain(LLM(model, tokenizer, **engine_options), options.system_tokens, vocab)
    log(f"prefix cache: {prefix['speedup']:.1f}x TTFT; KV cache dtypes")
    return {
        "mode": "serve",
        "device": device_name(device),
        "model": options.checkpoint,
        "dtype": str(model.dtype).removeprefix("torch."),
        "options": {key: show_value(value) for key, value in asdict(options).items()},
        "engine": engine,
        "transformers_static": baseline,
        "throughput_ratio": engine["throughput_tok_s"] / baseline["throughput_tok_s"],
        "prefix_cache": prefix,
        "kv_perplexity": kv_perplexity(model, tokenizer, options),
    }


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def decode_tokens_per_second(model, tokens: int, **engine_options) -> float:
    """Median batch-1 decode rate over three requests (128-token prompt, ``tokens`` new tokens)."""
    llm = LLM(model, max_num_seqs=4, max_model_len=128 + tokens + 16, kv_cache_memory_gb=1.0, **engine_options)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.generate([[rng.randrange(model.config.vocab_size) for _ in range(128)]], SamplingParams(max_tokens=8))
    rates = []
    for _ in range(3):
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(128)]
        times = llm.generate([prompt], params)[0].token_times
        rates.append((len(times) - 1) / (times[-1] - times[0]))
    del llm
    return statistics.median(rates)


# A kernel's kind, by the first pattern its lower-cased name matches (Triton kernels keep their Python names; on a CPU
# the names are aten ops). Ours before the GEMMs: cuBLAS and CUTLASS names also say gemm.
KERNEL_KINDS = (
    ("attention", r"paged_attention|merge_splits|write_kv|quantize_store|attention|attn|flash|sdpa"),
    (
        "quantized linears (ours)",
        r"gemv_kernel|skinny_kernel|gemm_kernel|dequantize_kernel|scaled_mm|quantize_rows|"
        r"block_matmul|fp4_matmul|token_groups|weight_only|int8_linear|fp8_linear",
    ),
    (
        "bf16 GEMMs (lm_head; every linear when dense)",
        r"gemm|gemv|matmul|xmma|cutlass|nvjet|cublas|splitk|aten::mm|"
        r"aten::addmm|aten::bmm|aten::linear",
    ),
    ("norms", r"norm|rsqrt"),
    ("sampling", r"argmax|softmax|exponential|multinomial|topk|sort"),
    ("copies", r"copy|memcpy|memset|aten::cat|index|gather|scatter|aten::to\b|contiguous"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|silu|mul|add|pow|mean|neg|aten::"),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, lowered)), "other")


def decode_step_profile(model, steps: int, **engine_options) -> dict:
    """``steps`` batch-1 decode steps (after the prompt's prefill and a warm-up, so compilation and graph capture stay
    out) under the torch profiler: device time per step by kind of kernel, the top kernels, and the step's wall time.
    On a CPU the "kernels" are the aten ops' self times (a smoke check of the script)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = next(model.parameters()).is_cuda
    llm = LLM(model, max_num_seqs=4, max_model_len=128 + steps + 32, kv_cache_memory_gb=1.0, **engine_options)
    rng = random.Random(1)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(128)]
    llm.generate([prompt], SamplingParams(max_tokens=8))  # warm-up
    llm.add_request(prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    while not llm.step():  # the prefill, until the first token
        pass
    for _ in range(4):
        llm.step()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    del llm
    kernels: dict[str, float] = {}
    averages = profiler.key_averages()
    graph_launches = sum(event.count for event in averages if event.key == "cudaGraphLaunch")
    for event in averages:
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if on_device != cuda:
            continue
        microseconds = getattr(event, "self_device_time_total", 0.0) if cuda else event.self_cpu_time_total
        if microseconds > 0 and (cuda or event.key.startswith("aten::")):
            kernels[event.key] = kernels.get(event.key, 0.0) + microseconds / steps
    by_kind: dict[str, float] = {}
    for name, microseconds in kernels.items():
        kind = kernel_kind(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + microseconds
    top = sorted(kernels.items(), key=lambda item: -item[1])[:8]
    return {
        "steps": steps,
        "step_wall_us": wall / steps * 1e6,
        "kernel_us": sum(kernels.values()),
        "graph_launches_per_step": graph_launches / steps,  # kernels ≪ wall with graphs: the profiler missed theirs
        "by_kind_us": dict(sorted(by_kind.items(), key=lambda item: -item[1])),
        "top_kernels_us": dict(top),
    }


def decode_speed(model, tokenizer, options: EngineBenchOptions, device: str) -> dict:
    """Batch-1 decode tok/s: the dense model, then each converted format, same engine, same run; with ``profile``,
    where a decode step's time goes for each."""
    tokens, group = options.decode_tokens, options.group_size
    dtype = str(model.dtype).removeprefix("torch.")
    rates = {"dense": decode_tokens_per_second(model, tokens)}
    profiles = {"dense": decode_step_profile(model, options.profile_steps)} if options.profile else {}
    log(f"dense {dtype}: {rates['dense']:.1f} tok/s")
    for weights in options.decode_weights:
        replaced = convert_linears(model, weights.removesuffix("-unfused"), group)
        fused = not weights.endswith("-unfused")
        rates[weights] = decode_tokens_per_second(model, tokens, fuse_projections=fused)
        if options.profile:
            profiles[weights] = decode_step_profile(model, options.profile_steps, fuse_projections=fused)
        restore(replaced)
        del replaced
        if device == "cuda":
            torch.cuda.empty_cache()
        log(f"{weights}: {rates[weights]:.1f} tok/s ({rates[weights] / rates['dense']:.2f}x dense)")
    return {
        "mode": "decode",
        "device": device_name(device),
        "model": options.checkpoint,
        "dtype": dtype,
        "options": {key: show_value(value) for key, value in asdict(options).items()},
        "decode_tok_s": rates,
        "speedup_vs_dense": {k: v / rates["dense"] for k, v in rates.items() if k != "dense"},
        **({"decode_profile": profiles} if profiles else {}),
    }


def kv_perplexity(model, tokenizer, options: EngineBenchOptions) -> dict:
    """Perplexity of a text through the engine with each KV cache dtype, against the model's own dtype."""
    path = Path(options.text)
    if tokenizer is None or not path.is_file():
        return {"skipped": f"needs a tokenizer and a text file ({path})"}
    ids = tokenizer(path.read_text())["input_ids"][:2048]
    results = {"tokens": len(ids), "auto": LLM(model, tokenizer).perplexity(ids)}
    for dtype in options.kv_dtypes:
        results[dtype] = LLM(model, tokenizer, kv_cache_dtype=dtype).perplexity(ids)
    return results


def profile_lines(profiles: dict) -> list[str]:
    """One table: per weight format, a decode step's wall time, the kernels' total and each kind's share."""
    if not profiles:
        return []
    kinds = [kind for kind, _ in KERNEL_KINDS] + ["other"]
    kinds = [kind for kind in kinds if any(kind in p["by_kind_us"] for p in profiles.values())]
    steps = next(iter(profiles.values()))["steps"]
    lines = [
        "",
        f"Where a decode step goes ({steps} steps profiled, us per step; kernels' device time, a step's wall time):",
        "",
        "| weights | wall | kernels | " + " | ".join(kinds) + " |",
        "|---|---|---|" + "---|" * len(kinds),
    ]
    for weights, p in profiles.items():
        cells = [f"{p['by_kind_us'].get(kind, 0.0):.0f}" for kind in kinds]
        lines.append(f"| {weights} | {p['step_wall_us']:.0f} | {p['kernel_us']:.0f} | " + " | ".join(cells) + " |")
    return lines


def write_results(results: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    slug = "-".join(
        re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
        for text in (results["mode"], Path(results["model"]).name, results["device"])
    )
    name = f"engine-{slug}"
    (folder / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        f"# Engine benchmark, {results['mode']} ({results['device']}, {results['model']}, {results['dtype']})",
        "",
        f"Options: `{' '.join(f'{k}={v}' for k, v in results['options'].items())}`",
        "",
    ]
    if results["mode"] == "decode":
        lines += [
            "Batch-1 decode, 128-token prompt, median of 3 requests, our engine for every row.",
            "",
            "| weights | tok/s | vs dense |",
            "|---|---|---|",
        ]
        for weights, rate in results["decode_tok_s"].items():
            ratio = results["speedup_vs_dense"].get(weights, 1.0)
            lines.append(f"| {weights} | {rate:.1f} | {ratio:.2f}x |")
        lines += profile_lines(results.get("decode_profile", {}))
        (folder / f"{name}.md").write_text("\n".join(lines) + "\n")
        return
    lines += [
        "| system | TTFT p50/p95/p99 s | TPOT p50/p95/p99 s | ITL p50/p95/p99 s | tok/s | goodput req/s |",
        "|---|---|---|---|---|---|",
    ]
    for label, key in (("compress engine", "engine"), ("transformers generate (static)", "transformers_static")):
        r = results[key]
        cells = ["/".join(f"{r[m][p]:.3f}" for p in ("p50", "p95", "p99")) for m in ("ttft_s", "tpot_s", "itl_s")]
        lines.append(f"| {label} | {' | '.join(cells)} | {r['throughput_tok_s']:.1f} | {r['goodput_req_s']:.3f} |")
    prefix = results["prefix_cache"]
    lines += [
        "",
        f"Throughput ratio engine / transformers: **{results['throughput_ratio']:.2f}x**",
        "",
        f"Prefix cache ({results['options']['system_tokens']}-token shared system prompt): cold TTFT "
        f"{prefix['cold_ttft_s']:.3f} s, warm {prefix['warm_ttft_s']:.3f} s, **{prefix['speedup']:.1f}x**, "
        f"hit rate {prefix['hit_rate']:.1%}",
        "",
        f"KV cache perplexity: `{json.dumps(results['kv_perplexity'])}`",
    ]
    (folder / f"{name}.md").write_text("\n".join(lines) + "\n")
