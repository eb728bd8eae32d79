#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The whole GPU harness run on the lent device, from the repository root:
#   bash tools/gpu_harness/device_run.sh [STAGE...]
# Stages (default: ops e2e bench): setup always runs first.
#   ops    the DeepGEMM and FlashMLA stand-ins (tests/e2e/gpu/test_harness_dsa_ops.py;
#          OPS_K narrows them with pytest -k)
#   e2e    pytest -m gpu tests/e2e/gpu (results JSON under $OUT/results); if it
#          fails inside torch.compile it is rerun once with TORCHDYNAMO_DISABLE=1
#          (E2E_TESTS narrows it to some files, E2E_LIMIT_S its time limit)
#   acceptance  tests/e2e/gpu/test_eagle3_acceptance.py (production settings)
#   e2e-rest the GPU tests outside test_eagle3_e2e.py
#   bench  tools/gpu_harness/bench_eagle3.py (train a drafter, measure)
#   prod   prod_check.py offline: MLA targets, production settings, vllm.LLM
#   server prod_check.py server: the OpenAI server, openai client, /metrics
#   bench-prod  bench_eagle3.py --profile production (BENCH_ARGS adds flags)
#   cache  bench_eagle3.py cache: two drafters, one compile-cache directory
#   cache-nopatch  the same without the compile-cache patch (NOPATCH_FILE)
#   control  bench_eagle3.py control: the trained drafter with other aux ids
#   dsa-glm5, dsa-v32  tests/e2e/gpu/test_eagle3_dsa.py for one DSA target:
#          float64 check of the aux states, acceptance (eager bf16);
#          dsa-aux-glm5, dsa-acceptance-v32, ... run one of the two tests
#          (the rest of the name becomes pytest's -k, "-" read as "and")
#   server-kimi  the server stage with Kimi-K2.5 and the MLA drafter
#   server-kimi-llama  the same with the Llama drafter
#   int4   tests/e2e/gpu/test_eagle3_int4.py: Kimi-K2.5 INT4 (Marlin MoE) aux
#          states, speculators' generator, acceptance; int4-aux and
#          int4-acceptance run one of the two tests
#   speed  speed.py: plain vs EAGLE-3 decode tok/s, interleaved
#          repeats (needs bench-prod's artifacts.tar.gz, or SPEED_ARTIFACTS)
#   profile  step_profile.py: torch-profiler breakdown of one plain and
#          one EAGLE-3 engine's decode steps (needs the same artifacts as speed)
#   project  project.py run: per-rank DeepSeek-V3 (PROJECT_ARGS="--model kimi-k25-int4": Kimi-K2.5 INT4) (TP = 8) step times at a
#          few layer counts, for the 61-layer projection
#   fulldepth  fulldepth.py run: plain and EAGLE-3 decode steps of one TP-8 rank at all 61
#          layers (FULLDEPTH_ARGS, default "--model kimi-k25-int4": every engine, batch
#          1-128, 3 repeats)
#   backends  prod_check.py backends: the target forced to each MLA backend,
#          plain and with each drafter (served / refused at start / failed);
#          backends-A,B runs only backends A and B (EAGLE3_BACKENDS)
#   serving  tests/e2e/gpu/test_eagle3_serving.py: EAGLE-3 under serving conditions, both
#          pairs side by side (SERVING_K narrows the cases); serving-calibrate its calibrate
#          case; serving-soak its soak
#   kernels  build vLLM's CUDA ops (kernels.py build), then set up with them;
#          skipped when the carried .device/kernels/kernels-libs.tar.xz (laid
#          from the device cache by kernels.py stage) is the build of the
#          carried sources and kernels.py for this device's torch. KERNELS=DIR or KERNELS=kernels-libs.tar.xz names an
#          earlier build (default: the carried one); setup refuses to run
#          without one
#   sh-NAME  the shell command in $SH_NAME (NAME upper-cased, "-" as "_"):
#          a probe as one stage of a plan; the CPU tests' stand-in stages
# A plan is the stages in order: setup runs once, then each stage that fits
# in what is left of BUDGET_S (default 570, under the 10-minute limit of one
# device call); a stage whose measured seconds (measured_s below, or
# NEED_S_<STAGE>) exceed what is left is skipped with a line.
# Logs land in $OUT (the device tool's output folder) or /tmp/gpu_harness_out.
# OUT_PACK=1 (the default): the stages write to a work folder, and after
# each stage $OUT gets what has finished, each archive replaced whole:
# results.tgz (every JSON), logs.tgz (the rest), summary.log, the artifacts
# made here (kernels-libs.tar.xz, fi-jit.tar.xz, pair-NAME.tgz) and
# artifacts.json, their keys (device_cache.py seal): at most 8 files, so a call
# cut in a later stage still returns every earlier one. OUT_PACK=0 writes
# into $OUT directly.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_harness_out}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-570}
OUT_PACK=${OUT_PACK:-1}
RET=$OUT
if [[ $OUT_PACK == 1 ]]; then
  OUT=${OUT_WORK:-/tmp/gpu_harness_work.$$}
  rm -rf "$OUT" && mkdir -p "$OUT"
