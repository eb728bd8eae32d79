# SPDX-License-Identifier: Apache-2.0
"""Reading vLLM's torch-profiler traces, shared by step_profile.py and
project.py: a worker trace broken down per decode step and per runner range.
Standard library only; imports no other harness module."""

from __future__ import annotations

import bisect
import json
import statistics
from collections import Counter
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
# The host calls that start GPU work (cuLaunchKernel, Triton's launch, is
# "cuda_driver"), and the GPU work each starts: a kernel, copy or fill names
# the call by its args.correlation. A kernel a CUDA graph replays names the
# cudaGraphLaunch that replayed it.
_HOST_CATS = ("cuda_runtime", "cuda_driver")
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# The drafter's passes: vLLM 0.16's EagleProposer.propose has no range per
# pass, but ends each pass with one greedy `logits.argmax(dim=-1)` on the
# host (eagle.py), so inside the `draft` range pass i runs up to the end of
# the i-th aten::argmax. What follows the last one (stacking the drafts,
# their copy to the host) is the draft's tail. A pass's part before its
# first graph replay (cudaGraphLaunch) is its inputs: slot mapping,
# attention metadata, the copies into the graph's buffers; the rest is its
# forward, logits and argmax.
DRAFT_RANGE = "draft"
PASS_END = "aten::argmax"
OUTSIDE = "(outside runner ranges)"
TOP_KERNELS = 15
# GPU time per step of the attention kernels, by name (a substring), on the
# registry build: the Triton MLA decode kernel's two stages, and what MLA
# prefill runs there (a verify on a single-token decode backend):
# FlashInfer's ragged prefill, the merge of context chunks and the gather
# of the cached context. Prefill's up-projection of the context (kv_b_proj)
# is a GEMM the trace cannot tell from the others.
KERNEL_GROUPS = {
    "attn_decode": ("_fwd_grouped_kernel_stage1", "_fwd_kernel_stage2"),
    "attn_prefill": ("BatchPrefillWithRaggedKVCache", "merge_attn_states", "gather_and_maybe_dequant_cache"),
}


