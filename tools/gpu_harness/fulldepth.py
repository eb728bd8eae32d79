#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Measure plain and EAGLE-3 decode steps at the full 61 layers of one TP-8 rank.

    python3 tools/gpu_harness/fulldepth.py run --model kimi-k25-int4 --engines plain,llama,mla --out DIR   (a GPU)
    python3 tools/gpu_harness/fulldepth.py summarize DIR/fulldepth_*.json                                  (anywhere)

One rank's share of every layer of the published config (project.py's
``geometry()``, the same per-rank target and drafters), all 61 layers, random
weights (``load_format="dummy"``), vLLM's production settings: bf16, the
backend vLLM picks, torch.compile and CUDA graphs (FULL_AND_PIECEWISE, which
vLLM lowers where a backend cannot), prefix caching, async scheduling as vLLM
0.16 defaults it unless ``--async-scheduling`` says otherwise. Kimi-K2.5
INT4's experts must run on Marlin MoE, DeepSeek-V3's fp8 release
(``--model deepseek-v3-fp8``) in fp8 (its facts name the GEMM of each linear
shape, DeepGEMM or Triton, and the MoE backend), and the target on an MLA
backend, or the run stops: the step times would not be the model's.

Memory comes from the card, before anything loads (memory_plan.py): the
rank share's weights counted from its config, the KV cache of the largest
(context, batch) cell and an activation reserve set ``kv_cache_memory_bytes``,
``gpu_memory_utilization`` and ``max_num_batched_tokens``; a cell the card
cannot hold is skipped with one line naming the shortfall in GiB, and with no
cell left the run stops. ``--mem-util`` uses vLLM's memory profile instead.

``run`` starts one engine per entry of ``--engines`` (plain, llama, mla), in
that order, and in each times ``--gen-tokens`` greedy tokens at every
(context, batch) cell of ``--contexts`` x ``--batches``, ``--repeats`` times,
the cells interleaved within each repeat, so drift over the engine's life
spreads over every cell. Each request's prompt of ``context`` tokens comes
from the prefix cache; its first token is timed apart (a one-token
generate()) and taken out, so the wall ms per step is decode only: one step
per token plain, one per draft with EAGLE-3 (read from the spec-decode
counters). Each cell records the CUDA-graph mode its uniform decode batches
dispatched (plain decode, or the verify at k + 1 tokens), the engine the
MLA prefill path, the Triton MLA decode kernel's KV splits and the card's
copy bandwidth. After the timed repeats a short profiled window (vLLM's
torch profiler) gives the median GPU kernel time per step; wall minus GPU
time is the time the GPU sat idle in a step. The same window breaks the step
down (step_trace.py): GPU and host time per runner phase (input preparation,
target forward, sampler, each drafter pass and the inputs before it,
bookkeeping), the top kernels by GPU time with their grid and block, and the
attention kernels' GPU time, which ``summarize`` puts beside the step's
KV-bandwidth bound (the latent KV it reads over the copy bandwidth). One
result file per context, rewritten after every cell, so a run cut short
keeps what it measured.

With random weights every draft is rejected (acceptance length 1.0), so a
step's cost is measured without the speed-up; ``summarize`` gives the speed-up
a drafter of acceptance length AL would bring, AL x plain wall / EAGLE-3 wall
at AL 2.5 / 3.0 / 3.5, with its spread over the repeats (the lowest plain over
the highest EAGLE-3 step, and the reverse). What it leaves out: the all-reduce
between the 8 ranks (a plain step and a verify step pay it about equally, so
it moves the speed-up toward AL), expert parallelism, and the cost of a
draft's rejected tokens beyond the step itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Run as a script: the repository root goes last on sys.path (so
# `tools.gpu_harness` resolves and the installed vllm stays first).
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))

from tools.gpu_harness import memory_plan as mp  # noqa: E402  (a layer below)
from tools.gpu_harness import project as pj  # noqa: E402  (the per-rank geometry; a layer below)

