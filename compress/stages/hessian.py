"""The layer-input Hessian H = E[x xᵀ] that GPTQ and SparseGPT both solve against, gathered and inverted once here.

Both algorithms minimise ‖(W' - W) X‖² column by column and need the same three things: the second moment of a
linear's input over the calibration tokens, a dampened positive-definite copy of it, and the upper Cholesky factor
of its inverse. The papers write H = 2/n Σ x xᵀ; the factor 2 is dropped here because every use (the error
compensation ratios Hinv[i, j] / Hinv[i, i], the clipping search's argmin, the relative error) is invariant to the
scale of H, and dampening is relative to mean(diag H).

A Hessian belongs to an *input*, not to a linear: linears that read the same activations (q/k/v, gate/up) share
one, so :func:`input_groups` names one leader per input and :func:`collect_hessians` accumulates only what it is
asked for, in one forward over the calibration batches; :func:`sequential_hessians` yields them group by group for
the true-sequential mode, recomputing only the inputs of later groups.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from compress.base import distributed
from compress.base.errors import CompressError
from compress.formats.moe_experts import all_tokens_through_experts
from compress.model.layer_walk import LayerInputs, _StopForward, checked_output, observe_inputs
from compress.stages.base import FORWARD_EFFICIENCY, FP32_BYTES, LayerContext, LayerWork

log = logging.getLogger(__name__)

# Linears reading the same input, by name within their parent module, processed as one stacked matrix; the groups run
# in this order inside a decoder layer. Phi-3's fused qkv_proj / gate_up_proj take their unfused counterparts' places
# (a layer holds one form or the other); w1/w3/w2 are a Mixtral expert's gate/up/down. Each MoE expert (and shared
# expert) is its own parent: its gate/up share an input, other experts' do not (they see other tokens at run time).
SEQUENTIAL_GROUPS = (
    ("q_proj", "k_proj", "v_proj", "qkv_proj"),
    ("o_proj",),
    ("gate_proj", "up_proj", "gate_up_proj", "w1", "w3"),
    ("down_proj", "w2"),
)


def input_groups(targets: list[str] | dict) -> list[list[str]]:
    """``targets`` split into groups of siblings that share an input, in forward order (attention, output, every
    expert's gate/up, every expert's down); a linear no group names (a family with extra linears) is a group of its
    own, after the known ones. Each group's first name is its Hessian's key."""
    groups: dict[tuple[int, str], list[str]] = {}
    for name in targets:
        parent, _, leaf = name.rpartition(".")
        row = next((index for index, row in enumerate(SEQUENTIAL_GROUPS) if leaf in row), None)
        groups.setdefault((row, parent) if row is not None else (len(SEQUENTIAL_GROUPS), name), []).append(name)
    ordered = sorted(groups.items(), key=lambda item: item[0][0])  # stable: module order within a row
    return [sorted(names, key=_position(ordered_row)) for (ordered_row, _), names in ordered]


def _position(row: int):
    """Sort key putting a group's names in their ``SEQUENTIAL_GROUPS`` order (q, k, v; gate, up)."""
    names = SEQUENTIAL_GROUPS[row] if row < len(SEQUENTIAL_GROUPS) else ()
    return lambda name: names.index(name.rpartition(".")[2]) if names else 0


HESSIAN_BLOCK = 256  # rows of Σ x xᵀ per product: smaller blocks skip more of the lower triangle, larger run faster


class HessianAccumulator:
    """Running Σ x xᵀ (or only its diagonal, Σ x², when ``diagonal``: Wanda's channel norms) over the tokens seen."""

    def __init__(self, diagonal: bool = False):
        self.diagonal = diagonal
        self.total: torch.Tensor | None = None
        self.tokens = 0
        self.calls = 0  # batches seen (sequential_hessians numbers them for its observer)

    def add(self, x: torch.Tensor) -> None:
        """One batch of inputs ``[tokens, in]`` (fp32)."""
        if self.total is None:
            shape = (x.shape[1],) if self.diagonal else (x.shape[1], x.shape[1])
            self.total = torch.zeros(shape, dtype=x.dtype, device=x.device)
        if self.diagonal:
            self.total += x.pow(2).sum(0)
        else:  # in place, and only the blocks on and above the diagonal: a quarter fewer products
            for start in range(0, x.shape[1], HESSIAN_BLOCK):
                rows = slice(start, start + HESSIAN_BLOCK)
                self.total[rows, start:].addmm_(x[:, rows].T, x[:, start:])
        self.tokens += x.shape[0]

    def finite(self) -> bool:
        """False when an input held NaN/inf (or squared past fp32): Σ x² on the diagonal is then not finite."""
        total = self.total if self.diagonal else self.total.diagonal()
        return bool(torch.isfinite(total).all())

    def all_reduce(self) -> None:
        """Sum the running totals over the data-parallel ranks (each saw its own shard of the tokens)."""
        distributed.all_reduce_sum(self.total)
        self.tokens = distributed.sum_count(self.tokens, self.total.device)

    def hessian(self) -> torch.Tensor:
        """E[x xᵀ] (or E[x²] per channel): the blocks below the diagonal are filled from those above it."""
        if not self.diagonal:
            width = self.total.shape[0]
            for start in range(HESSIAN_BLOCK, width, HESSIAN_BLOCK):
                self.total[start:, start - HESSIAN_BLOCK : start] = self.total[start - HESSIAN_BLOCK : start, start:].T
        return self.total / self.tokens