fi
STAGES=${*:-ops e2e bench}
# NVLink multicast stays off (shared hosts); children inherit all of these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export PYTHONUNBUFFERED=1 EAGLE3_STACK_VARIANT=${EAGLE3_STACK_VARIANT:-gpu-harness}
# The kernels are built from registry sources only (kernels.py): no
# FlashAttention-3, so MLA prefill on Hopper goes to FlashInfer (fi_prefill.py),
# whose JIT-compiled modules land under FLASHINFER_WORKSPACE_BASE.
export EAGLE3_HARNESS_FI_PREFILL=${EAGLE3_HARNESS_FI_PREFILL:-1} FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}
export EAGLE3_GPU_RESULTS_DIR="$OUT/results"
SITE=/tmp/site
export PYTHONPATH="$SITE"

# Seconds each stage took where it was measured (docs/gpu.md, "The plan",
# says on which card and build); 0: not measured, run with what is left.
measured_s() {
  case $1 in
    kernels) echo 278 ;;
    e2e) echo 371 ;;
    acceptance|int4-acceptance) echo 470 ;;
    int4-aux) echo 377 ;;
    fulldepth-plain,llama) echo 522 ;;
    fulldepth-mla) echo 183 ;;
    serving|serving-dsv3|serving-kimi) echo 302 ;;
    *) echo 0 ;;
  esac
}
left() { echo $(( BUDGET_S - SECONDS )); }
stage() {  # stage NAME MAX_SECONDS LOG CMD...
  local name=$1 max=$2 log=$3; shift 3
  local t=$(left); (( t > max )) && t=$max
  local v=NEED_S_$(tr 'a-z,-' 'A-Z__' <<<"$name")
  local need=${!v:-$(measured_s "$name")}
  if (( need > $(left) )); then
    echo "== $name: skipped, measured ${need}s, $(left)s left" | tee -a "$OUT/summary.log"; publish; return 99
  fi
  if (( $(left) < 20 )); then echo "== $name: skipped, $(left)s left" | tee -a "$OUT/summary.log"; publish; return 99; fi
  echo "== $name (limit ${t}s) at ${SECONDS}s" | tee -a "$log"
  timeout --kill-after=10 "$t" "$@" >>"$log" 2>&1
  local rc=$?
  echo "== $name rc=$rc at ${SECONDS}s" | tee -a "$log" "$OUT/summary.log"
  publish
  return $rc
}
# The FlashInfer JIT cache as it stands (file names and sizes, its log aside): packed as
# fi-jit.tar.xz when it grew past what was carried.
fi_state() { find "${FLASHINFER_WORKSPACE_BASE}/.cache" -type f ! -name '*.log' -printf '%P %s\n' 2>/dev/null | sort | md5sum; }
# publish: what has finished, into $RET (OUT_PACK=1); each file written under
# another name first and renamed, so a call cut mid-copy keeps the last whole one.
publish() {
  [[ $OUT_PACK == 1 ]] || return 0
  local f n p=part$BASHPID made=()
  if [[ -n ${FI_PACKED:-} && -d ${FLASHINFER_WORKSPACE_BASE}/.cache && $(fi_state) != "$FI_PACKED" ]]; then
    tar -cJf "$OUT/$p.fi-jit.tar.xz" -C "$FLASHINFER_WORKSPACE_BASE" .cache 2>/dev/null \
      && mv "$OUT/$p.fi-jit.tar.xz" "$OUT/fi-jit.tar.xz" && FI_PACKED=$(fi_state)
  fi
  for f in "$OUT"/kernels-libs.tar.xz "$OUT"/fi-jit.tar.xz "$OUT"/pair-*.tgz; do
    [[ -f $f ]] || continue
    n=$(basename "$f")
    cp "$f" "$RET/$p.$n" && mv "$RET/$p.$n" "$RET/$n" && made+=("$RET/$n")
  done
  (( ${#made[@]} )) && python3 tools/gpu_harness/device_cache.py seal --out "$RET" --torch "${DEVICE_TORCH:-unknown}" \
    "${made[@]}" >>"$OUT/summary.log" 2>&1
  (cd "$OUT" && find . -type f -name '*.json' -print0 | tar --null -czf "$RET/$p.results.tgz" -T - 2>/dev/null)
  mv "$RET/$p.results.tgz" "$RET/results.tgz"
  (cd "$OUT" && find . -type f ! -name '*.json' ! -name 'pair-*.tgz' ! -name kernels-libs.tar.xz ! -name '*fi-jit.tar.xz' \
     ! -name summary.log -print0 | tar --null -czf "$RET/$p.logs.tgz" -T - 2>/dev/null)
  mv "$RET/$p.logs.tgz" "$RET/logs.tgz"
  if [[ -f $OUT/summary.log ]]; then cp "$OUT/summary.log" "$RET/$p.summary.log" && mv "$RET/$p.summary.log" "$RET/summary.log"; fi
  return 0
}

# kernels: build vLLM's own CUDA ops from the carried sources (.device/kernels,
# kernels.py stage) first, then set up with them; the
# libraries and kernels.json also go to $OUT. KERNELS=DIR reuses a build.
KERNELS_OUT=${KERNELS_OUT:-.device/kernels/out}
DEVICE_TORCH=${DEVICE_TORCH:-$(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || echo unknown)}
# The carried kernels build and pairs (laid from the device cache with their
# key files): a stale one (its tree or torch changed since) is removed.
python3 tools/gpu_harness/device_cache.py check-laid --torch "$DEVICE_TORCH" 2>&1 | tee -a "$OUT/summary.log"
if [[ -z ${KERNELS:-} && -f .device/kernels/kernels-libs.tar.xz ]]; then
  export KERNELS=.device/kernels/kernels-libs.tar.xz
  STAGES=" $STAGES "; STAGES=${STAGES// kernels / }
  echo "== kernels: the carried kernels-libs.tar.xz is used, not rebuilt" | tee -a "$OUT/summary.log"
fi
if [[ " $STAGES " == *" kernels "* ]]; then
  # 480 s: the cold build with FA3 and DeepGEMM took 291-309 s; Marlin MoE's
  # one object (about 270 s) sets the wall time of this one.
  stage kernels ${KERNELS_LIMIT_S:-480} "$OUT/kernels.log" python3 tools/gpu_harness/kernels.py build --out "$KERNELS_OUT"
  rc=$?
  cp "$KERNELS_OUT/kernels-build.log" "$OUT/" 2>/dev/null
  (( rc == 0 )) || { tail -40 "$OUT/kernels-build.log" "$OUT/kernels.log" 2>/dev/null; exit 1; }
  cp "$KERNELS_OUT/kernels.json" "$KERNELS_OUT/kernels-libs.tar.xz" "$OUT/"
  export KERNELS=$KERNELS_OUT
fi
if [[ ${SKIP_SETUP:-0} != 1 ]]; then  # device_parallel.sh has set up already
  stage setup 180 "$OUT/setup.log" bash tools/gpu_harness/device_setup.sh "$SITE" || { tail -40 "$OUT/setup.log"; exit 1; }
fi
FI_PACKED=$(fi_state)  # what setup unpacked from a carried fi-jit.tar.xz
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv >>"$OUT/setup.log" 2>&1
for s in $STAGES; do
  case $s in
    ops) stage ops ${OPS_LIMIT_S:-150} "$OUT/ops.log" python3 -m pytest -q -p no:cacheprovider -rA tests/e2e/gpu/test_harness_dsa_ops.py ${OPS_K:+-k "$OPS_K"} ;;
    e2e)
      stage e2e ${E2E_LIMIT_S:-330} "$OUT/e2e.log" python3 -m pytest -v -s -rA -p no:cacheprovider -o faulthandler_timeout=120 -m gpu ${E2E_TESTS:-tests/e2e/gpu --deselect tests/e2e/gpu/test_eagle3_acceptance.py}
      if (( $? != 0 )) && grep -qE "torch\._dynamo|torch\._inductor|BackendCompilerFailed" "$OUT/e2e.log"; then
        echo "== e2e: rerun with TORCHDYNAMO_DISABLE=1" | tee -a "$OUT/summary.log"
        export TORCHDYNAMO_DISABLE=1
        stage e2e-nodynamo ${E2E_LIMIT_S:-330} "$OUT/e2e.log" python3 -m pytest -v -s -rA -p no:cacheprovider -o faulthandler_timeout=120 -m gpu ${E2E_TESTS:-tests/e2e/gpu --deselect tests/e2e/gpu/test_eagle3_acceptance.py}
      fi ;;
    acceptance) stage acceptance ${E2E_LIMIT_S:-540} "$OUT/acceptance.log" python3 -m pytest -v -s -rA -p no:cacheprovider -m gpu tests/e2e/gpu/test_eagle3_acceptance.py ;;
    e2e-rest) stage e2e-rest 330 "$OUT/e2e_rest.log" python3 -m pytest -v -s -rA -p no:cacheprovider -m gpu tests/e2e/gpu --deselect tests/e2e/gpu/test_eagle3_e2e.py --deselect tests/e2e/gpu/test_eagle3_acceptance.py ;;
    bench) stage bench ${BENCH_LIMIT_S:-540} "$OUT/bench.log" python3 tools/gpu_harness/bench_eagle3.py all --out "$OUT/bench" ;;
    # Each prod_check stage writes its checkpoints to a work dir of its own:
    # device_parallel.sh runs several at once.
    prod) stage prod ${PROD_LIMIT_S:-330} "$OUT/prod.log" python3 tools/gpu_harness/prod_check.py offline --out "$OUT/prod" --work "/tmp/eagle3_work_$s" ${PROD_ARGS:-} ;;
    server) stage server ${SERVER_LIMIT_S:-200} "$OUT/prod.log" python3 tools/gpu_harness/prod_check.py server --out "$OUT/prod" --work "/tmp/eagle3_work_$s" ${SERVER_ARGS:-} ;;
    server-kimi) stage server-kimi ${SERVER_LIMIT_S:-200} "$OUT/prod.log" python3 tools/gpu_harness/prod_check.py server --kimi --out "$OUT/prod" --work "/tmp/eagle3_work_$s" ;;
    server-kimi-llama) stage server-kimi-llama ${SERVER_LIMIT_S:-200} "$OUT/prod.log" python3 tools/gpu_harness/prod_check.py server --kimi llama --out "$OUT/prod" --work "/tmp/eagle3_work_$s" ;;
    control) stage control ${CONTROL_LIMIT_S:-90} "$OUT/cache.log" python3 tools/gpu_harness/bench_eagle3.py control --out "$OUT/prod" ${CONTROL_ARGS:-} ;;
    cache-nopatch)
      # vLLM's tree with one file replaced by its state without the compile-cache
      # patch (NOPATCH_FILE: vllm/config/speculative.py taken from
      # prepare.py --without's tarball), ahead of the full site on PYTHONPATH.
      rm -rf /tmp/site-nopatch && mkdir -p /tmp/site-nopatch && cp -r "$SITE/vllm" /tmp/site-nopatch/ \
        && cp "$NOPATCH_FILE" /tmp/site-nopatch/vllm/config/speculative.py \
        && stage cache-nopatch ${CACHE_LIMIT_S:-300} "$OUT/cache.log" env PYTHONPATH="/tmp/site-nopatch:$SITE" \
             python3 tools/gpu_harness/bench_eagle3.py cache --out "$OUT/prod" --tag without-compile-cache-patch ${CACHE_ARGS:-} ;;
    bench-prod) stage bench-prod ${BENCH_LIMIT_S:-540} "$OUT/bench.log" python3 tools/gpu_harness/bench_eagle3.py all --profile production --out "$OUT/bench" ${BENCH_ARGS:-} ;;
    cache) stage cache ${CACHE_LIMIT_S:-300} "$OUT/cache.log" python3 tools/gpu_harness/bench_eagle3.py cache --out "$OUT/prod" ${CACHE_ARGS:-} ;;
    dsa-*)
      # DSA targets through the GPU suite (tests/e2e/gpu/test_eagle3_dsa.py):
      # EAGLE3_HARNESS_DSA=1 installs dsa_ops.py's stand-ins for FlashMLA's
      # sparse kernels and DeepGEMM's indexer logits (neither is built).
      # DeepGEMM's warm-up is for fp8 GEMMs, which these bf16 models have none of.
      stage "$s" ${DSA_LIMIT_S:-540} "$OUT/$s.log" env EAGLE3_HARNESS_DSA=1 VLLM_DEEP_GEMM_WARMUP=skip \
        python3 -m pytest -v -s -rA -p no:cacheprovider -m gpu tests/e2e/gpu/test_eagle3_dsa.py -k "$(k=${s#dsa-}; echo "${k//-/ and }")" ${DSA_PYTEST_ARGS:-} ;;
    int4|int4-*)
      # Kimi-K2.5 INT4 through Marlin MoE (tests/e2e/gpu/test_eagle3_int4.py);
      # int4-aux, int4-acceptance run one of its two tests.
      k=(); [[ $s == int4-* ]] && k=(-k "${s#int4-}")
      stage "$s" ${INT4_LIMIT_S:-540} "$OUT/$s.log" python3 -m pytest -v -s -rA -p no:cacheprovider -m gpu \
        tests/e2e/gpu/test_eagle3_int4.py "${k[@]}" ;;
    speed)
      # The trained pair of an earlier bench-prod stage in this call (or SPEED_ARTIFACTS).
      rm -rf /tmp/speed-art && mkdir -p /tmp/speed-art && tar xzf "${SPEED_ARTIFACTS:-$OUT/bench/artifacts.tar.gz}" -C /tmp/speed-art \
        && stage speed ${SPEED_LIMIT_S:-400} "$OUT/speed.log" python3 tools/gpu_harness/speed.py \
             --artifacts /tmp/speed-art --out "$OUT/bench" ${SPEED_ARGS:-} ;;
    profile)
      rm -rf /tmp/profile-art && mkdir -p /tmp/profile-art && tar xzf "${SPEED_ARTIFACTS:-$OUT/bench/artifacts.tar.gz}" -C /tmp/profile-art \
        && stage profile ${PROFILE_LIMIT_S:-300} "$OUT/profile.log" python3 tools/gpu_harness/step_profile.py \
             --artifacts /tmp/profile-art --out "$OUT/profile" ${PROFILE_ARGS:-} ;;
    project) stage project ${PROJECT_LIMIT_S:-400} "$OUT/project.log" python3 tools/gpu_harness/project.py run \
               --model deepseek-v3 --out "$OUT/project" ${PROJECT_ARGS:-} ;;
    fulldepth|fulldepth-*)  # fulldepth-ENGINES: --engines ENGINES (fulldepth-plain,llama), one results folder each
      e=${s#fulldepth}; e=${e#-}
      stage "$s" ${FULLDEPTH_LIMIT_S:-585} "$OUT/fulldepth.log" python3 tools/gpu_harness/fulldepth.py run \
        --out "$OUT/$s" ${FULLDEPTH_ARGS:---model kimi-k25-int4} ${e:+--engines "$e"} ;;
    backends|backends-*)
      b=${s#backends}; b=${b#-}
      stage "$s" ${BACKENDS_LIMIT_S:-540} "$OUT/prod.log" env ${b:+EAGLE3_BACKENDS=$b} \
        python3 tools/gpu_harness/prod_check.py backends --out "$OUT/prod" --work "/tmp/eagle3_work_$s" ;;
    serving|serving-calibrate|serving-soak)
      # tests/e2e/gpu/test_eagle3_serving.py. serving: cases 1-5, the pairs
      # (SERVING_PAIRS, default "dsv3 kimi") side by side; serving-calibrate:
      # calibrate alone (its engines take 0.9 of the GPU) on the dsv3 pair,
      # trained again unless a serving stage of this call left it in
      # EAGLE3_SERVING_WORK; serving-soak: the 3-minute soak, pair after pair.
      # Trained pairs travel: a carried .device/pairs/pair-NAME.tgz is
      # unpacked instead of prepared again; a pair prepared here comes back
      # as $OUT/pair-NAME.tgz (serving_pairs.py pack / unpack).
      export EAGLE3_SERVING_WORK=${EAGLE3_SERVING_WORK:-/tmp/eagle3_serving_work}
      for t in .device/pairs/pair-*.tgz; do
        [[ -f $t ]] || continue; n=$(basename "$t" .tgz); n=${n#pair-}
        [[ -f $EAGLE3_SERVING_WORK/$n/pair.json ]] || python3 tests/e2e/gpu/serving_pairs.py unpack --tgz "$t" --work "$EAGLE3_SERVING_WORK/$n"
      done
      P=(python3 -m pytest -v -s -rA -p no:cacheprovider -m gpu tests/e2e/gpu/test_eagle3_serving.py)
      case $s in
        serving) for p in ${SERVING_PAIRS:-dsv3 kimi}; do
                   stage "serving-$p" ${SERVING_LIMIT_S:-540} "$OUT/serving-$p.log" "${P[@]}" -k "$p and (${SERVING_K:-not soak})" &
                 done; wait ;;
        serving-calibrate) stage "$s" ${CALIBRATE_LIMIT_S:-540} "$OUT/$s.log" "${P[@]}" -k calibrate ;;
        serving-soak) for p in ${SERVING_PAIRS:-dsv3 kimi}; do
                        stage "$s-$p" ${SOAK_LIMIT_S:-540} "$OUT/$s-$p.log" "${P[@]}" -k "soak and $p"
                      done ;;
      esac
      for w in "$EAGLE3_SERVING_WORK"/*/; do
        n=$(basename "$w")
        [[ -f $w/pair.json && ! -f .device/pairs/pair-$n.tgz && ! -f $OUT/pair-$n.tgz ]] && \
          python3 tests/e2e/gpu/serving_pairs.py pack --work "${w%/}" --out "$OUT/pair-$n.tgz"
      done
      grep -hE "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT"/serving-*.log | tail -30 ;;
    kernels) ;;  # built above, before setup
    sh-*)
      v=SH_$(tr 'a-z-' 'A-Z_' <<<"${s#sh-}")
      stage "$s" ${SH_LIMIT_S:-585} "$OUT/$s.log" bash -c "${!v:-echo $v is not set >&2; exit 2}" ;;
    *) echo "unknown stage $s" ;;
  esac
done
echo "== summary"; cat "$OUT/summary.log"
for f in "$OUT"/ops.log "$OUT"/e2e.log "$OUT"/acceptance.log "$OUT"/e2e_rest.log "$OUT"/prod.log "$OUT"/cache.log "$OUT"/dsa-*.log "$OUT"/int4*.log; do [[ -f $f ]] && { echo "== tail $f"; grep -E "PASSED|FAILED|SKIPPED|Error|passed|failed|^RUN|^AGREE|^SERVER|^MATRIX|^CACHE|^CONTROL|^DSA|^INT4|^REF|^RESULT" "$f" | cut -c1-1200 | tail -24; }; done
[[ -f $OUT/profile.log ]] && { echo "== profile"; grep -E "^PROFILE|Error" "$OUT/profile.log" | cut -c1-1500 | tail -4; }
[[ -f $OUT/fulldepth.log ]] && { echo "== fulldepth"; grep -E "^ENGINE|^SKIP|Error|Traceback|Killed|out of memory" "$OUT/fulldepth.log" | cut -c1-600 | tail -12; }
[[ -f $OUT/project.log ]] && { echo "== project"; grep -E "^STEP|Error|projected" "$OUT/project.log" | cut -c1-600 | tail -12; }
[[ -f $OUT/speed.log ]] && { echo "== speed"; grep -E "^SPEED|Error" "$OUT/speed.log" | cut -c1-1500 | tail -8; }
[[ -f $OUT/bench.log ]] && { echo "== bench"; grep -E "RESULT|tok/s|equal to plain|captured|rule accuracy|Error|SPEEDUP|predicted" "$OUT/bench.log" | cut -c1-1500 | tail -24; }
publish
[[ $OUT_PACK == 1 ]] && rm -rf "$OUT"
exit 0
