"""``python -m compress bench engine [checkpoint=PATH] [requests=48 rate=2 batch=8 ...]``: the engine against
transformers ``generate`` (static batches) on the same model, same workload, same run.

Workload: Poisson arrivals of a mixed-length workload (mostly short prompts, some long; varied output lengths),
random token ids, EOS ignored so both systems produce exactly the requested tokens. Reports TTFT, TPOT and ITL
percentiles, throughput and goodput (requests/s meeting the TTFT and TPOT objectives), the prefix-cache TTFT gain
for a shared system prompt, and perplexity with each KV cache dtype. Results go to
``benchmarks/results/engine-<device>.{json,md}``.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from compress.engine.llm import LLM
from compress.engine.loading import load_model
from compress.engine.sequence import SamplingParams

DEFAULTS = {
    "checkpoint": "artifacts/models/smollm2-135m-instruct", "requests": "48", "rate": "2", "batch": "8",
    "max_num_seqs": "32", "seed": "0", "slo_ttft": "2.0", "slo_tpot": "0.25", "system_tokens": "1024",
    "kv_dtypes": "bf16,int8,fp8", "text": "docs/engine.md", "out": "benchmarks/results",
}


def workload(count: int, rate: float, vocab: int, seed: int) -> list[tuple[float, list[int], int]]:
    """``(arrival offset s, prompt ids, output tokens)``: 75% prompts of 16-128 tokens, 25% of 256-768."""
    rng = random.Random(seed)
    clock, requests = 0.0, []
    for _ in range(count):
        clock += rng.expovariate(rate)
        length = rng.randint(16, 128) if rng.random() < 0.75 else rng.randint(256, 768)
        requests.append((clock, [rng.randrange(vocab) for _ in range(length)], rng.randint(16, 128)))
    return requests


def summarize(arrivals: list[float], token_times: list[list[float]], slo_ttft: float, slo_tpot: float) -> dict:
    ttft = [times[0] - arrival for arrival, times in zip(arrivals, token_times, strict=True)]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times if len(t) > 1]
    itl = [b - a for t in token_times for a, b in zip(t, t[1:], strict=False)]
    span = max(t[-1] for t in token_times) - min(arrivals)
    good = sum(1 for first, t in zip(ttft, token_times, strict=True)
               if first <= slo_ttft and (len(t) < 2 or (t[-1] - t[0]) / (len(t) - 1) <= slo_tpot))

    def pct(values):
        q = statistics.quantiles(values, n=100, method="inclusive")
        return {"p50": q[49], "p95": q[94], "p99": q[98]}

    return {"ttft_s": pct(ttft), "tpot_s": pct(tpot), "itl_s": pct(itl),
            "throughput_tok_s": sum(len(t) for t in token_times) / span, "goodput_req_s": good / span,
            "makespan_s": span}


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
        pending = pending[len(batch):]
        width = max(len(p) for _, p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for _, p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, p, _ in batch])
        steps = max(n for _, _, n in batch)
        clock = _StepClock()
        model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=steps,
                       min_new_tokens=steps, do_sample=False, pad_token_id=0, streamer=clock)
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


def main(argv: list[str]) -> int:
    options = dict(DEFAULTS)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in DEFAULTS:
            print(f"error: bad argument {arg!r}; options: {', '.join(f'{k}={v}' for k, v in DEFAULTS.items())}",
                  file=sys.stderr)
            return 2
        options[key] = value
    model, tokenizer = load_model(options["checkpoint"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device).eval()
    vocab = model.config.vocab_size
    requests = workload(int(options["requests"]), float(options["rate"]), vocab, int(options["seed"]))
    slo = float(options["slo_ttft"]), float(options["slo_tpot"])
    engine_options = dict(max_num_seqs=int(options["max_num_seqs"]))

    def params_for(tokens):
        return SamplingParams(max_tokens=tokens, ignore_eos=True)

    llm = LLM(model, tokenizer, **engine_options)
    run_engine(llm, requests[:4], params_for)  # warm-up (kernels, allocator)
    llm = LLM(model, tokenizer, **engine_options)
    engine = summarize(*run_engine(llm, requests, params_for), *slo)
    engine["preemptions"] = llm.scheduler.num_preemptions
    baseline = summarize(*run_transformers(model, requests, int(options["batch"])), *slo)
    results = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "model": options["checkpoint"],
        "options": options, "engine": engine, "transformers_static": baseline,
        "throughput_ratio": engine["throughput_tok_s"] / baseline["throughput_tok_s"],
        "prefix_cache": prefix_cache_gain(LLM(model, tokenizer, **engine_options), int(options["system_tokens"]),
                                          vocab),
        "kv_perplexity": kv_perplexity(model, tokenizer, options),
    }
    write_results(results, Path(options["out"]))
    print(json.dumps(results, indent=2))
    return 0


def kv_perplexity(model, tokenizer, options) -> dict:
    """Perplexity of a text through the engine with each KV cache dtype, against the model's own dtype."""
    path = Path(options["text"])
    if tokenizer is None or not path.is_file():
        return {"skipped": f"needs a tokenizer and a text file ({path})"}
    ids = tokenizer(path.read_text())["input_ids"][:2048]
    results = {"tokens": len(ids), "auto": LLM(model, tokenizer).perplexity(ids)}
    for dtype in options["kv_dtypes"].split(","):
        results[dtype] = LLM(model, tokenizer, kv_cache_dtype=dtype).perplexity(ids)
    return results


def write_results(results: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    name = "engine-" + re.sub(r"[^a-z0-9]+", "-", results["device"].lower()).strip("-")
    (folder / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# Engine benchmark ({results['device']}, {results['model']})", "",
             f"Options: `{' '.join(f'{k}={v}' for k, v in results['options'].items())}`", "",
             "| system | TTFT p50/p95/p99 s | TPOT p50/p95/p99 s | ITL p50/p95/p99 s | tok/s | goodput req/s |",
             "|---|---|---|---|---|---|"]
    for label, key in (("compress engine", "engine"), ("transformers generate (static)", "transformers_static")):
        r = results[key]
        cells = ["/".join(f"{r[m][p]:.3f}" for p in ("p50", "p95", "p99")) for m in ("ttft_s", "tpot_s", "itl_s")]
        lines.append(f"| {label} | {' | '.join(cells)} | {r['throughput_tok_s']:.1f} | {r['goodput_req_s']:.3f} |")
    prefix = results["prefix_cache"]
    lines += ["", f"Throughput ratio engine / transformers: **{results['throughput_ratio']:.2f}x**", "",
              f"Prefix cache ({results['options']['system_tokens']}-token shared system prompt): cold TTFT "
              f"{prefix['cold_ttft_s']:.3f} s, warm {prefix['warm_ttft_s']:.3f} s, **{prefix['speedup']:.1f}x**, "
              f"hit rate {prefix['hit_rate']:.1%}", "",
              f"KV cache perplexity: `{json.dumps(results['kv_perplexity'])}`"]
    (folder / f"{name}.md").write_text("\n".join(lines) + "\n")