def step_breakdown(trace: dict, phases: bool = True) -> dict:
    """A worker trace of vLLM's torch profiler, broken down two ways.

    ``ranges``: per runner range (RUNNER_RANGES), the CPU wall time and the
    CUDA runtime calls inside it, graph replays (cudaGraphLaunch) against
    eager kernel launches.

    ``steps``: over the decode steps (STEP_RANGE on the CPU; the steps whose
    execute range is followed by another, the first and last dropped), the
    median period, execute and after-execute time, GPU kernel time per
    period, the share of the period the GPU ran kernels, and the graph
    replays and eager launches per step inside execute and after it; with
    ``phases``, also phase_breakdown's phases and top kernels over them."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    # The profiler mirrors each range on the GPU timeline
    # (gpu_user_annotation); only the host's is the range.
    ranges = [e for e in events if str(e.get("name", "")).startswith(RUNNER_RANGES)
              and e.get("cat") != "gpu_user_annotation"]
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
    rows, periods = [], []
    for i in range(1, len(steps) - 1):  # the first period holds the profiler's start
        a, b = steps[i], steps[i + 1]
        lo, mid, hi = a["ts"], a["ts"] + a["dur"], b["ts"]
        row = {"period_ms": (hi - lo) / 1000, "execute_ms": a["dur"] / 1000,
               "after_execute_ms": (hi - mid) / 1000,
               "gpu_kernel_ms": sum(e["dur"] for e in gpu if lo <= e["ts"] < hi) / 1000}
        for group, names in KERNEL_GROUPS.items():
            row[f"{group}_gpu_ms"] = sum(e["dur"] for e in gpu if lo <= e["ts"] < hi
                                         and any(n in str(e.get("name", "")) for n in names)) / 1000
        for part, (x, y) in (("execute", (lo, mid)), ("after_execute", (mid, hi))):
            calls = [str(e.get("name", "")) for e in runtime if x <= e["ts"] < y]
            row[f"{part}_graph_launches"] = sum(n.startswith("cudaGraphLaunch") for n in calls)
            row[f"{part}_kernel_launches"] = sum(n.startswith(_LAUNCH) for n in calls)
        rows.append(row)
        periods.append((lo, hi))
    if rows:
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        med["gpu_busy_fraction"] = sum(r["gpu_kernel_ms"] for r in rows) / sum(r["period_ms"] for r in rows)
        res["steps"] = {"count": len(rows), "median": med, **(phase_breakdown(events, periods) if phases else {})}
    return res


def _phase_intervals(marks: dict, lo: float, hi: float) -> list[tuple]:
    """The phases of one step period [lo, hi) on the host: (start, end, pid,
    tid, name) for each runner range that starts in it, the draft range cut
    into its passes (see PASS_END) and each pass into inputs and forward.
    ``marks``: the trace's runner ranges, PASS_END ops and graph launches."""
    out = []
    for r in (r for r in marks["ranges"] if lo <= r["ts"] < hi):
        name, a, b = r["name"][len(RUNNER_RANGES):], r["ts"], r["ts"] + r["dur"]
        who = (r.get("pid"), r.get("tid"))
        if name != DRAFT_RANGE:
            out.append((a, b, *who, name))
            continue
        ends = sorted(e["ts"] + e["dur"] for e in marks["pass_ends"]
                      if (e.get("pid"), e.get("tid")) == who and a <= e["ts"] and e["ts"] + e["dur"] <= b)
        graphs = sorted(e["ts"] for e in marks["graphs"] if (e.get("pid"), e.get("tid")) == who and a <= e["ts"] <= b)
        start = a
        for i, end in enumerate(ends, 1):
            first_graph = next((g for g in graphs if start <= g < end), None)
            if first_graph is not None and first_graph > start:
                out.append((start, first_graph, *who, f"draft pass {i} inputs"))
                out.append((first_graph, end, *who, f"draft pass {i}"))
            else:
                out.append((start, end, *who, f"draft pass {i}"))
            start = end
        out.append((start, b, *who, "draft tail" if ends else name))
    return out