@torch.no_grad()
def collect_hessians(
    ctx: LayerContext, names: list[str], stop_at: str | None, diagonal: bool = False
) -> dict[str, torch.Tensor]:
    """Run the layer on its calibration inputs and return E[x xᵀ] (E[x²] when ``diagonal``) of each named linear's
    input; the forward stops at ``stop_at`` once that module's input has been seen (nothing after it is needed).
    Name one linear per shared input (a group leader from :func:`input_groups`): the others would be identical."""
    accumulators = {name: HessianAccumulator(diagonal) for name in names}
    observe_inputs(ctx.layer, ctx.inputs, ctx.name, {n: a.add for n, a in accumulators.items()}, stop_after=stop_at)
    for name, accumulator in accumulators.items():
        if accumulator.total is None:
            raise CompressError(
                f"{ctx.name}.{name}: no calibration token reached this linear's input (the forward stopped at "
                f"{stop_at} or never called it); gather its Hessian without stopping before it"
            )
        accumulator.all_reduce()
    return {name: accumulator.hessian() for name, accumulator in accumulators.items()}


@dataclass
class _Scope:
    """One scope of a decoder layer (``self_attn``, ``mlp``: the first part of its linears' names): what it was
    called with in each calibration batch while a group inside it was gathered, and, once its last linear is final,
    what it returns in each batch, so that later forwards need not run it."""

    calls: list[tuple[tuple, dict]] = field(default_factory=list)
    outputs: list | None = None


def _scope_of(name: str) -> str | None:
    head, dot, _ = name.partition(".")
    return head if dot else None


def _first(output):
    return output if isinstance(output, torch.Tensor) else output[0]


def _with_first(output, value: torch.Tensor):
    return value if isinstance(output, torch.Tensor) else type(output)((value, *output[1:]))


def _run_batches(module, calls, layer, scopes: dict[str, _Scope], pre: dict) -> list:
    """``module(*args, **kwargs)`` per call with the given forward pre-hooks on ``layer``'s submodules; scopes whose
    outputs are final return them instead of running. Returns what each call returned (None where a hook stopped
    it)."""
    final = {name: scope.outputs for name, scope in scopes.items() if scope.outputs is not None}
    handles = [layer.get_submodule(n).register_forward_pre_hook(fn, with_kwargs=True) for n, fn in pre.items()]
    results = []
    try:
        for index, (args, kwargs) in enumerate(calls):
            for name, outputs in final.items():
                layer.get_submodule(name).forward = lambda *_a, _output=outputs[index], **_k: _output
            try:
                results.append(module(*args, **kwargs))
            except _StopForward:
                results.append(None)
    finally:
        for handle in handles:
            handle.remove()
        for name in final:
            layer.get_submodule(name).__dict__.pop("forward", None)
    return results


