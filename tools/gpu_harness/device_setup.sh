#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install the GPU harness on the lent device (run from the repository root):
#   KERNELS=DIR|FILE.tar.xz bash tools/gpu_harness/device_setup.sh [SITE]   (default SITE=/tmp/site)
# Needs the carried paths .device/whl (or .device/site) and .device/vllm (tools/gpu_harness/prepare.py)
# and vLLM's own kernels built from the pinned sources (kernels.py build --out
# DIR, or the kernels-libs.tar.xz it writes; device_run.sh kernels does both).
# Afterwards PYTHONPATH=SITE gives: the carried wheels, vLLM 0.16.0's (patched)
# Python files with the built _C, _moe_C and _vllm_fa3_C laid out as in the
# wheel, DeepGEMM where the build has it, the DSA start-up hook and the
# xgrammar import placeholder. Nothing is
# installed into the image.
set -euo pipefail
SITE=${1:-/tmp/site}
if [[ -z ${KERNELS:-} ]]; then
  echo "device_setup.sh: KERNELS is not set. vLLM's CUDA ops come from kernels.py build:" \
       "run 'device_run.sh kernels' once, then carry the kernels-libs.tar.xz it returns" \
       "(KERNELS=.device/kernels/kernels-libs.tar.xz)" >&2
  exit 1
fi
mkdir -p "$SITE"
if [[ -f .device/site/site.tar.xz ]]; then  # prepare.py --site: the same wheels, unpacked
  tar -xJf .device/site/site.tar.xz -C "$SITE"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .device/whl/*.whl
fi
# VLLM_TARBALL picks another staged tree (prepare.py --without PATCH).
tar -xJf "${VLLM_TARBALL:-.device/vllm/vllm-py.tar.xz}" -C "$SITE"
if [[ -f $KERNELS && $KERNELS == *.tar.xz ]]; then
  rm -rf /tmp/eagle3-kernel-libs && mkdir -p /tmp/eagle3-kernel-libs && tar -xJf "$KERNELS" -C /tmp/eagle3-kernel-libs
  KERNELS=/tmp/eagle3-kernel-libs
fi
[[ -f $KERNELS/kernels.json ]] || { echo "KERNELS=$KERNELS holds no kernels.json: run kernels.py build" >&2; exit 1; }
cp -r "$KERNELS/vllm/." "$SITE/vllm/"
# DeepGEMM, which kernels.py builds beside vLLM's ops. A build from before
# it was added lacks it; the DSA tests then skip, naming kernels.py.
if [[ -d $KERNELS/deep_gemm ]]; then rm -rf "$SITE/deep_gemm" && cp -r "$KERNELS/deep_gemm" "$SITE/"; fi
# FlashMLA sparse (no obtainable pinned source) is not in kernels.py's build:
# with EAGLE3_HARNESS_DSA=1 its stand-ins go into every Python process, after
# the built vllm._C has registered its ops (a built op always wins).
cp tools/gpu_harness/dsa_ops.py "$SITE/vllm/_gpu_harness_dsa_ops.py"
cp tools/gpu_harness/dsa_sitecustomize.py "$SITE/sitecustomize.py"
rm -rf "$SITE/xgrammar" && cp -r tools/gpu_harness/stubs/xgrammar "$SITE/"
PYTHONPATH="$SITE" python3 - <<'PY'
import torch, transformers, triton, vllm, vllm._C
from importlib.resources import files
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "transformers", transformers.__version__, "vllm", vllm.__version__, vllm.__file__)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print("vllm._C:", vllm._C.__file__)
from vllm.vllm_flash_attn import flash_attn_interface as fai
print("FA2:", fai.FA2_AVAILABLE, fai.FA2_UNAVAILABLE_REASON, "| FA3:", fai.FA3_AVAILABLE, fai.FA3_UNAVAILABLE_REASON)
print("manifest:", (files("vllm") / "_gpu_harness_manifest.json").read_text())
PY
