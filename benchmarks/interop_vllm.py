"""One checkpoint through vLLM: does ``LLM(...)`` accept it, and does it generate? Run by
``benchmarks/interop_matrix.py`` with the vLLM venv's python, from a folder outside the repository (so
``import vllm`` finds the installed package):

    /work/vllm-venv/bin/python benchmarks/interop_vllm.py <checkpoint> --prompt "The capital of France is"

Imports only vLLM and the standard library (this project is not installed in that venv). Prints one line
``INTEROP_RESULT {json}`` with ``accepted`` (the engine was built), ``generated`` (greedy tokens came back), ``text``
and ``error`` (``Type: message`` of what failed); a line with ``accepted`` alone is printed before generating, so a
caller that kills a slow generation still knows the engine was built. The caller sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine runs in this process (no engine and worker processes polling each
other on a 2-core machine) and a refusal is raised here with its own message.
The settings are the ones ``../shared/README.md`` found to work on a CPU: 0.3 of the memory, eager, 512 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MARK = "INTEROP_RESULT "


def report(result: dict) -> None:
    """Print the result line and leave at once: vLLM's shutdown of its engine process can hang on a busy CPU."""
    print(MARK + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()
    result = {"accepted": False, "generated": False, "text": None, "error": None}
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=args.checkpoint,
            gpu_memory_utilization=0.3,
            enforce_eager=True,
            max_model_len=512,
            seed=0,
        )
    except BaseException as error:  # noqa: BLE001 - any failure to build the engine is the outcome we record
        result["error"] = f"{type(error).__name__}: {' '.join(str(error).split())}"
        report(result)
    result["accepted"] = True
    print(MARK + json.dumps({**result, "error": "generation did not finish"}), flush=True)  # read if it is killed
    try:
        outputs = llm.generate([args.prompt], SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
        result["text"] = outputs[0].outputs[0].text
        result["generated"] = True
    except BaseException as error:  # noqa: BLE001 - a failing forward is the outcome we record
        result["error"] = f"{type(error).__name__}: {' '.join(str(error).split())}"
    report(result)


if __name__ == "__main__":
    main()
