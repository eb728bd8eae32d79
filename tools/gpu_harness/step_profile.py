#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The step profile: where one plain and one EAGLE-3 decode step spend their time.

    python tools/gpu_harness/step_profile.py --artifacts A --out DIR [--batch 1] [--steps 32]

A is the pair bench_eagle3.py all trained. Each engine runs under vLLM's
torch profiler for ``--steps`` decode steps; step_trace.step_breakdown splits
the worker trace per decode step (execute = input preparation and the
target's verify; after it = rejection sampler, drafter passes, bookkeeping)
and per runner range. Writes DIR/profile.json and the traces.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Run as a script: the repository root goes last on sys.path (so
# `tools.gpu_harness` resolves and the installed vllm stays first).
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e" / "gpu"))

import gpu_e2e_helpers as h  # noqa: E402
from tools.gpu_harness import engine  # noqa: E402
from tools.gpu_harness.data import rule_prompts  # noqa: E402
from tools.gpu_harness.step_trace import step_breakdown, worker_trace  # noqa: E402


def profile(out_dir: Path, artifacts: Path, batch: int, steps: int) -> dict:
    """One plain and one EAGLE-3 engine (the trained drafter), each profiled
    with vLLM's torch profiler over ``steps`` decode steps at ``batch``;
    the worker traces are broken down by step_breakdown()."""
    h.configure_env()
    os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"  # the runner ranges (RUNNER_RANGES)
    target, trained = artifacts / "deepseek_v3", artifacts / "drafter_trained"
    prompts = rule_prompts(batch, seed=1000)
    from vllm import SamplingParams

    res = {"batch": batch, "steps": steps, "profile": h.profile(),
           "command": engine.command_line()}
    for name, drafter in (("plain", None), ("eagle3", trained)):
        tdir = out_dir / f"trace_{name}"
        tdir.mkdir(parents=True, exist_ok=True)
        llm = engine.make_llm(target, drafter, profiler_config={"profiler": "torch", "torch_profiler_dir": str(tdir),
                                                     "torch_profiler_with_stack": False})
        try:
            res.setdefault("engine", {})[name] = h.engine_facts(llm)
            llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)  # warm
            llm.start_profile()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True),
                         use_tqdm=False)
            llm.stop_profile()
        finally:
            h.shutdown(llm)
        path, trace = worker_trace(tdir)
        res[name] = {"trace": str(Path(path).relative_to(out_dir)), **step_breakdown(trace)}
        print("PROFILE", name, json.dumps(res[name]), flush=True)
    (out_dir / "profile.json").write_text(json.dumps(res, indent=1))
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--artifacts", type=Path, required=True, help="the trained pair of bench_eagle3.py all")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--profile", choices=h.PROFILES, default="production")
    args = ap.parse_args(argv)
    os.environ["EAGLE3_GPU_PROFILE"] = args.profile
    args.out.mkdir(parents=True, exist_ok=True)
    profile(args.out, args.artifacts, args.batch, args.steps)


if __name__ == "__main__":
    main()
