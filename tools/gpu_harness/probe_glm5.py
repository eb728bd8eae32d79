#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Record what happens when the harness tries to serve a tiny GLM-5 target.

GLM-5 (glm_moe_dsa) is DeepSeek-V3.2-style sparse attention (DSA: an indexer
picks index_topk keys per query, then sparse MLA). This probe starts the real
engine on a tiny GLM-5 checkpoint with an EAGLE-3 drafter in two settings and
prints where each stops:

  a) VLLM_MLA_DISABLE=1, TRITON_ATTN (the harness's attention route)
  b) MLA left on, default backend selection (FLASHMLA_SPARSE on Hopper)

Each attempt runs in its own process with a time limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e" / "gpu"))


def attempt(glm: str, drafter: str, mla: bool) -> None:
    import gpu_e2e_helpers as h

    if mla:
        os.environ["EAGLE3_GPU_MLA"] = "1"
    h.configure_env()
    if mla:
        os.environ.pop("VLLM_MLA_DISABLE", None)
    from vllm import LLM

    kw = h.engine_kwargs(glm, drafter, trust_remote_code=True)
    if mla:
        kw["dtype"] = "bfloat16"
    try:
        llm = LLM(**kw)
        toks, metrics = h.generate_tokens(llm, h.token_prompts([5, 20]), 8)
        print("PROBE_RESULT served", json.dumps({"tokens": toks, "metrics": metrics}))
        h.shutdown(llm)
    except BaseException as e:  # noqa: BLE001 - we want the exact failure
        tb = traceback.format_exc()
        print(tb[-4000:])
        print("PROBE_RESULT failed:", type(e).__name__, str(e).splitlines()[0][:400] if str(e) else "")


def main() -> int:
    if len(sys.argv) == 4:
        attempt(sys.argv[1], sys.argv[2], sys.argv[3] == "mla")
        return 0
    import gpu_e2e_helpers as h

    tiny = h._tiny()
    root = Path(tempfile.mkdtemp(prefix="glm5_probe_"))
    glm, drafter = root / "glm5", root / "drafter"
    tiny.write_checkpoint("glm5", glm, seed=3, remote_code_config=True)
    tiny.write_checkpoint("eagle3-drafter", drafter, seed=2, **h.DRAFTER_SHAPE)
    for mode in ("mla_disabled", "mla"):
        print(f"=== GLM-5 probe: {mode}", flush=True)
        try:
            r = subprocess.run(
                [sys.executable, __file__, str(glm), str(drafter), mode],
                capture_output=True, text=True, timeout=110,
            )
            out = r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            out = f"{e.stdout or ''}{e.stderr or ''}\nPROBE_RESULT timeout after 110 s"
        lines = out.splitlines()
        errs = [ln for ln in lines if "Error" in ln or "assert" in ln.lower() or "PROBE_RESULT" in ln]
        print("\n".join(lines[-60:]))
        print(f"=== {mode} summary:\n" + "\n".join(errs[-12:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
