"""Inference engine: paged (optionally quantized) KV cache, continuous batching, chunked prefill, prefix cache.

``LLM(model_or_path).generate(prompts, SamplingParams(...))``; see docs/engine.md.
"""

from compress.engine.engine_config import EngineConfig
from compress.engine.llm import LLM, RequestOutput, StreamEvent
from compress.engine.sequence import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams", "StreamEvent"]
