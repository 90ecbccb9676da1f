"""The engine on a GPU (compiled kernels, CUDA graphs) against transformers on the same model: greedy tokens
and teacher-forced perplexity for each KV cache dtype. Random weights of SmolLM2's shape (dense, and in W4A16 with
the stacked projections) and of a small Mixtral (MoE), so it runs on a bare GPU box: ``python -m
benchmarks.engine_gpu_check [cuda|cpu] [dense,moe,w4a16]`` from the checkout's root (``cpu`` for a dry run here).
Prints a table; exits 1 if fp32 greedy output differs."""

from __future__ import annotations

import itertools
import math
import random
import sys

import torch

from benchmarks.bench_engine import build_random, convert_linears, random_model
from compress.engine import LLM, SamplingParams


@torch.inference_mode()
def transformers_perplexity(model, ids: list[int]) -> float:
    logits = model(torch.tensor([ids], device=model.device)).logits[0, :-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:], device=model.device)).item())


@torch.inference_mode()
def transformers_greedy(model, prompt: list[int], tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        max_new_tokens=tokens,
        do_sample=False,
        min_new_tokens=tokens,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def random_moe(device: str, dtype: torch.dtype):
    """A Mixtral of 8 experts (top 2) with random weights: the engine's MoE path under CUDA graphs."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
    )
    return build_random(MixtralForCausalLM, config, device, dtype)


def random_w4a16(device: str, dtype: torch.dtype):
    """SmolLM2's shape with its decoder linears in W4A16 (group 64): the engine stacks q/k/v and gate/up into one
    launch each (``compress/engine/fusion.py``) under CUDA graphs, while transformers calls every projection."""
    model = random_model("smollm2-135m", device, dtype)
    convert_linears(model, "w4a16", 64)
    return model


MODELS = {
    "dense": (lambda device, dtype: random_model("smollm2-135m", device, dtype), ("auto", "int8", "fp8")),
    "moe": (random_moe, ("auto", "int8")),
    "w4a16": (random_w4a16, ("auto",)),
}


def main(argv: list[str]) -> int:
    device = argv[0] if argv else "cuda"
    kinds = argv[1].split(",") if len(argv) > 1 else list(MODELS)  # e.g. ``cuda w4a16``: one model kind
    rng = random.Random(0)
    failures = 0
    chosen = {kind: MODELS[kind] for kind in kinds}
    for (kind, (build, kv_dtypes)), dtype in itertools.product(chosen.items(), (torch.float32, torch.bfloat16)):
        model = build(device, dtype)
        vocab = model.config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(length)] for length in (5, 17, 64, 300)]
        text = [rng.randrange(vocab) for _ in range(1500)]
        reference_ppl = transformers_perplexity(model, text)
        expected = [transformers_greedy(model, p, 24) for p in prompts]
        for kv in kv_dtypes:
            llm = LLM(model, kv_cache_dtype=kv, max_num_seqs=8, max_model_len=2048)
            outputs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
            same = sum(o.token_ids == e for o, e in zip(outputs, expected, strict=True))
            first_token = sum(o.token_ids[0] == e[0] for o, e in zip(outputs, expected, strict=True))
            ppl = llm.perplexity(text)
            print(
                f"{kind:>5} {str(dtype):>15} kv={kv:<5} greedy identical {same}/{len(prompts)} "
                f"(first token {first_token}/{len(prompts)})  ppl {ppl:.4f} vs transformers {reference_ppl:.4f} "
                f"({100 * (ppl / reference_ppl - 1):+.3f}%)",
                flush=True,
            )
            if dtype == torch.float32 and kv == "auto" and same != len(prompts):
                failures += 1
            del llm
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
