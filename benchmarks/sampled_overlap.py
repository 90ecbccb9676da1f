"""Are windows the model samples for calibration (``data.generated``) disjoint from the evaluation texts? The share of
their token n-grams that occur anywhere in each evaluation split (out-of-domain Shakespeare, in-domain pydoc).

    python -m benchmarks.sampled_overlap --share 1.0

Samples (or reads from ``artifacts/calibration``) the windows a run with ``data.generated=<share>`` calibrates on.
"""

from __future__ import annotations

import argparse

from compress.base.data import DataSpec, load_corpus, out_of_domain, tokenize, window_start_token
from compress.model.calibration_set import generated_windows, sampled_windows, start_token
from compress.model.sources import ModelSpec, load


def ngrams(ids: list[int], n: int) -> set[tuple[int, ...]]:
    return {tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--share", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-n", type=int, nargs="+", default=[8, 13, 32])
    args = parser.parse_args()
    model, tokenizer = load(ModelSpec(args.model))
    spec = DataSpec(generated=args.share)
    start = start_token(model, window_start_token(model.config))
    windows = sampled_windows(model, generated_windows(spec), spec.seq_len, args.seed, start)[:, 1:]  # not the start
    print(f"{len(windows)} sampled windows of {spec.seq_len} tokens, model {args.model}, seed {args.seed}")
    print("| evaluation text | tokens | " + " | ".join(f"{n}-grams found" for n in args.n) + " |")
    print("|---|---|" + "---|" * len(args.n))
    rows = windows.tolist()
    sampled = {n: [ngrams(row, n) for row in rows] for n in args.n}  # each window's distinct n-grams, once
    for name, text_spec in (("out-of-domain (Shakespeare)", out_of_domain()), ("in-domain (pydoc)", DataSpec())):
        ids = tokenize(tokenizer, load_corpus(text_spec).evaluation_text).tolist()
        cells = []
        for n in args.n:
            seen = ngrams(ids, n)
            found = sum(len(grams & seen) for grams in sampled[n])
            cells.append(f"{found}/{sum(map(len, sampled[n]))}")
        print(f"| {name} | {len(ids)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
