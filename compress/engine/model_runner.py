"""Runs a transformers causal LM over the paged KV cache.

The model's own forward does the work (its embeddings and their scaling, norms, q/k norms, fused or separate
projections, rotary embeddings per layer type, MLPs, final logit soft-capping), so every family transformers
implements runs as transformers defines it, and a checkpoint whose linears are ``QuantizedLinear`` runs its quantized
kernels unchanged. Only attention is ours, plugged in through transformers' ``AttentionInterface``: new K/V go into
the paged cache, queries attend over it. All scheduled tokens of all sequences run as one packed batch
``[1, tokens]`` without padding; logits are computed only for the rows that sample a token (``logits_to_keep``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface

from compress.engine.engine_config import EngineConfig
from compress.engine.fusion import fuse_sibling_projections
from compress.engine.scheduler import ScheduledBatch
from compress.formats import QuantizedLinear
from compress.kernels import kv_cache, paged_attention

log = logging.getLogger(__name__)

# Families whose attention modules call AttentionInterface and whose outputs the tests check against transformers.
SUPPORTED_MODEL_TYPES = (
    *("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"),
    *("mixtral", "qwen2_moe", "qwen3_moe"),  # MoE: fused or per-expert (compressed) experts
)
PAGED_ATTENTION = "compress_paged"
_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass
class PagedStep:
    """One packed step's layout; it reaches every layer's attention as the ``paged_step`` forward kwarg (transformers
    hands unknown forward kwargs down to the attention function), so no global state is needed."""

    runner: ModelRunner
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    paged_step: PagedStep | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query/key/value`` ``[1, heads, tokens, head_dim]`` after RoPE; returns
    ``[1, tokens, heads, head_dim]`` like its sdpa/eager functions. The causal structure comes from ``paged_step``
    (the mask is None: the runner builds none)."""
    if paged_step is None:
        raise RuntimeError(
            f"attention implementation {PAGED_ATTENTION!r} runs only inside compress.engine's "
            "ModelRunner, which passes the step's paged_step"
        )
    return paged_step.runner.attend(
        paged_step, module.layer_idx, query, key, value, scaling, sliding_window, softcap
    ), None


AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)


