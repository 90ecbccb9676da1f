"""What a gate checks and where its limits lie: the typed form of ``recipes/gate/*.yaml``.

Every limit is judged against a 95% interval (``GatePolicy.confidence``), so each layer also says how many items it
scores: a limit its item count cannot decide turns every verdict INCONCLUSIVE (``compress.evals.gate.stats``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from compress.base.errors import CompressError
from compress.base.typed import typed
from compress.engine.engine_config import EngineConfig

LAYER_ORDER = ["perplexity", "kl", "lm_eval", "json", "needle", "long_context", "latency"]
BACKENDS = ("auto", "engine", "transformers")  # generation for the needle, JSON and long-context layers


@dataclass
class PerplexityPolicy:
    enabled: bool = True  # run this layer (a layer left out of gate.layers is off too)
    blocking: bool = True  # its failed checks block the release (false: reported, never deciding)
    seq_len: int = 512  # tokens per scored window
    max_windows: int | None = 32  # windows of seq_len tokens scored (null: every window of the evaluation text)
    batch_size: int = 4  # windows per forward pass
    max_ratio: float | None = 1.05  # candidate ppl ≤ max_ratio × baseline ppl (judged on the interval)
    max_value: float | None = None  # hard ceiling on candidate ppl
    decide_max_windows: int | None = None  # gate.decide=true adds windows up to this (null: the whole text)


@dataclass
class KLPolicy:
    """Measured in the perplexity pass, on the same windows (``perplexity.seq_len`` / ``max_windows``)."""

    enabled: bool = True  # run this layer (a layer left out of gate.layers is off too)
    blocking: bool = True  # its failed checks block the release (false: reported, never deciding)
    top_k: int = 32  # baseline log-probabilities kept per position (compress.evals.divergence: the truncation's error)
    max_mean: float | None = 0.05  # mean KL(baseline ‖ candidate) in nats per token
    min_same_top: float | None = None  # share of positions where both rank the same token first
    full_vocab: bool = False  # exact KL over the whole vocabulary, not top_k's lower bound (a temporary file on disk)


@dataclass
class LmEvalPolicy:
    enabled: bool = True  # run this layer (a layer left out of gate.layers is off too)
    blocking: bool = True  # failed checks block the release (the planned item count decides 3 points: gate.md)
    # public benchmarks shipped with the package (evals/data/<name>): one name, a list judged pooled, or null: none
    benchmark: Any = field(default_factory=lambda: ["arc_easy", "piqa"])
    local_task: bool = False  # the continuation task cut from the evaluation text (a smoke test, not a benchmark)
    tasks: list[str] = field(default_factory=list)  # any lm-eval task names the machine has data for
    include_path: str | None = None  # a folder of the user's own task YAMLs
    limit: int | None = None  # items per task (null: all; arc_easy ships 570)
    batch_size: int = 4  # requests per forward pass
    max_length: int = 512  # tokens of context and continuation kept per request
    max_drop_points: float | None = 3.0  # accuracy drop in points, paired per item; sized on 570 items (gate-power.md)
    # the shipped benchmarks' items are scored as a pilot of this many first, pooled; their discordance plans how
    # many more (stats.planned_items); null: every item (up to limit) at once
    pilot_items: int | None = 200
    power: float = 0.95  # the planned count blocks a drop of max_drop_points with this probability
    max_items: int | None = None  # cap on the planned count over the shipped benchmarks (null: every item shipped)

    @property
    def benchmarks(self) -> list[str]:
        """``benchmark`` as a list: several are judged as one check over all their items pooled (docs/gate.md)."""
        if self.benchmark is None:
            return []
        return [self.benchmark] if isinstance(self.benchmark, str) else list(self.benchmark)


@dataclass
class JsonPolicy:
    enabled: bool = True  # run this layer (a layer left out of gate.layers is off too)
    blocking: bool = False  # failed checks block the release; off: too few items on a CPU (gate-power.md)
    constrained: bool = False  # decode under a JSON grammar (transformers backend): only compliance can drop
    max_new_tokens: int = 64  # tokens generated per reply
    num_prompts: int | None = None  # the first this many of the shipped prompts (null: all ten)
    max_validity_drop_points: float | None = 20.0  # drop in replies that parse as JSON, percentage points
    max_compliance_drop_points: float | None = 20.0  # drop in replies that also match their schema, points
    min_validity: float | None = None  # floor on the candidate's share of valid replies (0 to 1)


@dataclass
class NeedlePolicy:
    enabled: bool = True  # run this layer (a layer left out of gate.layers is off too)
    blocking: bool = False  # failed checks block the release; off: too few items on a CPU (gate-power.md)
    context_lengths: list[int] = field(default_factory=lambda: [256, 512, 1024])  # prompt lengths in tokens
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])  # where the key sits, 0 to 1
    trials: int = 2  # seeded prompts per length and depth
    max_drop_points: float | None = 10.0  # drop in retrieval accuracy, percentage points
    min_accuracy: float | None = None  # floor on the candidate's retrieval accuracy (0 to 1)


@dataclass
class LongContextPolicy:
    """Multi-hop synthetic tasks (``compress.evals.long_context``), run with the candidate's KV-cache dtype."""

    enabled: bool = True  # run this layer (a layer left out of gate.layers is off too)
    blocking: bool = False  # failed checks block the release; off: too few items on a CPU (gate-power.md)
    context_lengths: list[int] = field(default_factory=lambda: [512, 1024])  # prompt lengths in tokens
    # the synthetic tasks (compress.evals.long_context.TASKS)
    tasks: list[str] = field(default_factory=lambda: ["variable_tracking", "multi_key", "frequent_words"])
    trials: int = 3  # seeded prompts per task and length
    max_drop_points: float | None = 10.0  # drop in each task's accuracy, percentage points


