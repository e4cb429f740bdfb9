#!/usr/bin/env bash
# One device call running GPU stages in order, each under its own time limit:
#   bash experiments/gpu_run.sh STAGE [STAGE ...]
# STAGE: tests (TESTS: files, TEST_K: a -k expression; each named as it ends: a run cut
# short still says which failed), host, fuzz,
# gqa, window, fagrid, decode, backward, theorems, train, model, fig2, bench, hopper, layouts,
# tctiles,
# warm, ab, profile, ncu, cp (context parallelism, on every GPU of the machine),
# each optionally STAGE:SECONDS, its time limit (default STAGE_TIMEOUT, 300 s).
# Installs the pinned numpy wheel from .whl/ (../shared/tools/gpu-wheels.sh) first. Every
# stage writes under $OUT/work/<stage>/; after each stage all of it is packed into
# $OUT/work.tgz (a device call returns at most 8 files), with the stages' log tails in
# $OUT/summary.log.
# A stage that fails or runs out of time leaves what it wrote, and the next one runs.
set -u
export PYTHONUNBUFFERED=1 LOOP_ORDERS_GIT_SHA=${LOOP_ORDERS_GIT_SHA:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
W=$OUT/work
mkdir -p "$W"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$W/gpu.txt"
run() {  # run STAGE TIMEOUT COMMAND...: the command's output in $W/STAGE/log
  local stage=$1 limit=$2; shift 2
  mkdir -p "$W/$stage"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$W/$stage/log" 2>&1
  local rc=$?
  echo "== $stage: exit $rc after $((SECONDS - t0)) s (124: stopped at ${limit} s)" \
    | tee -a "$OUT/summary.log"
  tail -n "${TAIL:-25}" "$W/$stage/log" | tee -a "$OUT/summary.log"
  # after every stage (a call cut short returns what ended), renamed whole into place
  tar czf "$OUT/work.tgz.part" -C "$W" . && mv "$OUT/work.tgz.part" "$OUT/work.tgz"
}
for arg in "$@"; do
  stage=${arg%%:*}; T=${STAGE_TIMEOUT:-300}; [ "$stage" != "$arg" ] && T=${arg#*:}
  case "$stage" in
  tests)    run tests "$T" python3 -m pytest -v -rf -p no:cacheprovider -n 8 -s \
              ${TESTS:-tests/test_gpu.py tests/test_torch.py} ${TEST_K:+-k "$TEST_K"} ;;
  host)     run host "$T" python3 -m experiments.host_overhead --out "$W/host" ${HOST_ARGS:-} ;;
  fuzz)     run fuzz "$T" python3 -m experiments.gpu_fuzz --out "$W/fuzz" ${FUZZ_ARGS:-} ;;
  gqa)      run gqa "$T" python3 -m experiments.bench_gqa_decode --out "$W/gqa" ${GQA_ARGS:-} ;;
  window)   run window "$T" python3 -m experiments.bench_window --out "$W/window" ${WINDOW_ARGS:-} ;;
  fagrid)   run fagrid "$T" python3 -m experiments.fa_grid --out "$W/fagrid" ;;
  decode)   run decode "$T" python3 -m experiments.bench_decode --out "$W/decode" ${DECODE_ARGS:-} ;;
  backward) run backward "$T" python3 -m experiments.bench_runtime --backward --out "$W/backward" \
              ${BACKWARD_ARGS:-} ;;
  theorems) for t in theorem2 theorem5; do  # resuming the committed GPU points, if any
              mkdir -p "$W/$t"; cp "results/$t.gpu.json" "$W/$t/" 2>/dev/null
              run "$t" "$T" python3 -m experiments."$t" --no-progress \
                --results-dir "$W/$t" --figures-dir "$W/$t/fig" --notes "$W/$t/notes.md"
            done ;;
  train)    run train "$T" python3 -m experiments.train_tiny --out "$W/train" ;;
  model)    run model "$T" python3 -m experiments.model_traffic --out "$W/model" ;;
  fig2)     run fig2 "$T" python3 -m experiments.fig2_setting --out "$W/fig2" ;;
  bench)    run bench "$T" python3 -m experiments.bench_runtime --out "$W/bench" ${BENCH_ARGS:-} ;;
  hopper)   run hopper "$T" python3 -m experiments.bench_hopper --out "$W/hopper" ${HOPPER_ARGS:-} ;;
  layouts)  run layouts "$T" python3 -m experiments.bench_runtime --layouts --out "$W/layouts" ;;
  tctiles)  run tctiles "$T" python3 -m experiments.bench_runtime --tc-tiles --out "$W/tctiles" ;;
  cp)       mkdir -p "$W/cp"; cp results/context_parallel.gpu.json "$W/cp/" 2>/dev/null  # resume
            run cp "$T" python3 -m torch.distributed.run --standalone --nproc_per_node="$(nvidia-smi -L | wc -l)" \
              -m experiments.bench_context_parallel --out "$W/cp" ${CP_ARGS:-} ;;
  ncu)      run ncu "$T" python3 -m experiments.hw_traffic --out "$W/ncu" ${HW_ARGS:-} ;;
  warm)     # compile kernels ahead, all at once, into the kernel cache (later stages load
            # them): WARM is ';'-separated argument lists of `loop-orders run` or `traffic
            # --measure` (uncounted and counted builds), one process each
            IFS=';' read -ra jobs <<< "${WARM:?}"
            mkdir -p "$W/warm"
            t0=$SECONDS
            for i in "${!jobs[@]}"; do
              timeout "$T" python3 -m loop_orders ${jobs[$i]} > "$W/warm/$i.log" 2>&1 &
            done
            wait
            echo "== warm: ${#jobs[@]} processes in $((SECONDS - t0)) s; failed: $(grep -L -e '(ok' -e 'equal to the model' "$W"/warm/*.log | tr '\n' ' ')" \
              | tee -a "$OUT/summary.log" ;;
  ab)       # A/B in one call. AB_VARIANTS: ';'-separated "NAME TREE [VAR=VALUE ...]", TREE
            # "." (this tree) or an older commit's `git archive` in an ignored folder named in
            # carry. Each variant times bench_runtime with BENCH_ARGS; their kernels compile
            # first, all at once, at N = 512 (into the kernel cache), then the variants run one
            # after another, AB_ROUNDS (default 1) times.
            IFS=';' read -ra variants <<< "${AB_VARIANTS:?}"
            mkdir -p "$W/ab"
            for v in "${variants[@]}"; do
              read -r name tree envs <<< "$v"
              (cd "$tree" && env $envs PYTHONPATH="/tmp/site:$PWD" python3 -m experiments.bench_runtime \
                --out "$W/ab/warm_$name" ${BENCH_ARGS:-} --n 512 > "$W/ab/warm_$name.log" 2>&1) &
            done
            wait
            for r in $(seq "${AB_ROUNDS:-1}"); do
              for v in "${variants[@]}"; do
                read -r name tree envs <<< "$v"
                run "ab_${name}_$r" "$T" bash -c "cd '$tree' && export PYTHONPATH=/tmp/site:\$PWD && exec env $envs \
                  python3 -m experiments.bench_runtime --out '$W/ab_${name}_$r' ${BENCH_ARGS:-}"
              done
            done ;;
  profile)  # PROFILES: ';'-separated "LAYOUT D BLOCK_Q BLOCK_K" (LAYOUT "-": the default), at
            # N = 4096, H = 16 and B = PROFILE_BATCH (default 4); PROFILE_ARGS: more arguments
            # of `loop-orders run` (e.g. --dtype float16)
            IFS=';' read -ra points <<< "${PROFILES:-- 64 128 64}"
            for pt in "${points[@]}"; do
              read -r lay d bq bk <<< "$pt"
              [ "$lay" = "-" ] && lay=""
              run "profile_d${d}_${bq}x${bk}_${lay/,/x}" "$T" env LOOP_ORDERS_LAYOUT="$lay" \
                ncu --section SpeedOfLight --section ComputeWorkloadAnalysis \
                --section WarpStateStats --section Occupancy --section LaunchStats \
                --section InstructionStats --section MemoryWorkloadAnalysis \
                --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__sass_thread_inst_executed_op_ffma_pred_on.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed.sum" \
                -k regex:q_outer -c 1 \
                python3 -m loop_orders run --schedule q_outer --n 4096 --d "$d" --batch "${PROFILE_BATCH:-4}" \
                --heads 16 --block-q "$bq" --block-k "$bk" --repeat 1 ${PROFILE_ARGS:-}
            done ;;
  *) echo "usage: gpu_run.sh tests|host|fuzz|gqa|window|fagrid|decode|backward|theorems|train|fig2|bench|hopper|layouts|tctiles|warm|ab|ncu|profile|cp[:SECONDS] ..."
     exit 2 ;;
  esac
done
tar czf "$OUT/work.tgz" -C "$W" .
ls -la "$OUT"
