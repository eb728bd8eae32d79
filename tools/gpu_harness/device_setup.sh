#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install the GPU harness on the lent device (run from the repository root):
#   bash tools/gpu_harness/device_setup.sh [SITE]      (default SITE=/tmp/site)
# Needs the carried paths .device/whl and .device/vllm (tools/gpu_harness/prepare.py).
# Afterwards PYTHONPATH=SITE gives: the carried wheels, vLLM 0.16.0's (patched)
# Python files, vllm/_C.py (stand-in) + vllm/_gpu_harness_ops.py (torch ops)
# and the xgrammar import placeholder. Nothing is installed into the image.
set -euo pipefail
SITE=${1:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .device/whl/*.whl
# VLLM_TARBALL picks another staged tree (prepare.py --without PATCH).
tar -xJf "${VLLM_TARBALL:-.device/vllm/vllm-py.tar.xz}" -C "$SITE"
cp tools/gpu_harness/torch_ops.py "$SITE/vllm/_gpu_harness_ops.py"
cp tools/gpu_harness/dsa_ops.py "$SITE/vllm/_gpu_harness_dsa_ops.py"
cp tools/gpu_harness/standin_C.py "$SITE/vllm/_C.py"
cp tools/gpu_harness/standin_fa2_C.py "$SITE/vllm/vllm_flash_attn/_vllm_fa2_C.py"
rm -rf "$SITE/xgrammar" && cp -r tools/gpu_harness/stubs/xgrammar "$SITE/"
PYTHONPATH="$SITE" python3 - <<'PY'
import torch, transformers, triton, vllm, vllm._C
from importlib.resources import files
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "transformers", transformers.__version__, "vllm", vllm.__version__, vllm.__file__)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print("harness ops:", len(vllm._C.HARNESS_OPS))
from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported
print("FA2 (harness varlen_fwd):", is_fa_version_supported(2), "FA3:", is_fa_version_supported(3))
print("manifest:", (files("vllm") / "_gpu_harness_manifest.json").read_text())
PY
