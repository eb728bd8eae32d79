#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Quick, talkative first check of the harness: one plain and one EAGLE-3
engine on the tiny DeepSeek-V3, engine core in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that a stall can be located:
every DIAG_DUMP_S seconds all thread stacks are dumped to stderr.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e" / "gpu"))


def main() -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    faulthandler.dump_traceback_later(int(os.environ.get("DIAG_DUMP_S", "50")), repeat=True)
    import gpu_e2e_helpers as h

    h.configure_env()
    t0 = time.perf_counter()
    ck = h.make_checkpoints(Path(tempfile.mkdtemp(prefix="diag_")))
    from vllm import LLM

    prompts = h.token_prompts([4, 33], seed=0)
    results = {}
    modes = os.environ.get("DIAG_MODES", "plain,eagle3").split(",")
    for name, drafter in (("plain", None), ("eagle3", ck.drafter)):
        if name not in modes:
            continue
        t = time.perf_counter()
        llm = LLM(**h.engine_kwargs(ck.deepseek_v3, drafter))
        print(f"DIAG {name}: engine up in {time.perf_counter() - t:.1f}s", flush=True)
        t = time.perf_counter()
        toks, metrics = h.generate_tokens(llm, prompts, 16)
        print(f"DIAG {name}: generate {time.perf_counter() - t:.1f}s tokens={toks} metrics={metrics}", flush=True)
        results[name] = toks
        h.shutdown(llm)
    if len(results) == 2:
        print(f"DIAG equal={results['plain'] == results['eagle3']}", flush=True)
    print(f"DIAG total {time.perf_counter() - t0:.1f}s", flush=True)
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