@dataclass
class LatencyPolicy:
    """``blocking: auto`` (the default) decides on a GPU and only reports on a CPU, where a shared machine's speed
    drifts more than the limit (:func:`resolve_blocking`); ``true``/``false`` say so whatever the device."""

    enabled: bool = True  # run this layer (a layer left out of gate.layers is off too)
    blocking: Any = "auto"  # true | false | auto (blocks on a GPU, reports only on a CPU)
    prompt_tokens: int = 128  # prompt length, cut from the evaluation text
    new_tokens: int = 16  # tokens generated per timed request (at least 2)
    repeats: int = 7  # timed requests per side
    warmup: int = 1  # untimed requests per side first
    max_ttft_ratio: float | None = None  # candidate time to first token ≤ this × the baseline's
    max_tpot_ratio: float | None = 1.05  # candidate time per output token ≤ this × the baseline's


@dataclass
class RegistryPolicy:
    """Read by the caller that records the verdict (``compress.app.tracking.record_verdict``), validated here."""

    register: bool = True  # register a passing candidate as a new version in MLflow's model registry
    name: str | None = None  # default: compress-<baseline name>
    promote: bool = False  # also move the ``champion`` alias to the new version


@dataclass
class GatePolicy:
    enabled: bool = True  # run the gate after the compression (`compress run`)
    enforce: bool = False  # `compress run` exits 1 (block) / 3 (inconclusive) only when true (the gate command always)
    layers: list[str] = field(default_factory=lambda: list(LAYER_ORDER))  # the layers run, in this order
    confidence: float = 0.95  # confidence level of every interval a verdict is read from
    familywise: bool = True  # a BLOCK is read at the Bonferroni level over the blocking checks (stats.py)
    # texts the perplexity and KL layers judge besides the evaluation one (compress.base.data.domain_panel)
    domains: list[str] = field(default_factory=lambda: ["code", "technical"])
    decide: bool = False  # an INCONCLUSIVE perplexity/KL verdict scores more windows until decided (up to a cap)
    backend: str = "auto"  # generates for needle, JSON, long context: auto (engine if installed), engine, transformers
    engine: EngineConfig = field(default_factory=EngineConfig)  # the engine backend's settings (compress.engine)
    kv_cache_dtype: str | None = None  # null: the candidate's kv_cache_scheme, else the model dtype
    seed: int = 0  # seeds the generated prompts of the needle and long-context layers
    models_in_memory: int = 1  # 1: baseline measured and freed before the candidate loads; 2: both, latency interleaved
    experiment: str = "compress"  # MLflow experiment of gate-only runs (read by compress.commands.gate)
    cache_dir: str | None = None  # baseline references for the KL layer (null: <artifacts>/cache/gate-references)
    perplexity: PerplexityPolicy = field(default_factory=PerplexityPolicy)  # perplexity ratio on the evaluation text
    kl: KLPolicy = field(default_factory=KLPolicy)  # KL divergence of the next-token distributions
    lm_eval: LmEvalPolicy = field(default_factory=LmEvalPolicy)  # accuracy on lm-eval tasks, paired per item
    json: JsonPolicy = field(default_factory=JsonPolicy)  # valid and schema-compliant JSON replies
    needle: NeedlePolicy = field(default_factory=NeedlePolicy)  # retrieving a key hidden in a long prompt
    long_context: LongContextPolicy = field(default_factory=LongContextPolicy)  # multi-hop synthetic tasks
    latency: LatencyPolicy = field(default_factory=LatencyPolicy)  # time to first token and per output token
    registry: RegistryPolicy = field(default_factory=RegistryPolicy)  # what happens to a passing candidate


