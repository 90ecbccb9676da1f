"""What every gate layer reads: both sides (:class:`Subject`) and the shared inputs (:class:`GateContext`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compress.base.memory import release_freed_memory
from compress.evals import generation, sides
from compress.evals.gate.policy import GatePolicy


@dataclass
class Subject:
    """One side of the comparison: where it comes from (a path, a model name or a model in memory), its tokenizer,
    and, while it is loaded, the model and how it generates."""

    label: str
    source: Any
    tokenizer: Any
    kv_cache_dtype: str | None
    folder: Path | None = None  # its local folder, when it has one (fingerprinted for the baseline reference cache)
    model: Any = None
    generator: generation.Generator | None = None

    def load(self, backend: str, engine_options: dict) -> Subject:
        in_memory = not isinstance(self.source, str | Path)
        self.model = self.source.eval() if in_memory else sides.load_for_eval(self.source)[0]
        self.generator = generation.make_generator(
            backend, self.model, self.tokenizer, self.kv_cache_dtype, engine_options
        )
        return self

    def unload(self) -> None:
        """Drop this side's model, generator and KV pool, and hand the freed heap back before the other side loads."""
        self.model = self.generator = None
        release_freed_memory()


@dataclass
class GateContext:
    """What every layer reads, the same for both sides."""

    policy: GatePolicy
    evaluation_texts: list[str]
    evaluation_ids: torch.Tensor
    max_context: int  # the shorter of the two models' contexts: the long-context lengths must fit both
    out_dir: Path
    selected: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    # per side ("candidate", "baseline"): the perplexity pass (compress.evals.perplexity.PerplexityResult as a dict),
    # shared by the perplexity and KL layers; given by the caller when it already measured both (``compress run``)
    scores: dict[str, dict] = field(default_factory=dict)
    scores_source: str = "gate"  # "gate", or who measured them ("run")
    reference: dict[str, torch.Tensor] | None = None  # the baseline's top-k distributions (compress.evals.divergence)
    reference_cached: str | None = None  # the cache file the baseline's pass was read from, if it was
    window_confidence: float = 0.95  # per look: lowered when gate.decide may look several times (Bonferroni)
    # the stream the window layers score (compress.evals.gate.windows.scoring_ids) and each window's place in the text
    window_ids: torch.Tensor | None = None
    window_positions: list[int] = field(default_factory=list)
    window_split: Any = None  # the windows.WindowSplit part of each text this gate may score; None: all of them
    # the domain panel (gate.domains): each kind of text's evaluation ids, and a context per domain made from this one
    domain_ids: dict[str, torch.Tensor] = field(default_factory=dict)
    domain_contexts: dict[str, GateContext] | None = None
    # per layer, what it has measured so far (the lm_eval layer's candidate pilot reads the baseline's outcomes)
    measured: dict[str, dict] = field(default_factory=dict)
