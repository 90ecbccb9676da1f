"""Data-parallel calibration on ``torch.distributed``: ``torchrun --nproc-per-node N -m compress run ...``.

Each rank calibrates on its own shard of the calibration batches; the few statistics a stage decides from (Hessian
sums and token counts, AWQ's activation moments, SmoothQuant/KV/FP8 maxima, Wanda norms) are all-reduced where they
are final, so every rank takes the same decisions and ends each layer with identical weights. GPTQ splits each
stacked weight's rows across ranks (rows are independent given H) and gathers them back. Rank 0 alone owns the run
folder, the saves, the evaluation, the gate and MLflow; the other ranks exit once compression is done.

Everything here is a no-op in a single process, so stages call these helpers unconditionally. The backend is NCCL
when CUDA is visible (each rank on ``cuda:LOCAL_RANK``), gloo on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from compress.base.errors import CompressError

# Rank 0 evaluates the baseline before compression while the other ranks wait in their first collective.
TIMEOUT = timedelta(minutes=int(os.environ.get("COMPRESS_DIST_TIMEOUT_MIN", "120")))


def launched() -> bool:
    """Started by torchrun (or anything setting ``WORLD_SIZE``) with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init() -> bool:
    """Join the process group torchrun describes in the environment; True when running data-parallel."""
    if not launched():
        return False
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank())
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=TIMEOUT)
    return True


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def device_for(device: torch.device) -> torch.device:
    """A bare ``cuda`` becomes this rank's own GPU."""
    if active() and device.type == "cuda" and device.index is None:
        return torch.device("cuda", local_rank())
    return device


def shard(samples: torch.Tensor, batch_size: int) -> torch.Tensor:
    """This rank's calibration samples: a contiguous run of whole batches of the single-process batching, so each
    batch (and every activation computed from it) is exactly what one process would compute."""
    if not active():
        return samples
    batches = -(-len(samples) // batch_size)
    if batches < world():
        raise CompressError(
            f"{len(samples)} calibration samples make {batches} batches of calibration_batch_size={batch_size}, "
            f"fewer than the {world()} ranks; raise data.num_samples or lower calibration_batch_size"
        )
    first, last = _bounds(batches, rank())
    return samples[first * batch_size : last * batch_size]


def row_range(rows: int, owner: int | None = None) -> slice:
    """The rows of a ``rows``-row matrix that rank ``owner`` (default: this rank) works on; contiguous, balanced."""
    first, last = _bounds(rows, rank() if owner is None else owner)
    return slice(first, last)


def _bounds(count: int, part: int) -> tuple[int, int]:
    size, extra = divmod(count, world())
    first = part * size + min(part, extra)
    return first, first + size + (part < extra)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; returns ``tensor``. The summation order differs from one process's, so a sum is
    equal to the single-process one only up to float rounding."""
    if active():
        dist.all_reduce(tensor, dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Maximum over ranks, in place; exact, so maxima match the single-process ones bit for bit."""
    if active():
        dist.all_reduce(tensor, dist.ReduceOp.MAX)
    return tensor


def sum_count(count: int, device: torch.device) -> int:
    """An integer (a token count) summed over ranks."""
    if not active():
        return count
    return int(all_reduce_sum(torch.tensor([count], dtype=torch.float64, device=device)).item())


def broadcast_(tensor: torch.Tensor, src: int) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with rank ``src``'s copy, in place; returns it."""
    if active():
        dist.broadcast(tensor, src)
    return tensor


def gather_rows(part: torch.Tensor, rows: int) -> torch.Tensor:
    """The full ``[rows, ...]`` matrix from each rank's :func:`row_range` slice ``part``."""
    if not active():
        return part
    full = part.new_empty((rows, *part.shape[1:]))
    full[row_range(rows)] = part
    for owner in range(world()):
        slice_ = full[row_range(rows, owner)]  # a view: the broadcast fills ``full`` in place
        if slice_.numel():
            broadcast_(slice_, owner)
    return full


def broadcast_object(value, src: int = 0):
    """Rank ``src``'s picklable ``value`` on every rank."""
    if not active():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src)
    return holder[0]


def main_first(action: Callable[[], object]) -> None:
    """Run ``action`` on rank 0 before any other rank goes on: work that must happen once before every rank uses
    its result (the default model's one-time conversion, which ranks racing each other would clobber)."""
    if not active():
        return
    if is_main():
        action()
    barrier()


def barrier() -> None:
    if active():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group; compression ends with a barrier, so a rank other than 0 may leave as soon as it is
    done while rank 0 goes on to save, evaluate and record."""
    if active():
        dist.destroy_process_group()


def select_device(name: str) -> torch.device:
    """The device a name asks for; under torchrun a bare ``cuda`` is this rank's GPU."""
    if name == "auto":
        return device_for(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CompressError(f"device={name} asked for, but no CUDA GPU is visible; use device=cpu")
    return device_for(torch.device(name))
