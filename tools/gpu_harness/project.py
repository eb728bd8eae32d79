#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Project EAGLE-3's speed-up to the 61-layer models users serve at TP = 8, from step times of their per-rank geometry.

    python3 tools/gpu_harness/project.py run --model deepseek-v3 --layers 4,6,8 --out DIR   (a GPU)
    python3 tools/gpu_harness/project.py fit DIR/project_deepseek-v3.json                    (anywhere)

At tensor parallelism 8 each GPU runs 1/8 of every layer: 1/8 of the
attention heads, of each expert's intermediate width and of the dense MLP,
with the full hidden size. ``geometry()`` derives that per-rank target from a
published config (tests/v1/spec_decode/published_configs, PROVENANCE.md),
and the drafter likewise from a published SpecForge drafter config
(the vocabulary, and so the LM head, is split over the ranks too); ``run``
serves them with random weights (``load_format="dummy"``: step time does not
depend on the values) at a few layer counts, times plain decode steps and
EAGLE-3 steps (k = 3: one verify of k + 1 tokens and k drafter passes), and
``fit`` fits T(L) = a + b * L to each, reports how well a line fits, and,
only where every line rises and passes within 5 % of each point, projects the
61-layer step times and the speed-up at the acceptance lengths published for
these drafters (H200 call 34's whole-step times did not: flat plain steps).
``run`` also profiles a short window of each engine and batch (vLLM's torch
profiler), and ``project_gpu`` fits the per-step GPU kernel time, which grows
with the layers even where the wall step does not, to bound the 61-layer step
(see its docstring).

Every projected figure is a projection. It leaves out the all-reduce between
the 8 ranks (two per layer, after attention and after the MoE), which the
seeds measured at 51.5 % of decode time on PCIe GPUs: a per-step cost that a
plain step and a verify step pay about equally (both are latency-bound at
these token counts), so adding it moves the speed-up toward the acceptance
length, and leaving it out understates the speed-up. It also leaves out
expert parallelism, the fp8 weights of the DeepSeek release (bf16 here) and
the scheduler's own per-step cost at 8 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = REPO_ROOT / "tests" / "v1" / "spec_decode" / "published_configs"
TP = 8
K = 3
FULL_LAYERS = 61
ACCEPTANCE_LENGTHS = (2.5, 3.0, 3.5)  # the published range (README, docs/gpu.md)
MODELS = {
    # target config, drafter config
    "deepseek-v3": ("deepseek-r1-0528-target-ttmetal", "specforge-deepseek-v3-671b-eagle3"),
    # Kimi-K2.5 INT4 needs its published config.json verbatim (quantization_config
    # included) as a fixture; no stored snapshot of moonshotai/Kimi-K2.5 has it yet.
}


def _shard(value: int, what: str) -> int:
    if value % TP:
        raise ValueError(f"{what} = {value} does not split over TP = {TP}")
    return value // TP


def geometry(target: dict, layers: int) -> dict:
    """One rank's share of a DeepSeek-V3-architecture target at TP = 8, with
    ``layers`` layers (the first ``first_k_dense_replace`` dense, as published)."""
    cfg = dict(target)
    dense = cfg.get("first_k_dense_replace", 0)
    if layers <= dense:
        raise ValueError(f"{layers} layers leave no MoE layer after {dense} dense ones")
    heads = _shard(cfg["num_attention_heads"], "num_attention_heads")
    cfg.update(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
               moe_intermediate_size=_shard(cfg["moe_intermediate_size"], "moe_intermediate_size"),
               intermediate_size=_shard(cfg["intermediate_size"], "intermediate_size"),
               vocab_size=_shard(cfg["vocab_size"], "vocab_size"), num_nextn_predict_layers=0)
    # bf16 everywhere but the routed experts of an INT4 release (see the docstring).
    q = cfg.get("quantization_config")
    if q and q.get("quant_method") != "compressed-tensors":
        cfg.pop("quantization_config")
    return cfg


def drafter_geometry(drafter: dict, target: dict, aux_ids: list[int]) -> dict:
    """The drafter's share at TP = 8 against ``target`` (a geometry()). Its
    draft vocabulary is the target's rank share with no d2t map: random d2t
    offsets would draft ids outside the vocabulary, and the larger head
    overstates the drafter's cost, never understates it."""
    cfg = dict(drafter)
    # A Llama config without head_dim means hidden / heads: keep the published
    # head size while the heads are split (H200 call 34 ran 7 heads of 1024,
    # which FlashAttention refuses, so the drafter went to TRITON_ATTN).
    cfg["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg.update(vocab_size=target["vocab_size"], draft_vocab_size=target["vocab_size"],
               num_attention_heads=_shard(cfg["num_attention_heads"], "drafter num_attention_heads"),
               num_key_value_heads=max(1, cfg["num_key_value_heads"] // TP),
               intermediate_size=_shard(cfg["intermediate_size"], "drafter intermediate_size"),
               eagle_aux_hidden_state_layer_ids=aux_ids)
    cfg.pop("eagle_config", None)
    return cfg


def fit_line(xs: list[float], ys: list[float]) -> dict:
    """Least squares T = a + b * L, with the largest relative residual (how
    far the points are from a line)."""
    n = len(xs)
    if n < 3:
        raise ValueError("a line through fewer than three layer counts shows nothing")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    resid = max(abs(a + b * x - y) / y for x, y in zip(xs, ys))
    return {"a_ms": a, "b_ms_per_layer": b, "max_relative_residual": resid}


# A line must pass within this share of every measured step time, and rise
# with the layer count, before it is carried out to 61 layers.
LINEAR_TOLERANCE = 0.05


def _fits(points: dict[str, dict[int, float]]) -> tuple[dict, dict]:
    """A line through each engine's points, and why each that is not a line
    cannot be extrapolated."""
    fits = {n: fit_line(sorted(p), [p[k] for k in sorted(p)]) for n, p in points.items()}
    return fits, {n: why for n, f in fits.items() if (why := not_linear(f))}


def not_linear(fit: dict) -> str | None:
    """Why the points do not support extrapolating ``fit`` (None: they do)."""
    if fit["b_ms_per_layer"] <= 0:
        return (f"the step time does not grow with the layer count (slope {fit['b_ms_per_layer']:.3f} "
                "ms per layer): the per-layer cost is below the step's fixed cost and its noise")
    if fit["max_relative_residual"] > LINEAR_TOLERANCE:
        return (f"a line misses a measured step by {100 * fit['max_relative_residual']:.0f} % "
                f"(more than {100 * LINEAR_TOLERANCE:.0f} %)")
    return None


def project(points: dict[str, dict[int, float]], layers: int = FULL_LAYERS,
            acceptance=ACCEPTANCE_LENGTHS) -> dict:
    """points: {"plain"|"eagle3": {layers: step ms}} -> fits, projected step
    times and speed-ups (acceptance length x plain step / EAGLE-3 step), or,
    when a fit is not a line (not_linear), the fits and why nothing is
    projected."""
    fits, refused = _fits(points)
    if refused:
        return {"fits": fits, "projected_layers": layers, "not_projected": refused,
                "label": "no projection: the measured step times are not linear in layers"}
    at = {n: f["a_ms"] + f["b_ms_per_layer"] * layers for n, f in fits.items()}
    return {"fits": fits, "projected_layers": layers, "projected_step_ms": at,
            "projected_speedup": {str(al): al * at["plain"] / at["eagle3"] for al in acceptance},
            "label": "projection: per-rank compute only, no all-reduce (see project.py)"}


def project_gpu(wall: dict[str, dict[int, float]], gpu: dict[str, dict[int, float]],
                layers: int = FULL_LAYERS, acceptance=ACCEPTANCE_LENGTHS) -> dict:
    """When whole-step wall times are flat in the layer count (the GPU idles
    behind a fixed CPU cost), fit the per-step GPU kernel time (the profiler's,
    summed over each step) instead, and bound the 61-layer step between two
    assumptions about the CPU cost W (the mean measured wall step) and the
    GPU time G(61):

    * overlapped: the CPU work hides behind the GPU or the reverse, max(W, G(61));
    * serial: the GPU time added over the measured layers adds to the step,
      W + G(61) - mean measured G.

    The speed-up is acceptance length x plain step / EAGLE-3 step under the
    same assumption for both."""
    fits, refused = _fits(gpu)
    label = ("projection from per-step GPU kernel time: per-rank compute only, no all-reduce, CPU cost "
             "held at its measured value (see project.py)")
    if refused:
        return {"gpu_fits": fits, "not_projected": refused, "label": label}
    g61 = {n: f["a_ms"] + f["b_ms_per_layer"] * layers for n, f in fits.items()}
    w = {n: sum(p.values()) / len(p) for n, p in wall.items()}
    g = {n: sum(p.values()) / len(p) for n, p in gpu.items()}
    step = {"overlapped": {n: max(w[n], g61[n]) for n in gpu},
            "serial": {n: w[n] + g61[n] - g[n] for n in gpu}}
    return {"gpu_fits": fits, "projected_layers": layers, "gpu_ms_at_projected_layers": g61,
            "mean_wall_step_ms": w, "projected_step_ms": step,
            "projected_speedup": {how: {str(al): al * st["plain"] / st["eagle3"] for al in acceptance}
                                  for how, st in step.items()},
            "label": label}


def _gpu_step_ms(trace_dir: Path, seen: set[str]) -> float:
    """Median GPU kernel time per decode step of the worker trace written
    under ``trace_dir`` that is not in ``seen`` (which it joins)."""
    from bench_eagle3 import step_breakdown, worker_trace

    path, trace = worker_trace(trace_dir, seen)
    seen.add(path)
    steps = step_breakdown(trace).get("steps")
    if not steps:
        raise RuntimeError(f"{path}: no decode steps (is VLLM_CUSTOM_SCOPES_FOR_PROFILING=1?)")
    return steps["median"]["gpu_kernel_ms"]


def run(model: str, layer_counts: list[int], out: Path, batches=(1, 8, 32), gen_tokens: int = 64,
        mem_util: float = 0.8, prof_tokens: int = 16) -> dict:
    import tempfile

    sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e" / "gpu"))
    import gpu_e2e_helpers as h

    # Production settings whatever EAGLE3_GPU_PROFILE says: bf16, MLA, vLLM's
    # default compilation and CUDA graphs, no backend forced. H200 call 30 ran
    # under the harness default (the float32 smoke profile: eager,
    # TRITON_ATTN), which is not what these step times are meant to show. Set
    # before configure_env(), which turns MLA off for the smoke profile.
    os.environ["EAGLE3_GPU_PROFILE"] = "production"
    h.configure_env()
    os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"  # the step ranges step_breakdown splits at
    tname, dname = MODELS[model]
    target = json.loads((PUBLISHED / tname / "config.json").read_text())
    drafter = json.loads((PUBLISHED / dname / "config.json").read_text())
    work = Path(tempfile.mkdtemp(prefix=f"project-{model}-"))
    res = {"model": model, "tp": TP, "k": K, "gen_tokens": gen_tokens, "layers": layer_counts,
           "profile": h.profile(),
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "step_ms": {}}
    from vllm import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    # Capture only the graphs these batches replay: b tokens (plain decode and
    # the drafter) and (k + 1) * b (the verify). vLLM's default list holds all
    # of them, so the graphs timed are the ones a default engine replays; the
    # 46 others would only lengthen each engine's start.
    capture = sorted({b for b in batches} | {(K + 1) * b for b in batches})
    res["cudagraph_capture_sizes"] = capture
    for L in layer_counts:
        tdir, ddir = work / f"target{L}", work / f"drafter{L}"
        tcfg = geometry(target, L)
        for d, cfg in ((tdir, tcfg), (ddir, drafter_geometry(drafter, tcfg, [1, L // 2, L - 1]))):
            d.mkdir(parents=True)
            (d / "config.json").write_text(json.dumps(cfg, indent=1))
        for name, dr in (("plain", None), ("eagle3", ddir)):
            traces, seen = work / f"trace_{name}{L}", set()
            traces.mkdir()
            # One engine at a time: the harness's default share (sized for a few
            # tiny engines side by side) leaves no KV cache at this geometry
            # (H200 call 29: "No available memory for the cache blocks").
            llm = LLM(**h.engine_kwargs(tdir, dr, load_format="dummy", max_num_seqs=max(batches),
                                        skip_tokenizer_init=True, gpu_memory_utilization=mem_util,
                                        compilation_config={"cudagraph_capture_sizes": capture},
                                        profiler_config={"profiler": "torch", "torch_profiler_dir": str(traces),
                                                         "torch_profiler_with_stack": False}))
            try:
                facts = h.engine_facts(llm)
                target_backends = facts.get("attention_backends", {}).get("target", [])
                if not any("MLA" in b for b in target_backends):
                    raise RuntimeError(f"the target runs {target_backends}, not an MLA backend: these step "
                                       "times would not be DeepSeek-V3's (is VLLM_MLA_DISABLE set?)")
                for b in batches:
                    prompts = [{"prompt_token_ids": [7 + i] * 16} for i in range(b)]
                    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
                    before = h.spec_counters(llm)
                    t0 = time.perf_counter()
                    llm.generate(prompts, sp, use_tqdm=False)
                    dt = time.perf_counter() - t0
                    d = h.counters_delta(before, h.spec_counters(llm))
                    # Steps per request: one per token plain; one per draft with EAGLE-3.
                    steps = gen_tokens if dr is None else d["num_drafts"] / b
                    res["step_ms"].setdefault(f"batch{b}", {}).setdefault(name, {})[L] = 1000 * dt / steps
                    # Then a short profiled window, apart from the timed run
                    # (the profiler slows the CPU side it measures).
                    llm.start_profile()
                    llm.generate(prompts, SamplingParams(max_tokens=prof_tokens, ignore_eos=True), use_tqdm=False)
                    llm.stop_profile()
                    gpu_ms = _gpu_step_ms(traces, seen)
                    res.setdefault("gpu_step_ms", {}).setdefault(f"batch{b}", {}).setdefault(name, {})[L] = gpu_ms
                res.setdefault("engine", {})[f"{name}_{L}"] = facts
            finally:
                h.shutdown(llm)
            print("STEP", model, L, name, json.dumps({b: v[name].get(L) for b, v in res["step_ms"].items()}),
                  flush=True)
    _project_all(res)
    (out / f"project_{model}.json").write_text(json.dumps(res, indent=1))
    return res


def _project_all(res: dict) -> None:
    """The wall-time projection, and where the result has per-step GPU time,
    the GPU-time one."""
    def ints(pts):
        return {n: {int(k): v for k, v in p.items()} for n, p in pts.items()}

    res["projection"] = {b: project(ints(v)) for b, v in res["step_ms"].items()}
    if "gpu_step_ms" in res:
        res["projection_gpu_time"] = {b: project_gpu(ints(res["step_ms"][b]), ints(v))
                                      for b, v in res["gpu_step_ms"].items()}


def main(argv=None) -> int:
    head, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(prog="project.py", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", choices=MODELS, required=True)
    r.add_argument("--layers", type=lambda t: [int(x) for x in t.split(",")], default=[4, 6, 8])
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--mem-util", type=float, default=0.8, help="gpu_memory_utilization of each engine")
    f = sub.add_parser("fit")
    f.add_argument("result", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        res = run(args.model, args.layers, args.out, mem_util=args.mem_util)
    else:
        res = json.loads(args.result.read_text())
        _project_all(res)
    print(json.dumps({k: res[k] for k in ("projection", "projection_gpu_time") if k in res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
