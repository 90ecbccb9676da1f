"""``compress search``: the smallest mixed-precision checkpoint that passes the release gate.

1. Sensitivity: for every linear and every candidate scheme, the loss it would add, ½ Σ_o f_o · ΔW_o H ΔW_oᵀ, with
   H = E[x xᵀ] of its input (one layer walk over the unquantized model), ΔW the round-to-nearest error (a cheap
   proxy; GPTQ lowers every scheme's error, roughly in proportion) and f_o the mean squared gradient of the
   next-token loss with respect to output o (the diagonal Fisher, from one backward pass over the calibration
   samples). Unweighted output errors are not comparable across layers: a late layer's large activations make its
   errors look large while the loss barely moves, so int3 lands where it hurts most. ``search.weighting=none``
   drops f (no backward pass: for a model whose activations' gradients do not fit in memory).
2. Allocation: linears that must share a scheme (q/k/v, gate/up: one stacked kernel) form a unit; a multiple-choice
   knapsack gives, for every total size up to the budget, the scheme per unit with the least summed error. It is
   solved exactly as a Pareto frontier (size ascending, error descending), so any size target reads off one point.
3. Closed loop: build the frontier point, run the gate. A block moves to a larger point, chosen from the gate's
   measured failure: log(ppl ratio) is taken as proportional to the predicted error, so the next point is the
   smallest whose predicted error meets ``margin`` × the gate's limit (halfway to the budget when the failure is not
   perplexity). Moving along the frontier raises precision where it removes the most error per extra bit. After a
   pass, points between the largest block (or the frontier's start) and the smallest pass are bisected while trials
   remain. Every trial is an MLflow child run; the result names the smallest passing checkpoint, or the limit that
   stopped the search.
4. Confirmation (``search.confirm``): keeping the first pass of many looks at the same windows can let a checkpoint past
   the limit through more often than one gate would, so the trials score only part of the evaluation text's
   windows and the choice is gated once more on the rest, sealed until then (``evals/gate/windows.py``
   ``WindowSplit``). Only a confirmed choice is a pass.

Bits are counted as the checkpoint stores them (packed codes + scales in the model's dtype; unquantized linears at
the dtype's width) over every linear but the output head: the same number as ``size.json``'s
``linear_bits_per_weight``.

Modules, in import order: ``spec`` → ``sensitivity`` (step 1) → ``frontier`` (step 2) → ``record`` (trials, results,
reports, MLflow) → ``loop`` (steps 3 and 4).
"""

from compress.search.frontier import Allocation, Frontier, allocate, budget_error
from compress.search.loop import next_point, run_search
from compress.search.record import SearchResult, Trial
from compress.search.sensitivity import (
    SensitivityConfig,
    SensitivityStage,
    Unit,
    fits,
    measure_sensitivity,
    output_fisher,
    quantization_delta,
)
from compress.search.spec import DEFAULT_CANDIDATES, SearchSpec

__all__ = [
    "DEFAULT_CANDIDATES",
    "Allocation",
    "Frontier",
    "SearchResult",
    "SearchSpec",
    "SensitivityConfig",
    "SensitivityStage",
    "Trial",
    "Unit",
    "allocate",
    "budget_error",
    "fits",
    "measure_sensitivity",
    "next_point",
    "output_fisher",
    "quantization_delta",
    "run_search",
]
