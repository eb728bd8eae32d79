# SPDX-License-Identifier: Apache-2.0
"""Reading vLLM's torch-profiler traces, shared by step_profile.py and
project.py: a worker trace broken down per decode step and per runner range.
Standard library only; imports no other harness module."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

# vLLM's record_function ranges inside the runner (preprocess, forward =
# target verify, sample = rejection sampler, draft = drafter passes,
# bookkeep, ...). vLLM 0.16 opens them only with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1
# (vllm/v1/utils.py record_function_or_nullcontext); without it a trace has
# none.
RUNNER_RANGES = "gpu_model_runner: "
# The worker's range around each execute_model call (gpu_worker.py,
# "execute_context_<n>(<tokens>)_generation_<n>(<tokens>)"). With
# speculative decoding, sampling and the drafter run in sample_tokens,
# after it; so a step's period (one execute start to the next) splits into
# execute (input preparation + target forward) and after-execute (sampler,
# drafter, scheduler, output handling).
STEP_RANGE = "execute_context_"
_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel")


def step_breakdown(trace: dict) -> dict:
    """A worker trace of vLLM's torch profiler, broken down two ways.

    ``ranges``: per runner range (RUNNER_RANGES), the CPU wall time and the
    CUDA runtime calls inside it, graph replays (cudaGraphLaunch) against
    eager kernel launches.

    ``steps``: over the decode steps (STEP_RANGE on the CPU; the steps whose
    execute range is followed by another, the first and last dropped), the
    median period, execute and after-execute time, GPU kernel time per
    period, the share of the period the GPU ran kernels, and the graph
    replays and eager launches per step inside execute and after it."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges = [e for e in events if str(e.get("name", "")).startswith(RUNNER_RANGES)]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    out: dict = {}
    for r in ranges:
        name = r["name"][len(RUNNER_RANGES):]
        row = out.setdefault(name, {"count": 0, "cpu_ms": 0.0, "graph_launches": 0, "kernel_launches": 0})
        row["count"] += 1
        row["cpu_ms"] += r["dur"] / 1000
        lo, hi = r["ts"], r["ts"] + r["dur"]
        for e in events:
            if e.get("tid") == r.get("tid") and e.get("pid") == r.get("pid") and lo <= e["ts"] <= hi:
                n = str(e.get("name", ""))
                if n.startswith("cudaGraphLaunch"):
                    row["graph_launches"] += 1
                elif n.startswith(_LAUNCH):
                    row["kernel_launches"] += 1
    gpu = [e for e in events if e.get("cat") == "kernel"]
    res = {"ranges": out, "gpu_kernel_ms": sum(e["dur"] for e in gpu) / 1000, "gpu_kernels": len(gpu)}

    steps = sorted((e for e in events if e.get("cat") != "gpu_user_annotation"
                    and str(e.get("name", "")).startswith(STEP_RANGE)), key=lambda e: e["ts"])
    rows = []
    for i in range(1, len(steps) - 1):  # the first period holds the profiler's start
        a, b = steps[i], steps[i + 1]
        lo, mid, hi = a["ts"], a["ts"] + a["dur"], b["ts"]
        row = {"period_ms": (hi - lo) / 1000, "execute_ms": a["dur"] / 1000,
               "after_execute_ms": (hi - mid) / 1000,
               "gpu_kernel_ms": sum(e["dur"] for e in gpu if lo <= e["ts"] < hi) / 1000}
        for part, (x, y) in (("execute", (lo, mid)), ("after_execute", (mid, hi))):
            calls = [str(e.get("name", "")) for e in runtime if x <= e["ts"] < y]
            row[f"{part}_graph_launches"] = sum(n.startswith("cudaGraphLaunch") for n in calls)
            row[f"{part}_kernel_launches"] = sum(n.startswith(_LAUNCH) for n in calls)
        rows.append(row)
    if rows:
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        med["gpu_busy_fraction"] = sum(r["gpu_kernel_ms"] for r in rows) / sum(r["period_ms"] for r in rows)
        res["steps"] = {"count": len(rows), "median": med}
    return res


def worker_trace(trace_dir: Path, skip: set[str] = frozenset()) -> tuple[str, dict]:
    """The path and the parsed JSON of the worker trace vLLM's torch profiler
    wrote under ``trace_dir`` (the first, leaving out the paths in ``skip``)."""
    import glob
    import gzip

    traces = sorted(set(glob.glob(str(trace_dir / "**" / "*.json*"), recursive=True)) - set(skip))
    worker = [t for t in traces if "rank" in Path(t).name or "worker" in Path(t).name] or traces
    if not worker:
        raise RuntimeError(f"the profiler wrote no trace under {trace_dir}")
    with (gzip.open if worker[0].endswith(".gz") else open)(worker[0], "rt") as f:
        return worker[0], json.load(f)
