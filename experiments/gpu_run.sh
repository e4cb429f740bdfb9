#!/usr/bin/env bash
# Device calls for the GPU experiments, one stage per call (each under the 10-minute limit):
#   bash experiments/gpu_run.sh STAGE [STAGE ...]    STAGE: tests, bench, layouts, profile or ncu
# (results land in $OUT; each stage has its own time limit).
# Installs the pinned numpy wheel from .whl/ (../shared/tools/gpu-wheels.sh) first.
set -u
export PYTHONUNBUFFERED=1 LOOP_ORDERS_GIT_SHA=${LOOP_ORDERS_GIT_SHA:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
for stage in "$@"; do case "$stage" in
  tests) timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -x -p no:cacheprovider -s \
           ${TESTS:-tests/test_correctness.py tests/test_gpu.py tests/test_explainer.py \
                    tests/test_hardening.py} > "$OUT/pytest_gpu.log" 2>&1
         echo "pytest exit status $? (124: stopped by the time limit)" | tee -a "$OUT/pytest_gpu.log"
         grep -E "relative error" "$OUT/pytest_gpu.log"; tail -3 "$OUT/pytest_gpu.log" ;;
  layouts) timeout 300 python3 -m experiments.bench_runtime --layouts --out "$OUT" 2>&1 \
           | tee "$OUT/layouts.log" | tail -30 ;;
  bench) timeout "${BENCH_TIMEOUT:-400}" python3 -m experiments.bench_runtime --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
           | tee "$OUT/bench.log" | tail -80 ;;
  profile) timeout 150 ncu --section SpeedOfLight --section ComputeWorkloadAnalysis \
           --section WarpStateStats --section Occupancy --section LaunchStats \
           --section InstructionStats --section MemoryWorkloadAnalysis -k regex:q_outer -c 1 \
           python3 -m loop_orders run --schedule q_outer --n 4096 --d 64 --batch 4 --heads 16 \
           --block-q 128 --block-k 64 --repeat 1 > "$OUT/profile_q_outer.txt" 2>&1
         grep -E "Throughput|Issue Slots|Warp Cycles|Occupancy|Registers|Stall|Executed Ipc|FMA|time:|error" \
           "$OUT/profile_q_outer.txt" | head -40 ;;
  ncu)   timeout 400 python3 -m experiments.hw_traffic --out "$OUT" ${HW_ARGS:-} 2>&1 | tail -70 ;;
  *) echo "usage: gpu_run.sh tests|bench|layouts|profile|ncu ..."; exit 2 ;;
esac; done