BLOCKING_AUTO = "auto"


def resolve_blocking(blocking: bool | str, device: str | None) -> bool:
    """Whether a layer decides the verdict: an explicit ``true``/``false`` wins; ``auto`` blocks unless the candidate
    runs on a CPU (``device``, a torch device type), where the layer is advisory (reported, never deciding). A device
    not known blocks: an undecided role must not let a regression through."""
    if isinstance(blocking, bool):
        return blocking
    return device != "cpu"


def resolve_policy(policy: dict | GatePolicy | None) -> GatePolicy:
    """``policy`` (e.g. ``cfg.gate``) over the defaults; unknown keys and wrong types are user errors."""
    resolved = typed(GatePolicy, policy, "gate")
    if resolved.models_in_memory not in (1, 2):
        raise CompressError(f"gate.models_in_memory={resolved.models_in_memory}; use 1 (one model at a time) or 2")
    unknown = [layer for layer in resolved.layers if layer not in LAYER_ORDER]
    if unknown:
        raise CompressError(f"gate.layers has unknown layers {unknown}; choose from {LAYER_ORDER}")
    if resolved.backend not in BACKENDS:
        raise CompressError(f"gate.backend={resolved.backend!r} is unknown; use {', '.join(BACKENDS)}")
    engine_kv = resolved.engine.kv_cache_dtype
    if engine_kv != "auto":
        raise CompressError(
            f"gate.engine.kv_cache_dtype={engine_kv}: the gate's KV-cache dtype is one key for both backends; "
            f"set gate.kv_cache_dtype={engine_kv} instead"
        )
    from compress.evals.long_context import TASKS

    unknown_tasks = sorted(set(resolved.long_context.tasks) - set(TASKS))
    if unknown_tasks:
        raise CompressError(f"gate.long_context.tasks has unknown tasks {unknown_tasks}; choose from {list(TASKS)}")
    from compress.base.data import domain_panel

    unknown_domains = sorted(set(resolved.domains) - set(domain_panel()))
    if unknown_domains:
        raise CompressError(f"gate.domains has unknown domains {unknown_domains}; choose from {list(domain_panel())}")
    blocking = resolved.latency.blocking
    if not isinstance(blocking, bool) and blocking != BLOCKING_AUTO:
        raise CompressError(f"gate.latency.blocking={blocking!r}; use true, false or auto (blocking on a GPU only)")
    from compress.evals.lm_eval_tasks import shipped_benchmarks

    benchmark = resolved.lm_eval.benchmark
    names = [benchmark] if isinstance(benchmark, str) else benchmark
    if benchmark is not None and not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        raise CompressError(f"gate.lm_eval.benchmark={benchmark!r}; use a name, a list of names or null")
    for name in resolved.lm_eval.benchmarks:
        if name not in shipped_benchmarks():
            raise CompressError(
                f"gate.lm_eval.benchmark={name!r} is not shipped; choose from {shipped_benchmarks()} or null "
                "(other lm-eval tasks go in gate.lm_eval.tasks)"
            )
    if len(set(resolved.lm_eval.benchmarks)) != len(resolved.lm_eval.benchmarks):
        raise CompressError(f"gate.lm_eval.benchmark={benchmark!r} names a benchmark twice")
    _check_item_plan(resolved.lm_eval)
    if not 0.5 <= resolved.confidence < 1:
        raise CompressError(f"gate.confidence={resolved.confidence}; use a level in [0.5, 1), e.g. 0.95")
    windows, cap = resolved.perplexity.max_windows, resolved.perplexity.decide_max_windows
    if windows is not None and windows < 2:
        raise CompressError(f"gate.perplexity.max_windows={windows}; an interval needs at least 2 windows")
    if cap is not None and windows is not None and cap < windows:
        raise CompressError(f"gate.perplexity.decide_max_windows={cap} is below max_windows={windows}; raise it")
    return resolved


