"""compress: LLM compression with release gates.

``from compress import oneshot`` compresses a model with a recipe and returns the checkpoint folder (see
``compress.api``); ``python -m compress run ...`` adds evaluation, the release gate and MLflow tracking. The
import is lazy so that ``import compress.engine`` on a bare GPU box pulls in nothing of the pipeline.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The repo keeps kernels/ and evals/ at its top (the layout asked for); installed, they live inside this package as
# compress.kernels and compress.evals (pyproject's package-dir), so the distribution claims no top-level name but its
# own. In a source checkout run without an install (PYTHONPATH=. on a bare GPU box) they are found beside it here.
_CHECKOUT = Path(__file__).resolve().parent.parent
_BESIDE = ("kernels", "evals")


class _CheckoutFolders:
    """Finds ``compress.kernels`` and ``compress.evals`` in the folders beside this package."""

    @staticmethod
    def find_spec(fullname: str, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package != "compress" or name not in _BESIDE:
            return None
        folder = _CHECKOUT / name
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


# First in line: a second checkout of the source (a git worktree) imports its own folders, not those an editable
# install of another checkout maps.
if not (Path(__file__).parent / "kernels").exists() and (_CHECKOUT / "kernels" / "__init__.py").is_file():
    sys.meta_path.insert(0, _CheckoutFolders)

if TYPE_CHECKING:
    from compress.api import oneshot

__all__ = ["oneshot"]


def __getattr__(name: str) -> Any:
    if name == "oneshot":
        from compress.api import oneshot

        return oneshot
    raise AttributeError(f"module 'compress' has no attribute {name!r}")
