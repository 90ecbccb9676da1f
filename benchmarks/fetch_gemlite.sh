#!/usr/bin/env bash
# Carry gemlite (pure Python + Triton; PyPI has only its sdist) to a GPU box that cannot reach PyPI, for the
# gemlite columns of `python -m compress bench peers`.
#   here, once, from the checkout's root:  bash benchmarks/fetch_gemlite.sh   -> .whl/gemlite-<version>.tar.gz
#   on the GPU machine: copy `.whl` beside the checkout; benchmarks/gpu_session.sh unpacks it onto PYTHONPATH by itself (no build:
#   the sdist's source tree imports as is and ships gemlite's H100 tile cache; numpy, tqdm, triton are on the box).
set -euo pipefail
VERSION=${GEMLITE_VERSION:-0.6.0.post2}
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"  # carried, never committed
"${PYTHON:-python3}" -m pip download --no-deps --no-binary=:all: -d .whl "gemlite==$VERSION"
ls -l .whl/gemlite-"$VERSION".tar.gz