def _check_item_plan(policy: LmEvalPolicy) -> None:
    """The pilot and planned item counts of the lm_eval layer are ones it can act on."""
    pilot, cap = policy.pilot_items, policy.max_items
    if pilot is not None and pilot < 10:
        raise CompressError(f"gate.lm_eval.pilot_items={pilot}; use at least 10 (e.g. 200) or null (no pilot)")
    if pilot is not None and not policy.benchmarks:
        raise CompressError("gate.lm_eval.pilot_items needs gate.lm_eval.benchmark (the pilot plans shipped items)")
    if pilot is not None and policy.max_drop_points is None:
        raise CompressError("gate.lm_eval.pilot_items plans for gate.lm_eval.max_drop_points: set it, or pilot null")
    if not 0.5 <= policy.power < 1:
        raise CompressError(f"gate.lm_eval.power={policy.power}; use a probability in [0.5, 1), e.g. 0.8")
    if cap is not None and (cap < 1 or (pilot is not None and cap < pilot)):
        raise CompressError(
            f"gate.lm_eval.max_items={cap}; use null or a count of at least {pilot or 1} (gate.lm_eval.pilot_items)"
        )


def policy_dict(policy: GatePolicy) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(policy))


WINDOW_LAYERS = ("perplexity", "kl")


def blocking_checks(policy: GatePolicy, selected: list[str]) -> int:
    """How many blocking checks the gate may run: the family a BLOCK's level is shared over (every limit set on a
    selected, enabled, blocking layer; one accuracy check per lm-eval task and per long-context task; each panel
    domain its own perplexity and KL checks). Counting a check that ends up not judged only makes the level stricter."""
    limits = {
        "perplexity": ("max_ratio", "max_value"),
        "kl": ("max_mean", "min_same_top"),
        "json": ("max_validity_drop_points", "max_compliance_drop_points", "min_validity"),
        "needle": ("max_drop_points", "min_accuracy"),
        "latency": ("max_ttft_ratio", "max_tpot_ratio"),
    }
    count = 0
    for name in selected:
        layer = getattr(policy, name)
        if not (layer.enabled and layer.blocking):
            continue
        if name in WINDOW_LAYERS:
            count += sum(getattr(layer, key) is not None for key in limits[name]) * (1 + len(policy.domains))
        elif name == "lm_eval":
            tasks = bool(layer.benchmarks) + int(layer.local_task) + len(layer.tasks)  # benchmarks: one, pooled
            count += tasks * (layer.max_drop_points is not None)
        elif name == "long_context":
            count += len(layer.tasks) * (layer.max_drop_points is not None)
        else:
            count += sum(getattr(layer, key) is not None for key in limits[name])
    return max(1, count)