ACCEPTANCE_LENGTHS = pj.ACCEPTANCE_LENGTHS
ENGINE_KEYS = {"plain": "plain", **pj.DRAFTER_KEYS}  # plain, eagle3 (Llama), eagle3_mla
DEFAULT_BATCHES = (1, 8, 32, 64, 128)
DEFAULT_CONTEXT = 16


def configs(model: str, engines: list[str], layers: int, work: Path) -> dict[str, Path | None]:
    """Write the target's and each drafter's per-rank config under ``work``:
    {engine: drafter dir or None for plain}, and work/target. Every config is
    made, and Marlin checked, before any engine starts."""
    spec = pj.MODELS[model]
    if unknown := [e for e in engines if e != "plain" and e not in spec["drafters"]]:
        raise ValueError(f"{model} has no drafter {unknown}: plain or one of {sorted(spec['drafters'])}")
    tcfg = pj.target_geometry(model, layers)
    if spec.get("moe_method") == "Marlin" and not pj.marlin_moe_supports(tcfg):
        raise ValueError(f"{model} at {layers} layers: Marlin MoE cannot take this rank's experts")
    (work / "target").mkdir(parents=True, exist_ok=True)
    (work / "target" / "config.json").write_text(json.dumps(tcfg, indent=1))
    out: dict[str, Path | None] = {}
    for e in engines:
        if e == "plain":
            out[e] = None
            continue
        published = json.loads((pj.PUBLISHED / spec["drafters"][e] / "config.json").read_text())
        d = work / f"drafter_{e}"
        d.mkdir(exist_ok=True)
        cfg = pj.DRAFTER_GEOMETRY[e](published, tcfg, pj.aux_ids(layers))
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
        out[e] = d
    return out


def _scheduler_facts(llm) -> dict:
    """What the engine decided: async scheduling, graph mode, spec settings."""
    vc = llm.llm_engine.vllm_config
    sc, cc, spec = vc.scheduler_config, vc.compilation_config, vc.speculative_config
    facts = {"async_scheduling": sc.async_scheduling, "max_num_batched_tokens": sc.max_num_batched_tokens,
             "max_num_seqs": sc.max_num_seqs, "cudagraph_mode": str(cc.cudagraph_mode),
             "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or [])}
    if spec is not None:
        facts["speculative"] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
                                "disable_by_batch_size": spec.disable_by_batch_size,
                                "disable_padded_drafter_batch": spec.disable_padded_drafter_batch}
    return facts


def _profiled_steps(traces: Path, seen: set[str]) -> dict:
    from tools.gpu_harness.step_trace import OUTSIDE, step_breakdown, worker_trace

    path, trace = worker_trace(traces, seen)
    seen.add(path)
    try:
        steps = step_breakdown(trace).get("steps")
    except Exception as exc:  # noqa: BLE001  the step times must outlive a trace the breakdown misreads
        steps = step_breakdown(trace, phases=False).get("steps")
        if steps:
            steps["breakdown_error"] = f"{type(exc).__name__}: {exc}"
    if not steps:
        raise RuntimeError(f"{path}: no decode steps (is VLLM_CUSTOM_SCOPES_FOR_PROFILING=1?)")
    if set(steps.get("phases", {})) == {OUTSIDE}:
        print(f"WARNING {path}: no runner ranges in the steps (is VLLM_CUSTOM_SCOPES_FOR_PROFILING=1?)",
              flush=True)
    return steps


def prompts_for(context: int, batch: int) -> list[dict]:
    """``batch`` distinct prompts of ``context`` token ids (below the rank's
    vocabulary share): distinct, so prefix caching shares no block between
    requests and each reads its own KV."""
    return [{"prompt_token_ids": [(7 + 131 * i + 17 * j) % 20000 for j in range(context)]}
            for i in range(batch)]


def result_path(out: Path, model: str, tag: str, context: int, contexts) -> Path:
    """One result file per context; the default context keeps the old name."""
    ctx = "" if list(contexts) == [DEFAULT_CONTEXT] else f"_ctx{context}"
    return out / f"fulldepth_{model}{tag}{ctx}.json"