@torch.no_grad()
def sequential_hessians(
    ctx: LayerContext,
    groups: list[list[str]],
    diagonal: bool = False,
    observer: Callable[[str, int, torch.Tensor], None] | None = None,
) -> Iterator[tuple[list[str], torch.Tensor]]:
    """True-sequential statistics: yields each input group with the E[x xᵀ] (E[x²] when ``diagonal``) of its input,
    gathered after the caller has processed (quantized, pruned) every group yielded before; once the caller is done
    with the last group, the layer's outputs on the calibration inputs are in ``ctx.outputs``.

    Only the inputs of later groups are recomputed, not whole layers: a group inside a scope already entered
    (down_proj after gate/up) reruns that scope alone from its recorded inputs; a scope whose last linear returns
    the scope's output (o_proj of the attention) is not run again once that linear is final, its outputs are the
    linear applied to its recorded input; every forward stops before the first module it does not need. Before,
    each group cost one forward of the layer up to (and through) its linear, and the layer one more.

    ``observer(leader, batch, x)`` also hears each group's input per calibration batch (``[tokens, in]`` fp32)."""
    layer = ctx.layer
    layer_calls = [((hidden,), kwargs) for hidden, kwargs in zip(ctx.inputs.hidden, ctx.inputs.kwargs, strict=True)]
    scopes: dict[str, _Scope] = {}
    for position, group in enumerate(groups):
        leader, scope_name = group[0], _scope_of(group[0])
        accumulator = HessianAccumulator(diagonal)
        scope = scopes.get(scope_name)
        last_of_scope = scope_name is not None and all(_scope_of(g[0]) != scope_name for g in groups[position + 1 :])
        replay = scope is not None and bool(scope.calls)
        linear = layer.get_submodule(leader)
        keep = replay and last_of_scope and len(group) == 1 and _worth_keeping(linear, ctx.inputs)
        kept_inputs, linear_outputs = [], []

        def observe(_module, args, kwargs, accumulator=accumulator, keep=keep, kept=kept_inputs, leader=leader):
            x = args[0] if args else kwargs["input"]
            flat = x.reshape(-1, x.shape[-1]).float()
            if observer is not None:
                observer(leader, accumulator.calls, flat)
            accumulator.calls += 1
            accumulator.add(flat)
            if not keep:
                raise _StopForward
            kept.append(x)

        pre = {leader: observe}
        if keep:  # the scope's output is rebuilt from the kept inputs once the linear is final: skip its product now
            linear.forward = lambda x, outs=linear_outputs, width=linear.out_features: _stand_in(x, width, outs)
        if replay:
            module, calls = layer.get_submodule(scope_name), scope.calls
        else:
            module, calls = layer, layer_calls
            if scope_name is not None:
                scope = scopes[scope_name] = _Scope()
                pre[scope_name] = lambda _m, args, kwargs, calls=scope.calls: calls.append((args, kwargs))
        try:
            with all_tokens_through_experts(layer):
                returned = _run_batches(module, calls, layer, scopes, pre)
        finally:
            linear.__dict__.pop("forward", None)
        if accumulator.total is None:
            raise CompressError(
                f"{ctx.name}.{leader}: no calibration token reached this linear's input; the layer never calls it"
            )
        if not accumulator.finite():
            raise CompressError(
                f"{ctx.name}.{leader}: calibration activations hold NaN/inf; check the model weights, the "
                "calibration text and earlier stages"
            )
        accumulator.all_reduce()
        yield group, accumulator.hessian()
        if last_of_scope:
            scope.calls = []  # nothing later reruns this scope
        if keep and all(
            _first(output) is linear_output for output, linear_output in zip(returned, linear_outputs, strict=True)
        ):
            final = layer.get_submodule(leader)  # the caller may have replaced it
            scope.outputs = [_with_first(o, final(x)) for o, x in zip(returned, kept_inputs, strict=True)]
        for held in (kept_inputs, linear_outputs, returned):  # activations: free them before the next forward
            held.clear()
    outputs = _run_batches(layer, layer_calls, layer, scopes, {})
    ctx.outputs = LayerInputs([checked_output(_first(o), ctx.name) for o in outputs], ctx.inputs.kwargs)


KEPT_INPUT_BYTES = 256 * 2**20  # a linear's inputs over all calibration tokens kept to skip rerunning its scope


