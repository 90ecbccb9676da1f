"""Which implementation an op runs: the Triton kernel or its plain-torch reference.

Rules (first match wins):
1. ``use_backend("reference"|"triton")`` context manager, innermost first;
2. the ``COMPRESS_KERNELS`` environment variable (``auto`` | ``reference`` | ``triton``, read at call time);
3. ``auto``: CUDA tensors run Triton, CPU tensors run the reference. Under ``TRITON_INTERPRET=1`` CPU tensors
   still run the reference unless Triton is forced, so suites that merely set the interpreter stay fast.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "reference", "triton")
ENV_VAR = "COMPRESS_KERNELS"

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("compress_kernels_backend", default=None)


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (must be set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source} must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force every op inside the block onto one backend (e.g. to compare kernel and reference logits)."""
    token = _forced.set(_check(name, "use_backend()"))
    try:
        yield
    finally:
        _forced.reset(token)


def requested_backend() -> str:
    forced = _forced.get()
    if forced is not None:
        return forced
    return _check(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR)


def triton_can_run(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpreter_active())


def choose_backend(device: torch.device, kernel_supports_input: bool = True, why_not: str = "") -> str:
    """``"triton"`` or ``"reference"`` for ``device``; a forced ``triton`` that cannot run raises."""
    requested = requested_backend()
    if requested == "reference":
        return "reference"
    if requested == "auto":
        return "triton" if device.type == "cuda" and kernel_supports_input else "reference"
    if not triton_can_run(device):
        raise RuntimeError(
            f"{ENV_VAR}=triton needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported "
            f"to run the kernels on CPU; got a {device.type} tensor. Use {ENV_VAR}=reference (or auto)."
        )
    if not kernel_supports_input:
        raise ValueError(f"the Triton kernel does not support this input: {why_not}; use {ENV_VAR}=reference")
    return "triton"
