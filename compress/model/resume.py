"""Layer-level resume: the layer walk keeps its progress beside the run folders after every decoder layer, so the same
command run again after a crash, an OOM kill or a pre-emption continues at the next layer instead of layer 0, and
ends with the same tensors as a run that was never stopped.

A run's progress lives in ``<runs>/.progress/<recipe>-<model>/``:

- ``fingerprint.json``: what the progress is valid for: the model files (names, sizes, modification times,
  safetensors headers; small files by content), the resolved recipe (stages, data, seed, batch size, device), the
  calibration token ids, the project's and torch's versions and the number of ranks. Anything different starts over
  and says which of these changed.
- ``layer-NNNNN.pt``: each finished layer as the walk left it, its modules pickled whole (quantized linears, masks).
- ``cursor-NNNNN-rankR.pt``: what the walk carries into layer NNNNN: that layer's calibration inputs, each walk
  stage's state (its statistics, a full-precision stream) and the RNG state. Each rank keeps its last two: under
  torchrun one rank may be a layer ahead of another when the job is killed, and all resume at the same layer.
- ``../.<recipe>-<model>.lock``: an OS file lock (``compress.base.locks``) held from the walk's start to its end: a
  second run of the same settings waits for it, then continues from what the first kept; one of other settings keeps
  none.

Disk: the finished layers (about the checkpoint's size) plus two cursors per rank, each about
``samples x seq_len x hidden x 4`` bytes (twice that for a stage that carries a full-precision stream): 150 MB for
the default model's 64 x 512 samples. The folder is removed when the run is published; ``resume=false`` keeps none.
Only the chain's first layer walk is resumed; whole-model stages before it (rotations, adapter merging) are
deterministic and run again. Files are pickles written by this project for itself: load them from no one else.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.base import distributed
from compress.base.locks import FileLock, lock_beside
from compress.base.staging import write_file_atomically
from compress.model.layer_walk import LayerInputs
from compress.model.sources import resolve_model_path

log = logging.getLogger(__name__)

SMALL_FILE_BYTES = 16 << 20  # model files below this are fingerprinted by content, larger ones by size and mtime
NOT_STAGE_STATE = ("config", "metrics_sink")  # a stage's settings (rebuilt from the recipe) and its tracking sink


def project_version() -> str:
    try:
        return metadata.version("compress")
    except metadata.PackageNotFoundError:  # a source checkout run without an install
        return "source"


def fingerprint(model_folder: Path, recipe: dict, samples: torch.Tensor) -> dict[str, str]:
    """What a walk's progress is valid for, one digest per cause of a restart (named when it changes)."""
    return {
        "model files": _model_digest(model_folder),
        "recipe": settings_digest(recipe),
        "calibration data": _digest(samples.contiguous().cpu().numpy().tobytes()),
        "version": f"compress {project_version()}, torch {torch.__version__}",
        "ranks": str(distributed.world()),
    }


def settings_digest(settings: dict) -> str:
    """One short digest of run settings (plain values, key order ignored): what a walk's progress, or a measured
    draw of a recipe (``benchmarks.quality_draws``), was made with."""
    return _digest(json.dumps(settings, sort_keys=True, default=str).encode())


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _model_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}".encode())
        if stat.st_size < SMALL_FILE_BYTES:
            digest.update(path.read_bytes())
            continue
        digest.update(str(stat.st_mtime_ns).encode())
        if path.suffix == ".safetensors":
            with path.open("rb") as handle:  # the header: every tensor's name, dtype, shape and offsets
                digest.update(handle.read(8 + int.from_bytes(handle.read(8), "little")))
    return digest.hexdigest()[:16]


def stage_state(stage: Any) -> dict:
    """What a walk stage carries from one layer to the next and into ``finalize``: every attribute but its settings
    and its tracking sink."""
    return {key: value for key, value in vars(stage).items() if key not in NOT_STAGE_STATE}