def _worth_keeping(linear: nn.Module, inputs: LayerInputs) -> bool:
    """Keep a scope's last linear's inputs (to rebuild the scope's output from them once the linear is final) when
    they cost no more than the scope's output would, or fit in ``KEPT_INPUT_BYTES``: otherwise the scope (the whole
    MLP for down_proj) runs a second time. A 4B model's down_proj inputs over 64x512 tokens are 1.8 GB in fp32."""
    tokens = sum(hidden.numel() // hidden.shape[-1] for hidden in inputs.hidden)
    width = linear.in_features
    return width <= linear.out_features or tokens * width * inputs.hidden[0].element_size() <= KEPT_INPUT_BYTES


def _stand_in(x: torch.Tensor, width: int, outputs: list) -> torch.Tensor:
    """What a kept linear returns while its inputs are observed: zeros of its output's shape, recorded to check
    that the scope returns it untouched (then its real output is computed once, from the final weights). One zero
    broadcast to that shape: it is compared by identity, never read, and a scope that writes to it in place fails
    loudly instead of returning a stand-in it changed."""
    output = x.new_zeros(()).expand(*x.shape[:-1], width)
    outputs.append(output)
    return output


def without_dead_channels(weight: torch.Tensor, hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``weight [out, in]`` and ``hessian [in, in]`` where inputs that never fire (zero diagonal) get a unit
    diagonal, keeping H invertible, and zero weights, since any value there is exact. Copies only when there are
    such inputs (or a cast): the callers never write to either, and each copy of a 4B model's down_proj Hessian is
    268 MB."""
    W, H = weight.detach().float(), hessian.detach().float()
    dead = H.diagonal() == 0
    if dead.any():
        W, H = W.clone(), H.clone()
        H[dead, dead] = 1.0
        W[:, dead] = 0.0
    return W, H


def cholesky_inverse_upper(
    hessian: torch.Tensor, dampening: float, max_retries: int, name: str
) -> tuple[torch.Tensor, float, int]:
    """``(upper Cholesky factor of (H + λI)⁻¹, the dampening used, retries)`` with λ = dampening · mean(diag H);
    raises the dampening ×10 and retries when H is not positive definite (rank-deficient calibration data,
    duplicated channels, float round-off)."""
    mean_diag = hessian.diagonal().mean().item()
    damp = dampening
    for attempt in range(max_retries + 1):
        # With J the order reversal and J H J = L Lᵀ, H⁻¹ = (J L⁻¹ J)ᵀ (J L⁻¹ J) and J L⁻¹ J is upper triangular
        # with a positive diagonal: the factor wanted, from one Cholesky and one triangular inverse (2.5x faster
        # than inverting H and factorizing the inverse). At most two [in, in] matrices exist at once besides H
        # (five did: 1.3 GB for a 4B model's down_proj): J H J is one copy, damped on its diagonal in place, and
        # the triangular solve overwrites the identity it starts from.
        reversed_h = hessian.flip(0, 1)
        reversed_h.diagonal().add_(damp * mean_diag)
        factor, info = torch.linalg.cholesky_ex(reversed_h)
        del reversed_h
        if info.item() == 0:
            inverse = torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device)
            torch.linalg.solve_triangular(factor, inverse, upper=False, out=inverse)
            del factor
            upper = inverse.flip(0, 1)
            del inverse
            if torch.isfinite(upper).all():
                return upper, damp, attempt
        if attempt < max_retries:
            log.warning(
                "%s: Hessian not positive definite at dampening %.3g; retrying with %.3g", name, damp, damp * 10
            )
            damp *= 10
    raise CompressError(
        f"{name}: the Hessian stayed singular after {max_retries} dampening increases (last {damp:.3g}); "
        "use more or more varied calibration samples, or raise `dampening`/`max_damp_retries`"
    )


@contextmanager
def one_thread():
    """For the GPTQ and SparseGPT column walks: thousands of tiny ops, where with several threads each one pays a
    synchronisation that costs more than the op (measured 5x slower on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


COLUMN_SECONDS = 1e-4  # the column walk (GPTQ, SparseGPT): a handful of small tensor calls per column


def hessian_walk_bytes(work: LayerWork) -> float:
    """The peak of a Hessian-compensated stage beyond the layer (GPTQ, SparseGPT): H, its inverse and the Cholesky
    factor of the widest input, and working copies of the largest stacked weight (gate/up) while compensating."""
    return 3 * work.widest * work.widest * FP32_BYTES + 4 * 2 * work.largest * FP32_BYTES


def hessian_walk_seconds(work: LayerWork) -> float:
    """Hessians (one per input: q/k/v and gate/up share theirs), the Cholesky factors and the column walk, whose
    per-column tensor calls (``COLUMN_SECONDS`` each column) outweigh its arithmetic at these widths."""
    shared = 4 / 7  # a dense layer's 7 linears read 4 distinct inputs (q/k/v and gate/up share theirs)
    hessians = sum(shared * work.tokens * i * i + i**3 for _, i in work.linears) / (work.rate * FORWARD_EFFICIENCY)
    columns = sum(i for _, i in work.linears) * COLUMN_SECONDS
    return hessians + columns