def phase_breakdown(events: list[dict], periods: list[tuple[float, float]], top: int = TOP_KERNELS) -> dict:
    """Each step period cut into phases (_phase_intervals), medians over the
    periods.

    ``phases``: {name: {gpu_ms, launches, graph_launches, host_ms,
    host_before_launch_ms}} in the order they run. A GPU kernel, copy or fill
    counts to the phase its host launch (the call of the same correlation)
    lies in, whenever it ran on the GPU; a launch in no runner range counts
    to OUTSIDE, whose host time is the period less its runner ranges.
    host_ms is the phase's host wall time, host_before_launch_ms the host
    time from its start to its first launch (medians over the periods that
    have one). ``top_kernels``: the GPU work of the periods by time, per
    (name, grid, block): calls and ms per step, the phase most of it
    launched from, and its ms per step in each phase. ``unmatched_gpu_ms``: the GPU work per step (mean, by its
    own time stamp) whose launch the trace lacks."""
    host = {}
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") in _HOST_CATS and corr is not None:
            host[corr] = e
    gpu = [e for e in events if e.get("cat") in _GPU_CATS]
    launched = {(e.get("args") or {}).get("correlation") for e in gpu}
    launches = sorted((e for e in host.values() if e["args"]["correlation"] in launched), key=lambda e: e["ts"])
    starts = [e["ts"] for e in launches]
    marks = {"ranges": sorted((e for e in events if str(e.get("name", "")).startswith(RUNNER_RANGES)
                               and e.get("cat") != "gpu_user_annotation"), key=lambda e: e["ts"]),
             "pass_ends": [e for e in events if e.get("name") == PASS_END and e.get("cat") == "cpu_op"],
             "graphs": [e for e in events if e.get("cat") in _HOST_CATS
                        and str(e.get("name", "")).startswith("cudaGraphLaunch")]}
    per: list[dict] = []
    order: list[str] = []
    top_acc: dict = {}
    unmatched = [0.0] * len(periods)
    phase_of: dict = {}  # correlation -> (period index, phase)
    for p, (lo, hi) in enumerate(periods):
        iv = _phase_intervals(marks, lo, hi)
        rows = {name: {"gpu_ms": 0.0, "launches": 0, "graph_launches": 0, "host_ms": (b - a) / 1000}
                for a, b, _, _, name in iv}
        outside = (hi - lo) - sum(b - a for a, b, *_ in iv)
        rows[OUTSIDE] = {"gpu_ms": 0.0, "launches": 0, "graph_launches": 0, "host_ms": outside / 1000}
        for name in [*(x[4] for x in iv), OUTSIDE]:
            if name not in order:
                order.append(name)
        for e in launches[bisect.bisect_left(starts, lo):bisect.bisect_left(starts, hi)]:
            who = (e.get("pid"), e.get("tid"))
            inside = [x for x in iv if x[0] <= e["ts"] < x[1] and (x[2], x[3]) == who]
            name = max(inside, key=lambda x: x[0])[4] if inside else OUTSIDE
            row = rows[name]
            row["launches"] += 1
            row["graph_launches"] += str(e.get("name", "")).startswith("cudaGraphLaunch")
            if inside and "host_before_launch_ms" not in row:
                row["host_before_launch_ms"] = (e["ts"] - max(inside, key=lambda x: x[0])[0]) / 1000
            phase_of[e["args"]["correlation"]] = (p, name)
        per.append(rows)
    for e in gpu:
        hit = phase_of.get((e.get("args") or {}).get("correlation"))
        if hit is None:
            if (e.get("args") or {}).get("correlation") not in host:
                for p, (lo, hi) in enumerate(periods):
                    if lo <= e["ts"] < hi:
                        unmatched[p] += e["dur"] / 1000
            continue
        p, name = hit
        per[p][name]["gpu_ms"] += e["dur"] / 1000
        args = e.get("args") or {}
        key = (str(e.get("name", "")), e.get("cat"), str(args.get("grid")), str(args.get("block")))
        acc = top_acc.setdefault(key, {"calls": 0, "us": 0.0, "phases": Counter(), "grid": args.get("grid"),
                                       "block": args.get("block")})
        acc["calls"] += 1
        acc["us"] += e["dur"]
        acc["phases"][name] += e["dur"]
    n = len(periods)
    phases = {}
    for name in order:
        cells = [rows[name] for rows in per if name in rows]
        row = {k: statistics.median([c[k] for c in cells] + [0] * (n - len(cells)))
               for k in ("gpu_ms", "launches", "graph_launches")}
        row["host_ms"] = statistics.median(c["host_ms"] for c in cells)
        before = [c["host_before_launch_ms"] for c in cells if "host_before_launch_ms" in c]
        if before:
            row["host_before_launch_ms"] = statistics.median(before)
        row["steps_seen"] = len(cells)
        phases[name] = row
    ranked = sorted(top_acc.items(), key=lambda kv: -kv[1]["us"])[:top]
    top_kernels = [{"name": k[0], "cat": k[1], "grid": v["grid"], "block": v["block"],
                    "calls_per_step": v["calls"] / n, "ms_per_step": v["us"] / 1000 / n,
                    "phase": v["phases"].most_common(1)[0][0],
                    "phases": {ph: us / 1000 / n for ph, us in v["phases"].most_common()}}
                   for k, v in ranked]
    return {"phases": phases, "top_kernels": top_kernels,
            "unmatched_gpu_ms": sum(unmatched) / n if n else 0.0}


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