class WalkProgress:
    """A walk's progress folder: ``save`` after every layer, ``restore`` once before the walk starts."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.lock: FileLock | None = None  # held by rank 0 from open to release

    @classmethod
    def open(cls, folder: Path, expected: dict[str, str]) -> WalkProgress | None:
        """The progress in ``folder`` if it was made for ``expected``; otherwise an empty one (saying why). The folder's
        lock (``compress.base.locks``) is held until :meth:`release`. A second run of the same settings waits for the
        first's walk, saying so in one line, then continues from its progress; a run of other settings (another job
        of one sweep: same recipe and model) does not wait and keeps no progress (None) rather than wipe the files
        the first writes."""
        progress, busy = cls(folder), False
        if distributed.is_main():
            lock = FileLock(lock_beside(folder), f"the layer walk's progress {folder}")
            if not lock.try_acquire() and _read_json(folder / "fingerprint.json") not in (None, expected):
                log.warning("resume: %s is in use by a run of other settings; this run keeps no progress", folder)
                busy = True
            else:
                progress.lock = lock.acquire()  # an identical run's walk (or one not begun): wait, then go on from it
                progress._check(expected)
        busy = distributed.broadcast_object(busy)
        distributed.barrier()  # every rank sees the folder as rank 0 left it
        return None if busy else progress

    def _check(self, expected: dict[str, str]) -> None:
        """Start over, saying why, unless the folder was kept for ``expected``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        stored = _read_json(self.folder / "fingerprint.json")
        if stored is not None and stored != expected:
            changed = next((key for key in expected if stored.get(key) != expected[key]), "its format")
            log.warning("resume: the %s changed since %s was kept; starting over", changed, self.folder)
            _clear(self.folder)
        if stored != expected:
            write_file_atomically(self.folder / "fingerprint.json", lambda path: path.write_text(json.dumps(expected)))

    def release(self) -> None:
        """The walk is done with the folder: the next run of the same recipe and model may take it."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def restore(self, layers: nn.ModuleList, stages: list, device: torch.device) -> tuple[int, LayerInputs | None]:
        """``(layers already done, the next layer's inputs)``: the done layers put back into ``layers`` and the walk
        stages' state and the RNG as they were after the last of them; ``(0, None)`` with no usable progress.
        ``device``: the walk's, where the ranks' collective runs (NCCL reduces CUDA tensors only)."""
        mine = self._cursor_indices(distributed.rank())
        done = max(mine, default=0)
        if distributed.active():  # every rank resumes at the same layer: the smallest last cursor of any rank
            done = -int(distributed.all_reduce_max(torch.tensor([-done], device=device)).item())
        if done == 0:
            return 0, None
        cursor = torch.load(self._cursor(done, distributed.rank()), weights_only=False)
        for index in range(done):
            layers[index] = torch.load(self._layer(index), weights_only=False)
        for stage, state in zip(stages, cursor["stages"], strict=True):
            vars(stage).update(state)
        torch.set_rng_state(cursor["rng"])
        log.warning("resuming at layer %d/%d (progress in %s)", done, len(layers), self.folder)
        return done, cursor["inputs"]

    def save(self, index: int, layer: nn.Module, next_inputs: LayerInputs | None, stages: list) -> None:
        """Keep finished layer ``index`` and what the walk carries into the next one; older cursors go."""
        rank = distributed.rank()
        if distributed.is_main():
            with _hooks_set_aside(layer):
                write_file_atomically(self._layer(index), lambda path: _torch_save(layer, path))
        cursor = {"inputs": next_inputs, "stages": [stage_state(s) for s in stages], "rng": torch.get_rng_state()}
        write_file_atomically(self._cursor(index + 1, rank), lambda path: _torch_save(cursor, path))
        for old in self._cursor_indices(rank):
            if old < index:
                self._cursor(old, rank).unlink(missing_ok=True)

    def remove(self) -> None:
        """Remove the folder, unless another run holds it (it walks now, and removes it once published)."""
        lock = FileLock(lock_beside(self.folder), f"the layer walk's progress {self.folder}")
        if not lock.try_acquire():
            return
        try:
            shutil.rmtree(self.folder, ignore_errors=True)
        finally:
            lock.release()
        try:
            self.folder.parent.rmdir()  # ``.progress`` itself, once no other run keeps anything there
        except OSError:
            pass

    def _layer(self, index: int) -> Path:
        return self.folder / f"layer-{index:05d}.pt"

    def _cursor(self, done: int, rank: int) -> Path:
        return self.folder / f"cursor-{done:05d}-rank{rank}.pt"

    def _cursor_indices(self, rank: int) -> list[int]:
        """Layers done, per cursor this rank has whose layers are all kept."""
        found = [int(path.name.split("-")[1]) for path in self.folder.glob(f"cursor-*-rank{rank}.pt")]
        return [done for done in found if all(self._layer(index).exists() for index in range(done))]


HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs")


@contextmanager
def _hooks_set_aside(layer: nn.Module) -> Iterator[None]:
    """The layer without its forward hooks while it is pickled: they belong to the live model (a lazy model's loader
    is one), are often closures that cannot be pickled, and a restored layer is complete without them."""
    aside = [(module, {name: getattr(module, name) for name in HOOK_TABLES}) for module in layer.modules()]
    try:
        for module, tables in aside:
            for name, table in tables.items():
                setattr(module, name, type(table)())
        yield
    finally:
        for module, tables in aside:
            for name, table in tables.items():
                setattr(module, name, table)


def _clear(folder: Path) -> None:
    """Everything in ``folder``."""
    for child in folder.iterdir():
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class _Writes:
    """A file torch.save writes through, keeping the OSError a refused write raised (torch reports only its own
    RuntimeError, "unexpected pos", which names neither the full disk nor the file)."""

    def __init__(self, handle):
        self.handle, self.error = handle, None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.handle.flush()


def _torch_save(value, path: Path) -> None:
    with path.open("wb") as handle:
        writes = _Writes(handle)
        try:
            torch.save(value, writes)
        except RuntimeError as error:
            if writes.error is None:
                raise
            raise OSError(writes.error.errno, writes.error.strerror, str(path)) from error


WALK_SETTINGS = ("stages", "data", "seed", "calibration_batch_size", "device")  # a run's settings the walk depends on


def run_progress_folder(config, runs_dir: Path) -> Path:
    """Where ``run`` with this configuration (``compress.app.run_config.RunConfig``) keeps its progress: the same
    command, same run name and model, finds it again."""
    return progress_folder(runs_dir, config.output.run_name or config.recipe, resolve_model_path(config.model))


def progress_folder(runs_dir: Path, name: str, model: str | Path) -> Path:
    """``<runs>/.progress/<run name or recipe>-<digest of the model's path>``."""
    return runs_dir / ".progress" / f"{name}-{_digest(str(Path(model).resolve()).encode())[:8]}"


def open_for_run(config, runs_dir: Path, samples: torch.Tensor) -> WalkProgress | None:
    """The walk's progress for ``run`` with this configuration, checked against its fingerprint and locked until the
    walk ends; None with ``resume=false``."""
    if not config.resume:
        return None
    walk = {key: config.raw[key] for key in WALK_SETTINGS}
    expected = fingerprint(Path(resolve_model_path(config.model)), walk, samples)
    return WalkProgress.open(run_progress_folder(config, runs_dir), expected)
