#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Several device_run.sh stages at once on the one GPU, after one setup:
#   bash tools/gpu_harness/device_parallel.sh STAGE...
# Each engine takes EAGLE3_GPU_MEM_UTIL (default 0.12) of the GPU memory, so a
# few fit side by side; cold engine starts (about 90 s, mostly torch.compile)
# then overlap instead of adding up. Each stage logs to $OUT/STAGE/; at the
# end everything but trained weights is packed into $OUT/parallel.tgz (the
# device tool returns at most 8 files).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_harness_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}
bash tools/gpu_harness/device_setup.sh /tmp/site >"$OUT/setup.log" 2>&1 || { tail -30 "$OUT/setup.log"; exit 1; }
for s in "$@"; do
  mkdir -p "$OUT/$s"
  SKIP_SETUP=1 OUT_PACK=0 OUT="$OUT/$s" bash tools/gpu_harness/device_run.sh "$s" >"$OUT/$s/run.log" 2>&1 &
done
wait
for s in "$@"; do echo "== $s"; tail -12 "$OUT/$s/run.log" | cut -c1-1500; done
# Trained weights (the bench's artifacts.tar.gz, ~10 MB each) go beside the
# archive, one file per stage: inside it they pushed it over the size the
# device tool returns, and the whole archive was left out (call 7).
mkdir -p /tmp/parallel_big
for f in $(find "$OUT" -name artifacts.tar.gz); do
  mv "$f" "/tmp/parallel_big/artifacts_$(echo "${f#"$OUT"/}" | cut -d/ -f1).tar.gz"
done
tar -czf /tmp/parallel.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/parallel.tgz "$OUT/"
find /tmp/parallel_big -type f -exec mv {} "$OUT/" \;
