#!/usr/bin/env bash
# The wheels `compress run` needs on an offline GPU machine beyond its image (torch, transformers, safetensors, pyyaml, psutil,
# nvidia-ml-py are there; nothing can be downloaded there), for `bash benchmarks/gpu_session.sh e2e`
# (benchmarks/gpu_e2e.py). Versions are constraints.txt's; every one is pure Python but rpds-py (cp312, x86-64).
#   here, once, from the checkout's root:  bash benchmarks/fetch_e2e_wheels.sh [--lm-eval]   -> .whl/*.whl
#   on the GPU machine: copy `.whl` beside the checkout; gpu_session.sh installs every .whl/*.whl into /tmp/site by itself.
# Core (~1 MB): hydra-core, omegaconf, antlr4 (Hydra composes every run's configuration), jsonschema and its three
# dependencies (the gate's json layer). MLflow is not needed (tracking.enabled=false), nor compressed-tensors or gguf
# (never imported by a run) or datasets (a local text is split without it).
# --lm-eval (~8 MB more): lm_eval, datasets, evaluate, dill, multiprocess, for the gate's accuracy layer;
# benchmarks/gpu_e2e.py turns that layer off by itself when lm_eval does not import there.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"  # carried, never committed
PY=${PYTHON:-.venv/bin/python}
pin() { grep -i -m1 "^$1==" constraints.txt; }
names=(hydra-core omegaconf jsonschema jsonschema-specifications referencing rpds-py)
[ "${1:-}" = "--lm-eval" ] && names+=(lm_eval datasets evaluate dill multiprocess)
mkdir -p .whl
for name in "${names[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$(pin "$name")"
done
# antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 pins) is published as an sdist only: build its pure-Python wheel
"$PY" -m pip wheel -q --no-deps -w .whl "$(pin antlr4-python3-runtime)"
ls -l .whl/*.whl
du -ch .whl/*.whl | tail -n 1