def static_kv_scales(attention: nn.Module, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Calibrated per-head K/V scales stored on an attention module (compressed-tensors names them
    ``k_scale``/``v_scale``), broadcast to ``[num_kv_heads]``; None when the checkpoint has none."""
    scales = [getattr(attention, name, None) for name in ("k_scale", "v_scale")]
    if any(s is None for s in scales):
        return None
    out = []
    for name, scale in zip(("k_scale", "v_scale"), scales, strict=True):
        scale = scale.detach().float().flatten()
        if scale.numel() not in (1, num_kv_heads):
            raise ValueError(f"{name} has {scale.numel()} values; expected 1 or one per KV head ({num_kv_heads})")
        out.append(scale.expand(num_kv_heads).contiguous())
    return out[0], out[1]


class ModelRunner:
    def __init__(self, model: nn.Module, config: EngineConfig):
        model_config = model.config
        if model_config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_config.model_type!r} is not supported; the engine runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} models"
            )
        if getattr(model_config, "use_bidirectional_attention", False):
            raise ValueError(
                "the model attends bidirectionally (an embedding model); the engine generates with "
                "causal attention only"
            )
        self.model, self.config = model.eval(), config
        self.layers = model.model.layers
        embeddings = model.get_input_embeddings().weight
        self.device, self.dtype = embeddings.device, embeddings.dtype
        for module in model.modules():
            if isinstance(module, QuantizedLinear):  # decoding calls carry a few tokens: dequantize once
                module.keep_dense_on_cpu = self.device.type == "cpu" and config.cpu_dense_weights
        if self.device.type == "cuda" and config.fuse_projections:
            log.info("stacked %d groups of sibling projections", fuse_sibling_projections(model))
        self.num_kv_heads = model_config.num_key_value_heads
        self.head_dim = self.layers[0].self_attn.head_dim
        self.max_model_len = config.max_model_len or min(model_config.max_position_embeddings, 8192)
        self.kv_dtype = config.kv_dtype
        backend = config.attention_backend
        self._attend = {
            "auto": paged_attention.paged_attention,
            "triton": paged_attention.paged_attention_triton,
            "torch": paged_attention.paged_attention_reference,
        }[backend]
        self._write_kv = {
            "auto": kv_cache.write_kv,
            "triton": kv_cache.write_kv_triton,
            "torch": kv_cache.write_kv_reference,
        }[backend]
        if backend == "triton" and config.block_size < 16:
            raise ValueError(f"block_size={config.block_size}: the Triton kernels need 16 or more")
        self.num_blocks = config.num_kv_blocks or self._blocks_in_budget()
        self._allocate_cache()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_decode_graphs()

    # --- KV cache -------------------------------------------------------------------------------------------
    @property
    def quantized_kv(self) -> bool:
        return kv_cache.is_quantized(self.kv_dtype)

    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V, per-token scales included."""
        tokens = 2 * len(self.layers) * self.config.block_size * self.num_kv_heads
        scale_bytes = 4 if self.quantized_kv and self._static_scales() is None else 0
        return tokens * (self.head_dim * self.kv_dtype.itemsize + scale_bytes)

    def _blocks_in_budget(self) -> int:
        if self.config.kv_cache_memory_gb is not None:
            budget = self.config.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * self.config.gpu_memory_utilization
        else:
            budget = 2**30
        num_blocks = int(budget // self.block_bytes())
        needed = -(-self.max_model_len // self.config.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"a KV budget of {budget / 2**30:.2f} GiB holds {num_blocks} blocks, fewer than one "
                f"{self.max_model_len}-token sequence needs ({needed}); raise kv_cache_memory_gb or "
                "lower max_model_len"
            )
        return num_blocks

    def _static_scales(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        per_layer = [static_kv_scales(layer.self_attn, self.num_kv_heads) for layer in self.layers]
        return None if any(s is None for s in per_layer) else per_layer

    def _allocate_cache(self) -> None:
        """One pool for every layer's K and V; per-token scales beside it when no calibrated scales exist."""
        shape = (2, len(self.layers), self.num_blocks, self.config.block_size, self.num_kv_heads, self.head_dim)
        self.kv_pool = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.scale_pool = None
        self.kv_scales: list[tuple[torch.Tensor | None, torch.Tensor | None]]
        static = self._static_scales() if self.quantized_kv else None
        if not self.quantized_kv:
            self.kv_scales = [(None, None)] * len(self.layers)
        elif static is not None:
            self.kv_scales = [(k.to(self.device), v.to(self.device)) for k, v in static]
        else:
            self.scale_pool = torch.ones(shape[:-1], dtype=torch.float32, device=self.device)
            self.kv_scales = [(self.scale_pool[0, i], self.scale_pool[1, i]) for i in range(len(self.layers))]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (all layers, K and V, scales) before a sequence writes them."""
        if not copies:
            return
        source = torch.tensor([s for s, _ in copies], device=self.device)
        destination = torch.tensor([d for _, d in copies], device=self.device)
        self.kv_pool[:, :, destination] = self.kv_pool[:, :, source]
        if self.scale_pool is not None:
            self.scale_pool[:, :, destination] = self.scale_pool[:, :, source]

    # --- forward --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Logits ``[len(logits_rows), vocab]`` for a packed batch of ``[tokens]`` ids at ``positions``: the
        CausalLM's own forward (so its final-logit soft-capping applies) on ``[1, tokens]``, with our attention."""
        step = PagedStep(self, slot_mapping, block_tables, context_lens, query_start_loc, max_query_len)
        with self._paged_attention():
            output = self.model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=logits_rows,
                return_dict=True,
                paged_step=step,
            )
        return output.logits[0].float()

    @contextmanager
    def _paged_attention(self) -> Iterator[None]:
        """Switch the model to our attention for one forward only: the caller's model stays usable on its own
        (``generate``, the gate's evals) with the implementation it had."""
        model_config = self.model.config
        previous = model_config._attn_implementation
        model_config._attn_implementation = PAGED_ATTENTION
        try:
            yield
        finally:
            model_config._attn_implementation = previous

    def attend(
        self,
        step: PagedStep,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """Write one layer's new K/V into the paged cache and attend over it; ``[1, tokens, heads, head_dim]``."""
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [tokens, heads, head_dim] views
        k_cache, v_cache = self.kv_pool[0, layer], self.kv_pool[1, layer]
        k_scale, v_scale = self.kv_scales[layer]
        self._write_kv(k, v, k_cache, v_cache, step.slot_mapping, k_scale, v_scale)
        if sliding_window is not None and sliding_window >= self.max_model_len:
            sliding_window = None  # no sequence is long enough for the window to hide anything
        out = self._attend(
            q,
            k_cache,
            v_cache,
            step.block_tables,
            step.context_lens,
            step.query_start_loc,
            step.max_query_len,
            k_scale,
            v_scale,
            scaling,
            sliding_window,
            softcap,
        )
        return out[None]

    def prepare(self, batch: ScheduledBatch, all_logits: bool = False) -> dict:
        """Host-side packing of a scheduled batch into the tensors :meth:`forward` takes."""
        block_size = self.config.block_size
        input_ids, positions, slots, context_lens, starts, logits_rows = [], [], [], [], [0], []
        for seq, num_tokens in zip(batch.seqs, batch.num_new_tokens, strict=True):
            first = seq.num_computed_tokens
            span = range(first, first + num_tokens)
            input_ids += seq.token_ids[first : first + num_tokens]
            positions += span
            slots += [seq.block_table[p // block_size] * block_size + p % block_size for p in span]
            context_lens.append(first + num_tokens)
            starts.append(starts[-1] + num_tokens)
            if all_logits:
                logits_rows += range(starts[-2], starts[-1])
            elif first + num_tokens == seq.num_tokens:
                logits_rows.append(starts[-1] - 1)
        width = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.seqs]

        def tensor(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, device=self.device)

        return dict(
            input_ids=tensor(input_ids, torch.long),
            positions=tensor(positions, torch.long),
            slot_mapping=tensor(slots, torch.long),
            block_tables=tensor(tables),
            context_lens=tensor(context_lens),
            query_start_loc=tensor(starts),
            max_query_len=max(batch.num_new_tokens),
            logits_rows=tensor(logits_rows, torch.long),
        )

    def execute(self, batch: ScheduledBatch, all_logits: bool = False) -> torch.Tensor:
        """Run one scheduled step; logits of the rows that sample (or of every row, for scoring)."""
        self.copy_blocks(batch.block_copies)
        inputs = self.prepare(batch, all_logits)
        size = len(batch.seqs)
        if batch.is_decode_only and not all_logits and self.graphs:
            graph_size = next((b for b in self.graphs if b >= size), None)
            if graph_size is not None:
                return self._replay(graph_size, inputs, size)
        return self.forward(**inputs)

    # --- CUDA graphs for decode -----------------------------------------------------------------------------
    def _capture_decode_graphs(self) -> None:
        """Capture one decode step per batch size, on static buffers padded to the longest block table; a
        failure leaves the engine eager (slower, same results)."""
        if rope_recomputed_on_host(self.model.config):
            log.warning("rope type recomputes frequencies on the host; decoding without CUDA graphs")
            return
        max_size = self.config.max_num_seqs
        width = -(-self.max_model_len // self.config.block_size)
        device = self.device
        self.graph_inputs = dict(
            input_ids=torch.zeros(max_size, dtype=torch.long, device=device),
            positions=torch.zeros(max_size, dtype=torch.long, device=device),
            slot_mapping=torch.full((max_size,), -1, dtype=torch.long, device=device),
            block_tables=torch.zeros(max_size, width, dtype=torch.int32, device=device),
            context_lens=torch.zeros(max_size, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(max_size + 1, dtype=torch.int32, device=device),
            logits_rows=torch.arange(max_size, dtype=torch.long, device=device),
        )
        self.graph_outputs: dict[int, torch.Tensor] = {}
        pool = None
        try:
            for size in sorted((b for b in _GRAPH_BATCH_SIZES if b <= max_size), reverse=True):
                inputs = {name: t[:size] for name, t in self.graph_inputs.items()}
                inputs["query_start_loc"] = self.graph_inputs["query_start_loc"][: size + 1]
                self.forward(**inputs, max_query_len=1)  # warm up: compile kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.graph_outputs[size] = self.forward(**inputs, max_query_len=1)
                pool = graph.pool()
                self.graphs[size] = graph
        except RuntimeError as error:
            log.warning("CUDA graph capture failed (%s); decoding eagerly", error)
            self.graphs.clear()
        self.graphs = dict(sorted(self.graphs.items()))

    def _replay(self, graph_size: int, inputs: dict, size: int) -> torch.Tensor:
        static = self.graph_inputs
        static["slot_mapping"].fill_(-1)
        static["context_lens"].zero_()
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            static[name][:size] = inputs[name]
        tables = inputs["block_tables"]
        static["block_tables"][:size, : tables.shape[1]] = tables
        self.graphs[graph_size].replay()
        return self.graph_outputs[graph_size][:size]


def rope_recomputed_on_host(model_config) -> bool:
    """Whether a rotary embedding recomputes its frequencies from host-read positions (dynamic NTK, LongRoPE), which
    a CUDA graph would freeze; ``rope_parameters`` is flat, or keyed by layer type (Gemma-3)."""
    parameters = getattr(model_config, "rope_parameters", None) or {}
    per_type = [p for p in parameters.values() if isinstance(p, dict)]
    return any(p.get("rope_type") in ("dynamic", "longrope") for p in [parameters, *per_type])
