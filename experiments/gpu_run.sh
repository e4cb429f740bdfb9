#!/usr/bin/env bash
# Device calls for the GPU experiments, one stage per call (each under the 10-minute limit):
#   bash experiments/gpu_run.sh STAGE [STAGE ...]    STAGE: tests, bench or ncu
# (results land in $OUT; each stage has its own time limit).
# Installs the pinned numpy wheel from .whl/ (../shared/tools/gpu-wheels.sh) first.
set -u
export PYTHONUNBUFFERED=1 LOOP_ORDERS_GIT_SHA=${LOOP_ORDERS_GIT_SHA:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
for stage in "$@"; do case "$stage" in
  tests) timeout 150 python3 -m pytest -q -x -p no:cacheprovider -s tests/test_correctness.py \
           tests/test_gpu.py tests/test_explainer.py tests/test_hardening.py \
           > "$OUT/pytest_gpu.log" 2>&1; grep -E "relative error" "$OUT/pytest_gpu.log";
         tail -3 "$OUT/pytest_gpu.log" ;;
  bench) timeout 400 python3 -m experiments.bench_runtime --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
           | tee "$OUT/bench.log" | tail -80 ;;
  ncu)   timeout 400 python3 -m experiments.hw_traffic --out "$OUT" ${HW_ARGS:-} 2>&1 | tail -70 ;;
  *) echo "usage: gpu_run.sh tests|bench|ncu ..."; exit 2 ;;
esac; done