def run(model: str, engines: list[str], out: Path, batches=DEFAULT_BATCHES, repeats: int = 3,
        gen_tokens: int = 128, layers: int = pj.FULL_LAYERS, mem_util: float | None = None,
        prof_tokens: int = 12, async_scheduling: str = "default", disable_by_batch_size: int | None = None,
        budget_s: float | None = None, tag: str = "", contexts=(DEFAULT_CONTEXT,),
        card: tuple[int, int, str] | None = None) -> dict:
    """Returns {context: result}; each result is also written to its file
    (result_path) after every measured cell."""
    t_run = time.perf_counter()
    sys.path.insert(0, str(pj.REPO_ROOT / "tests" / "e2e" / "gpu"))
    import gpu_e2e_helpers as h

    contexts = list(contexts)
    work = Path(tempfile.mkdtemp(prefix=f"fulldepth-{model}-"))
    drafters = configs(model, engines, layers, work)
    tcfg = json.loads((work / "target" / "config.json").read_text())
    total, free, card_name = card or mp.card_memory()
    drafter_kv = max([mp.drafter_kv_bytes_per_token(json.loads((d / "config.json").read_text()))
                      for d in drafters.values() if d is not None], default=0)
    memory, cells, skipped = mp.plan_cells(tcfg, contexts, batches, gen_tokens, pj.K, total, free,
                                           drafter=any(d is not None for d in drafters.values()),
                                           drafter_kv_per_token=drafter_kv)
    for cell, why in skipped.items():
        print(f"SKIP context x batch {cell}: does not fit {card_name}: {why}", flush=True)
    if not cells:
        raise SystemExit(f"fulldepth.py: {model} at {layers} layers, contexts {contexts}, batches "
                         f"{list(batches)}: no cell fits {card_name}: {memory['reason']}")
    contexts = sorted({c for c, _ in cells})
    os.environ["EAGLE3_GPU_PROFILE"] = "production"  # before configure_env(): bf16, MLA on
    h.configure_env()
    os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"  # the step ranges step_breakdown splits at
    by_ctx = {ctx: {"what": __doc__.split("\n", 1)[0], "model": model, "layers": layers, "tp_share": pj.TP,
                    "k": pj.K, "target_config": pj.MODELS[model]["target"],
                    "batches": [b for c, b in cells if c == ctx],
                    "repeats": repeats, "gen_tokens": gen_tokens, "prompt_tokens": ctx,
                    "prof_tokens": prof_tokens, "async_scheduling_arg": async_scheduling,
                    "disable_by_batch_size": disable_by_batch_size, "card": card_name, "memory_plan": memory,
                    "skipped_cells": {c: w for c, w in skipped.items() if c.startswith(f"{ctx}x")},
                    "command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "drafters": {ENGINE_KEYS[e]: pj.MODELS[model]["drafters"][e] for e in engines if e != "plain"},
                    "engines": {}} for ctx in contexts}
    from vllm import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    capture = sorted({b for _, b in cells} | {(pj.K + 1) * b for _, b in cells})
    extra = {} if async_scheduling == "default" else {"async_scheduling": async_scheduling == "on"}
    if mem_util is None:  # sized from the plan: a fixed KV cache, no memory profile
        extra.update(gpu_memory_utilization=memory["gpu_memory_utilization"],
                     kv_cache_memory_bytes=memory["kv_cache_memory_bytes"])
    else:
        extra["gpu_memory_utilization"] = mem_util
    longest = 0.0
    for e in engines:
        key = ENGINE_KEYS[e]
        if budget_s is not None and time.perf_counter() - t_run + longest > budget_s:
            for res in by_ctx.values():
                res.setdefault("skipped_engines", []).append(key)
            print("SKIP", key, f"(budget {budget_s:.0f} s)", flush=True)
            continue
        t0 = time.perf_counter()
        traces, seen = work / f"trace_{key}", set()
        traces.mkdir()
        kw = h.engine_kwargs(work / "target", drafters[e], load_format="dummy",
                             max_num_seqs=max(b for _, b in cells),
                             skip_tokenizer_init=True, max_model_len=max(contexts) + gen_tokens + 64,
                             max_num_batched_tokens=memory["budget"], enable_prefix_caching=True,
                             compilation_config={"cudagraph_capture_sizes": capture},
                             profiler_config={"profiler": "torch", "torch_profiler_dir": str(traces),
                                              "torch_profiler_with_stack": False}, **extra)
        if drafters[e] is not None and disable_by_batch_size is not None:
            kw["speculative_config"]["disable_by_batch_size"] = disable_by_batch_size
        llm = LLM(**kw)
        start_s = time.perf_counter() - t0
        rows = {ctx: res["engines"].setdefault(key, {"start_s": start_s, "batches": {}})
                for ctx, res in by_ctx.items()}
        try:
            facts = {**h.engine_facts(llm), **_scheduler_facts(llm)}
            pj.check_served(model, facts)
            facts["copy_bandwidth_gbps"] = h.copy_bandwidth_gbps(llm)
            q = pj.K + 1 if drafters[e] is not None else 1
            facts["kv_splits"] = h.kv_split_facts(llm, [(b, q, ctx + gen_tokens) for ctx, b in cells])
            h.dispatch_tally(llm, read=False)
            for row in rows.values():
                row["facts"] = facts
            prompts = {c: prompts_for(*c) for c in cells}
            for c in cells:  # warm-up: first replays, allocator, the prompts' KV in the prefix cache
                llm.generate(prompts[c], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
            h.dispatch_tally(llm, read=True)
            for r in range(repeats):
                for ctx, b in cells:
                    # The prompt comes from the prefix cache; its last partial
                    # block and the first token are timed apart (max_tokens=1)
                    # and taken out, so a step is a decode step at any context.
                    # An untimed pass first puts the prompt back in the cache:
                    # a long context may have been evicted by the other
                    # cells, and the timed pass would then subtract a whole
                    # prefill that the generation below does not pay.
                    llm.generate(prompts[ctx, b], first, use_tqdm=False)
                    t1 = time.perf_counter()
                    llm.generate(prompts[ctx, b], first, use_tqdm=False)
                    t_first = time.perf_counter() - t1
                    before = h.spec_counters(llm)
                    h.dispatch_tally(llm, read=True)
                    t1 = time.perf_counter()
                    llm.generate(prompts[ctx, b], sp, use_tqdm=False)
                    dt = time.perf_counter() - t1
                    tally = h.dispatch_tally(llm, read=True)
                    d = h.counters_delta(before, h.spec_counters(llm))
                    steps = gen_tokens - 1 if drafters[e] is None else d["num_drafts"] / b
                    rep = {"wall_s": dt, "first_token_s": t_first, "steps": steps,
                           "step_ms": 1000 * (dt - t_first) / steps, "num_drafts": d["num_drafts"],
                           "mean_acceptance_length": d["mean_acceptance_length"], "graph_dispatch": tally}
                    cell = rows[ctx]["batches"].setdefault(str(b), {"repeats": []})
                    cell["repeats"].append(rep)
                    cell["graph_mode"] = h.graph_mode_of(tally)
                    json_write(result_path(out, model, tag, ctx, contexts), by_ctx[ctx])
            for ctx, b in cells:
                llm.start_profile()
                llm.generate(prompts[ctx, b], SamplingParams(max_tokens=prof_tokens, ignore_eos=True),
                             use_tqdm=False)
                llm.stop_profile()
                rows[ctx]["batches"][str(b)]["profile"] = _profiled_steps(traces, seen)
                json_write(result_path(out, model, tag, ctx, contexts), by_ctx[ctx])
        finally:
            h.shutdown(llm)
        wall = time.perf_counter() - t0
        longest = max(longest, wall)
        for ctx, res in by_ctx.items():
            rows[ctx]["engine_wall_s"] = wall
            res["summary"] = summarize(res)
            json_write(result_path(out, model, tag, ctx, contexts), res)
            print("ENGINE", key, f"context {ctx}",
                  json.dumps({b: round(statistics.median(x["step_ms"] for x in v["repeats"]), 3)
                              for b, v in rows[ctx]["batches"].items()}),
                  json.dumps({b: v.get("graph_mode") for b, v in rows[ctx]["batches"].items()}),
                  f"{wall:.0f} s", flush=True)
    for ctx, res in by_ctx.items():
        res["summary"] = summarize(res)
        json_write(result_path(out, model, tag, ctx, contexts), res)
    return by_ctx


def json_write(path: Path, res: dict) -> None:
    path.write_text(json.dumps(res, indent=1))


def summarize(res: dict, acceptance=ACCEPTANCE_LENGTHS) -> dict:
    """Per batch: each engine's median, lowest and highest wall step over the
    repeats, its profiled GPU kernel time and idle time per step (median wall
    minus median GPU time), and each drafter's speed-up at each acceptance
    length: AL x median plain / median EAGLE-3, with its spread
    [AL x lowest plain / highest EAGLE-3, AL x highest plain / lowest EAGLE-3].
    A batch profiled with the phase breakdown carries it (``breakdown``)."""
    out: dict = {}
    engines = res.get("engines", {})
    for key, row in engines.items():
        for b, cell in row.get("batches", {}).items():
            walls = [r["step_ms"] for r in cell.get("repeats", [])]
            if not walls:
                continue
            s = {"wall_ms": statistics.median(walls), "wall_min_ms": min(walls), "wall_max_ms": max(walls),
                 "n": len(walls)}
            prof = cell.get("profile", {}).get("median")
            if prof and "gpu_kernel_ms" in prof:
                s["gpu_ms"] = prof["gpu_kernel_ms"]
                s["gpu_idle_ms"] = s["wall_ms"] - s["gpu_ms"]
            if cell.get("graph_mode"):
                s["graph_mode"] = cell["graph_mode"]
            if prof and "attn_decode_gpu_ms" in prof:
                s["attention"] = attention_vs_bound(res, row, int(b), prof)
            if "phases" in cell.get("profile", {}):
                s["breakdown"] = breakdown(cell["profile"])
            out.setdefault(b, {})[key] = s
    for b, cells in out.items():
        plain = cells.get("plain")
        if plain is None:
            continue
        for key, s in cells.items():
            if key == "plain":
                continue
            s["speedup"] = {str(al): {"median": al * plain["wall_ms"] / s["wall_ms"],
                                      "low": al * plain["wall_min_ms"] / s["wall_max_ms"],
                                      "high": al * plain["wall_max_ms"] / s["wall_min_ms"]}
                            for al in acceptance}
    return out


def attention_vs_bound(res: dict, row: dict, batch: int, prof: dict) -> dict:
    """A profiled step's attention GPU time (decode and prefill kernels,
    step_trace.KERNEL_GROUPS) beside its KV-bandwidth bound: the target's
    latent KV the step must read (every request's context plus the tokens
    of the profiled window, half of them on average) over the copy
    bandwidth measured on the card."""
    out = {"decode_ms": prof["attn_decode_gpu_ms"], "prefill_ms": prof.get("attn_prefill_gpu_ms", 0.0)}
    out["total_ms"] = out["decode_ms"] + out["prefill_ms"]
    bw = row.get("facts", {}).get("copy_bandwidth_gbps")
    if bw and res.get("layers"):
        per_token = res["layers"] * (512 + 64) * 2  # kv_lora_rank + qk_rope_head_dim, bf16
        tokens = batch * (res.get("prompt_tokens", DEFAULT_CONTEXT) + res.get("prof_tokens", 0) / 2)
        out["kv_read_mb"] = tokens * per_token / 1e6
        out["kv_bound_ms"] = tokens * per_token / (bw * 1e9) * 1000
        out["over_bound"] = out["total_ms"] / out["kv_bound_ms"]
    return out


def breakdown(profile: dict, top: int = 10) -> dict:
    """A profiled batch's step, phase by phase (step_trace.phase_breakdown's
    medians): GPU ms, host ms and host ms before the first launch per phase
    in the order they run, the drafter's passes summed as ``draft``
    (inputs, passes and tail), and the ``top`` kernels by GPU time."""
    phases = {name: {k: p[k] for k in ("gpu_ms", "host_ms", "host_before_launch_ms", "launches") if k in p}
              for name, p in profile["phases"].items()}
    draft = [p for name, p in profile["phases"].items() if name == "draft" or name.startswith("draft ")]
    out = {"phases": phases, "top_kernels": profile.get("top_kernels", [])[:top],
           "unmatched_gpu_ms": profile.get("unmatched_gpu_ms", 0.0)}
    if draft:
        out["draft"] = {"gpu_ms": sum(p["gpu_ms"] for p in draft), "host_ms": sum(p["host_ms"] for p in draft),
                        "passes": sum(1 for name in profile["phases"]
                                      if name.startswith("draft pass ") and not name.endswith(" inputs"))}
    return out


def main(argv=None) -> int:
    head, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(prog="fulldepth.py", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="time the engines on a GPU")
    r.add_argument("--model", choices=pj.MODELS, required=True)
    r.add_argument("--engines", type=lambda t: [x for x in t.split(",") if x], default=["plain", "llama", "mla"],
                   help="engines in order: plain and the model's drafters (llama, mla); default plain,llama,mla")
    r.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",")], default=list(DEFAULT_BATCHES))
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--gen-tokens", type=int, default=128)
    r.add_argument("--layers", type=int, default=pj.FULL_LAYERS)
    r.add_argument("--contexts", type=lambda t: [int(x) for x in t.split(",")], default=[DEFAULT_CONTEXT],
                   help="prompt lengths in tokens, each timed at every batch in the same engine; one result "
                        f"file per context (default {DEFAULT_CONTEXT})")
    r.add_argument("--mem-util", type=float, default=None,
                   help="gpu_memory_utilization with vLLM's memory profile; default: sized from the card's "
                        "free memory and the KV cache the run needs (a fixed kv_cache_memory_bytes)")
    r.add_argument("--prof-tokens", type=int, default=12)
    r.add_argument("--async-scheduling", choices=("default", "on", "off"), default="default")
    r.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="speculative_config.disable_by_batch_size for the EAGLE-3 engines "
                        "(the series refuses it; patches/proposed/disable-by-batch-size.mbox implements it)")
    r.add_argument("--budget-s", type=float, default=None,
                   help="start no engine that the longest so far would carry past this many seconds")
    r.add_argument("--tag", default="", help="appended to the result file's name")
    r.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("summarize", help="speed-ups from result files (merged by engine)")
    s.add_argument("results", type=Path, nargs="+")
    s.add_argument("--out", type=Path, default=None,
                   help="also write the summary, with its sources and this command, to this JSON file")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        res = run(args.model, args.engines, args.out, batches=args.batches, repeats=args.repeats,
                  gen_tokens=args.gen_tokens, layers=args.layers, mem_util=args.mem_util,
                  prof_tokens=args.prof_tokens, async_scheduling=args.async_scheduling,
                  disable_by_batch_size=args.disable_by_batch_size, budget_s=args.budget_s, tag=args.tag,
                  contexts=args.contexts)
        for ctx, r in res.items():
            print(f"context {ctx}:", json.dumps(summarize(r), indent=1))
        return 0
    else:
        first = json.loads(args.results[0].read_text())
        res = {"engines": {}, **{k: first.get(k) for k in ("layers", "prompt_tokens", "prof_tokens")}}
        for p in args.results:
            res["engines"].update(json.loads(p.read_text()).get("engines", {}))
        if args.out is not None:
            json_write(args.out, {
                "what": "fulldepth.py summarize: speed-up at each acceptance length from measured wall steps",
                "command": " ".join(["fulldepth.py", *(argv if argv is not None else sys.argv[1:])]),
                "sources": {p.name: json.loads(p.read_text()).get("command") for p in args.results},
                "model": first.get("model"), "layers": first.get("layers"), "k": first.get("k"),
                "repeats": first.get("repeats"), "gen_tokens": first.get("gen_tokens"),
                "prompt_tokens": first.get("prompt_tokens"), "card": first.get("card"),
                "facts": {k: {f: v.get("facts", {}).get(f) for f in ("async_scheduling", "cudagraph_mode",
                                                                     "attention_backends", "mla_prefill",
                                                                     "kv_splits", "copy_bandwidth_gbps")}
                          for k, v in res["engines"].items()},
                "summary": summarize(res)})
    print(json.dumps(summarize(res), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
