"""Runs a Llama-family transformers model over the paged KV cache.

The model's own modules do the work (embeddings, RMSNorms, ``q/k/v/o_proj``, the MLP, ``lm_head``, the rotary
embedding), so a checkpoint whose linears are ``QuantizedLinear`` runs its quantized kernels unchanged. Only
attention is ours: new K/V go into the paged cache, queries attend over it. All scheduled tokens of all sequences
run as one packed batch, without padding; logits are computed only for the rows that sample a token.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from compress.engine.config import EngineConfig
from compress.engine.scheduler import ScheduledBatch
from kernels import kv_cache, paged_attention

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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
            raise ValueError(f"model_type {model_config.model_type!r} is not supported; the engine runs "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family) models")
        self.model, self.config = model.eval(), config
        self.embed_tokens, self.layers = model.model.embed_tokens, model.model.layers
        self.norm, self.rotary_emb, self.lm_head = model.model.norm, model.model.rotary_emb, model.lm_head
        self.device, self.dtype = self.embed_tokens.weight.device, self.embed_tokens.weight.dtype
        self.num_heads = model_config.num_attention_heads
        self.num_kv_heads = model_config.num_key_value_heads
        self.head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // self.num_heads
        self.max_model_len = config.max_model_len or min(model_config.max_position_embeddings, 8192)
        self._check_sliding_window(model_config)
        self.kv_dtype = config.kv_dtype
        backend = config.attention_backend
        self._attend = {"auto": paged_attention.paged_attention, "triton": paged_attention.paged_attention_triton,
                        "torch": paged_attention.paged_attention_reference}[backend]
        self._write_kv = {"auto": kv_cache.write_kv, "triton": kv_cache.write_kv_triton,
                          "torch": kv_cache.write_kv_reference}[backend]
        if backend == "triton" and config.block_size < 16:
            raise ValueError(f"block_size={config.block_size}: the Triton kernels need 16 or more")
        self.num_blocks = config.num_kv_blocks or self._blocks_in_budget()
        self._allocate_cache()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_decode_graphs()

    # --- KV cache -------------------------------------------------------------------------------------------
    def _check_sliding_window(self, model_config) -> None:
        window = getattr(model_config, "sliding_window", None)
        uses_window = window is not None and getattr(model_config, "use_sliding_window", True)
        if uses_window and window < self.max_model_len:
            raise ValueError(f"the model uses a {window}-token sliding window, which the engine does not implement; "
                             f"set max_model_len <= {window}")

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
            raise ValueError(f"a KV budget of {budget / 2**30:.2f} GiB holds {num_blocks} blocks, fewer than one "
                             f"{self.max_model_len}-token sequence needs ({needed}); raise kv_cache_memory_gb or "
                             "lower max_model_len")
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
        """Logits ``[len(logits_rows), vocab]`` for a packed batch of ``[tokens]`` ids at ``positions``."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(hidden, positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        num_tokens = input_ids.shape[0]
        for i, layer in enumerate(self.layers):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attention.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
            k = attention.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
            v = attention.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k_cache, v_cache = self.kv_pool[0, i], self.kv_pool[1, i]
            k_scale, v_scale = self.kv_scales[i]
            self._write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
            out = self._attend(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, max_query_len,
                               k_scale, v_scale, attention.scaling)
            hidden = hidden + attention.o_proj(out.view(num_tokens, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.lm_head(self.norm(hidden[logits_rows])).float()

    def prepare(self, batch: ScheduledBatch, all_logits: bool = False) -> dict:
        """Host-side packing of a scheduled batch into the tensors :meth:`forward` takes."""
        block_size = self.config.block_size
        input_ids, positions, slots, context_lens, starts, logits_rows = [], [], [], [], [0], []
        for seq, num_tokens in zip(batch.seqs, batch.num_new_tokens, strict=True):
            first = seq.num_computed_tokens
            span = range(first, first + num_tokens)
            input_ids += seq.token_ids[first:first + num_tokens]
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
            input_ids=tensor(input_ids, torch.long), positions=tensor(positions, torch.long),
            slot_mapping=tensor(slots, torch.long), block_tables=tensor(tables), context_lens=tensor(context_lens),
            query_start_loc=tensor(starts), max_query_len=max(batch.num_new_tokens),
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
        if (getattr(self.model.config, "rope_parameters", None) or {}).get("rope_type") in ("dynamic", "longrope"):
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
                inputs["query_start_loc"] = self.graph_inputs["query_start_loc"][:size + 1]
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
        static["block_tables"][:size, :tables.shape[1]] = tables
        self.graphs[graph_size].replay()
        return self.graph_outputs[graph_size][:size]
