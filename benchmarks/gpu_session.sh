#!/usr/bin/env bash
# The GPU checks in one script: the kernel tests against the compiled
# kernels, the engine against transformers on the GPU, the kernel benchmark, the kernels against their peers
# (torch int4/int8/fp8, gemlite when `.whl` is carried: benchmarks/fetch_gemlite.sh) and the engine benchmarks.
# Usage on the GPU machine: bash benchmarks/gpu_session.sh [step ...]  (default: all but `sweep`, the W4A16 gemv tile
# sweep of benchmarks/gemv_sweep.py, ~5 min, and `e2e`, the headline `compress run` on a random 8B, ~8 min, its own
# call: bash benchmarks/fetch_e2e_wheels.sh here, carry `.whl`). Logs and results go to $OUT.
set -u
OUT=${OUT:-/tmp/gpu-session}
RESULTS=$OUT/results  # tarred after every step: the device tool returns at most 8 files, and a call cut short
                      # by its time limit still returns the steps that finished
mkdir -p "$RESULTS"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then  # from benchmarks/fetch_e2e_wheels.sh, carried as `.whl`: what `e2e` needs
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
for sdist in .whl/gemlite-*.tar.gz; do  # from benchmarks/fetch_gemlite.sh, carried as `.whl`: gemlite columns of `peers`
  [ -f "$sdist" ] || continue
  mkdir -p /tmp/gemlite && tar -xzf "$sdist" -C /tmp/gemlite
  export PYTHONPATH=$(ls -d /tmp/gemlite/gemlite-*/ | head -n 1):$PYTHONPATH
done

run_step() {  # name, time limit (s), command...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  echo "=== $name: exit $? after $((SECONDS - start))s"
  tail -n "${TAIL_LINES:-12}" "$RESULTS/$name.log"
  tar -C "$OUT" -czf "$OUT/session.tgz" results
}

steps=${*:-info check tests peers decode kernels serve}
# Only the modules that carry the gpu mark: the others import packages the GPU image lacks (compressed-tensors).
gpu_test_files=$(grep -rl "mark.gpu" tests | sort)
for step in $steps; do
  case $step in
    info) nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv
          python3 -c "import torch, triton, transformers as t; print(torch.__version__, triton.__version__, t.__version__)";;
    tests) run_step tests ${LIMIT_TESTS:-300} env COMPRESS_TEST_DEVICE=cuda COMPRESS_AUTOTUNE=0 \
             python3 -m pytest -q -rfE -n ${TEST_WORKERS:-12} -p no:cacheprovider -m gpu $gpu_test_files;;
    check) run_step check ${LIMIT_CHECK:-180} python3 -m benchmarks.engine_gpu_check;;
    kernels) run_step kernels ${LIMIT_KERNELS:-420} python3 -m compress bench kernels out="$RESULTS" ${KERNEL_ARGS:-};;
    peers) run_step peers ${LIMIT_PEERS:-480} python3 -m compress bench peers out="$RESULTS" ${PEER_ARGS:-};;
    decode) run_step decode ${LIMIT_DECODE:-300} python3 -m compress bench engine checkpoint=random:llama-8b mode=decode \
              out="$RESULTS" ${DECODE_ARGS:-};;
    sweep) run_step sweep ${LIMIT_SWEEP:-330} python3 -m benchmarks.gemv_sweep --out "$RESULTS" ${SWEEP_ARGS:-};;
    e2e) run_step e2e ${LIMIT_E2E:-470} python3 -m benchmarks.gpu_e2e --out "$RESULTS" --logs "$RESULTS" --budget 450 \
           ${E2E_ARGS:-};;  # `compress run` awq_int4, fp8_dynamic, gptq_int4 on a random 8B; carry .whl (see above)
    serve) run_step serve ${LIMIT_SERVE:-300} python3 -m compress bench engine checkpoint=random:smollm2-135m out="$RESULTS";;
    *) echo "unknown step $step"; exit 2;;
  esac
done
tar -C "$OUT" -czf "$OUT/session.tgz" results && rm -rf "$RESULTS"
