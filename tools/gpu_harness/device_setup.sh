#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install the GPU harness on the lent device (run from the repository root):
#   KERNELS=DIR|FILE.tar.xz bash tools/gpu_harness/device_setup.sh [SITE]   (default SITE=/tmp/site)
# Needs the carried paths .device/whl (or .device/site) and .device/vllm (tools/gpu_harness/prepare.py)
# and vLLM's own kernels built from the pinned sources (kernels.py build --out
# DIR, or the kernels-libs.tar.xz it writes; device_run.sh kernels does both).
# Afterwards PYTHONPATH=SITE gives: the carried wheels, vLLM 0.16.0's (patched)
# Python files with the built _C and _moe_C laid out as in the wheel,
# FlashInfer (a carried wheel; it compiles its kernels with the image's nvcc
# on first use, into FLASHINFER_WORKSPACE_BASE, which a carried
# .device/fi-jit/fi-jit.tar.xz fills ahead), the harness's start-up hook
# (harness_sitecustomize.py: the DSA stand-ins, FlashInfer MLA prefill on
# Hopper) and the xgrammar import placeholder. Nothing is installed into the
# image.
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
# FlashMLA sparse and DeepGEMM (no registry release at v0.16.0's pins) are
# not in kernels.py's build: with EAGLE3_HARNESS_DSA=1 their stand-ins go into
# every Python process, after the built vllm._C has registered its ops (a
# built op always wins). EAGLE3_HARNESS_FI_PREFILL=1 (device_run.sh sets it)
# sends MLA prefill on Hopper to FlashInfer (fi_prefill.py).
cp tools/gpu_harness/dsa_ops.py "$SITE/vllm/_gpu_harness_dsa_ops.py"
cp tools/gpu_harness/fi_prefill.py "$SITE/_eagle3_fi_prefill.py"
cp tools/gpu_harness/harness_sitecustomize.py "$SITE/sitecustomize.py"
if [[ -f .device/fi-jit/fi-jit.tar.xz ]]; then
  # Packed from the workspace (.cache/flashinfer/...), as device_run.sh packs
  # it, or with one folder above that (the first one came as fi-ws/.cache/...).
  strip=1; [[ $(tar -tJf .device/fi-jit/fi-jit.tar.xz | head -1) == .cache* ]] && strip=0
  mkdir -p "${FLASHINFER_WORKSPACE_BASE:-$HOME}" \
    && tar -xJf .device/fi-jit/fi-jit.tar.xz -C "${FLASHINFER_WORKSPACE_BASE:-$HOME}" --strip-components=$strip
fi
rm -rf "$SITE/xgrammar" && cp -r tools/gpu_harness/stubs/xgrammar "$SITE/"
PYTHONPATH="$SITE" python3 - <<'PY'
import torch, transformers, triton, vllm, vllm._C
from importlib.resources import files
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "transformers", transformers.__version__, "vllm", vllm.__version__, vllm.__file__)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print("vllm._C:", vllm._C.__file__)
import flashinfer
print("flashinfer", flashinfer.__version__, flashinfer.__file__)
from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
print("vllm_flash_attn version:", get_flash_attn_version(), "(None: not in this build)")
print("manifest:", (files("vllm") / "_gpu_harness_manifest.json").read_text())
PY
