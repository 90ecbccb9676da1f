"""compress: LLM compression with release gates.

``from compress import oneshot`` compresses a model with a recipe and returns the checkpoint folder (see
``compress.api``); ``python -m compress run ...`` adds evaluation, the release gate and MLflow tracking. The
import is lazy so that ``import compress.engine`` on a bare GPU box pulls in nothing of the pipeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from compress.api import oneshot

__all__ = ["oneshot"]


def __getattr__(name: str) -> Any:
    if name == "oneshot":
        from compress.api import oneshot

        return oneshot
    raise AttributeError(f"module 'compress' has no attribute {name!r}")
