"""The ``search.*`` keys of ``compress search``, checked before any work."""

from __future__ import annotations

from dataclasses import dataclass, field

from compress.base.errors import CompressError
from compress.stages.mixed import Candidate, candidate

DEFAULT_CANDIDATES = ["int3_g64", "int4_g64", "int8", "fp8", "bf16"]
WEIGHTINGS = ("fisher", "none")
SEARCHABLE = ("rtn", "gptq")  # base-recipe weight quantizers whose rounding the mixed stage can apply per scheme


@dataclass
class SearchSpec:
    """``search.*`` keys of the command."""

    budget_bits: float = 4.5  # the most bits per linear weight a trial may use
    candidates: list[str] = field(default_factory=lambda: list(DEFAULT_CANDIDATES))  # schemes a linear may get
    max_trials: int = 6  # most candidate checkpoints built and gated
    start_bits: float | None = None  # the first trial's size; null: the smallest allocation
    tolerance_bits: float = 0.05  # stop bisecting once the largest block and the smallest pass are this close
    margin: float = 0.9  # aim the predicted log-ppl ratio at this fraction of the gate's limit
    weighting: str = "fisher"  # fisher: weigh output errors by the loss's gradient; none: plain output error
    # gate the chosen checkpoint once more on perplexity/KL windows the trials never saw: keeping the first pass of
    # many looks at the same windows can let a checkpoint past the limit through more often than one gate would
    confirm: bool = True
    confirm_share: float = 0.4  # share of each judged text's windows sealed for that confirmation (53 → 32 + 21)

    def check(self) -> list[Candidate]:
        if self.max_trials < 1:
            raise CompressError(f"search.max_trials={self.max_trials} must be ≥ 1")
        if not self.candidates:
            raise CompressError("search.candidates is empty; give schemes, e.g. [int3_g64,int4_g64,int8,bf16]")
        if not 0 < self.margin <= 1:
            raise CompressError(f"search.margin={self.margin} must be in (0, 1]")
        if not 0 < self.confirm_share < 1:
            raise CompressError(
                f"search.confirm_share={self.confirm_share} must be in (0, 1): the share of the windows sealed for "
                "the confirmation, e.g. 0.4 (search.confirm=false: no confirmation)"
            )
        if self.weighting not in WEIGHTINGS:
            raise CompressError(f"search.weighting={self.weighting!r} is not one of {', '.join(WEIGHTINGS)}")
        return [candidate(name) for name in self.candidates]
