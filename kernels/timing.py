"""GPU time of one call, measured from CUDA-graph replays.

A Python launch of a small kernel costs tens of microseconds on the host; timed eagerly, a 5 us GEMV reads as
the host's launch time, and an autotuner picks tiles at random. The engine decodes through CUDA graphs, so
graph replays are also the honest measure: capture the call once, then time replays (``do_bench``: median,
L2 flushed before each replay, which also gives the host time to enqueue the next replay).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class NotCapturable(RuntimeError):
    """The call cannot be captured in a CUDA graph (``graph_time_ms(..., eager_fallback=False)``)."""


def graph_time_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100, eager_fallback: bool = True) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph; eager timing if the call cannot be captured, or
    :class:`NotCapturable` without ``eager_fallback`` (a comparison that must time everything the same way).
    ``fn`` runs once before the capture (compilation, autotuning, allocator warm-up stay outside)."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as error:
        if not eager_fallback:
            raise NotCapturable(str(error)) from error
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")
