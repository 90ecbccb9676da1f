"""A transformers KV cache for a decode of known length: every layer's keys and values are written into buffers sized
once, and attention reads the filled prefix as a view.

Why: transformers' ``DynamicCache`` grows by ``torch.cat``, copying each layer's whole cache at every decode step, so
the calibration sampler's loop (``compress.model.calibration_set``) spent a quarter of a step copying at 160 tokens
and more after (profiled on the default model, 16 windows, one thread). The view holds the same keys and values as
the concatenation, so attention computes the same numbers and the sampled windows stay bit-identical
(tests/compress/test_decode_cache.py), which keeps the windows cached before valid. Sliding-window layers keep
transformers' own (they drop old tokens, which a fixed buffer does not). Imports only torch and transformers.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose states live in a buffer of ``capacity`` tokens, allocated at the first update."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_buffer = key_states.new_empty((*key_states.shape[:2], self.capacity, key_states.shape[3]))
        self.value_buffer = value_states.new_empty((*value_states.shape[:2], self.capacity, value_states.shape[3]))
        self.keys, self.values = self.key_buffer[:, :, :0], self.value_buffer[:, :, :0]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"the decode cache holds {self.capacity} tokens; this step would make it {end}")
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values


def preallocated_cache(config: PretrainedConfig, capacity: int) -> DynamicCache:
    """transformers' cache for ``config`` (its layer types), each full-attention layer holding ``capacity`` tokens."""
    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
