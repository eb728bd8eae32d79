# SPDX-License-Identifier: Apache-2.0
"""Render docs/results.md, and README's table of results, from the results JSON.

    python -m tools.results_doc           # rewrite docs/results.md and README's table
    python -m tools.results_doc --check   # exit 1 if either is not what this renders now

Every figure in docs/results.md and in README.md's results table (between its
<!-- results:begin --> and <!-- results:end --> lines) is read from a file in
tools/gpu_harness/results/, never typed: CLAIMS below names, for each claim,
its file, what it ran on, the user's command and how to read its figures.
The device command and the date are the file's own (``device_command`` or
``command``; ``date`` or the file name's date). tests/tools/test_results_doc.py
fails when a committed document differs from what this renders.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tools._common import REPO_ROOT, StackError, parser, run_main

TOOL = "results_doc"
RESULTS = REPO_ROOT / "tools" / "gpu_harness" / "results"
DOC = REPO_ROOT / "docs" / "results.md"
README = REPO_ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
BATCHES = (1, 8, 32)

Figures = Callable[[dict], list[tuple[str, str]]]


@dataclass(frozen=True)
class Claim:
    key: str
    title: str
    file: str
    ran_on: str  # what the run used: series, kernels, settings (words, not figures)
    command: str  # the command a user runs for it (the device command is the file's)
    figures: Figures
    readme: Callable[[dict], str] | None = None  # the figure cell of README's table
    tables: Callable[[dict], list[str]] | None = None  # more markdown under the figures (none if [])


def f2(x: float) -> str:
    return f"{x:.2f}"


def slash(values) -> str:
    return " / ".join(values)


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def mal(run: dict, batches=BATCHES) -> str:
    """Mean acceptance lengths of a bench run at ``batches``."""
    return slash(f2(run[f"batch{b}"]["mean_acceptance_length"]) for b in batches)


def agree(a: dict) -> str:
    return f"{a['equal_prompts']} of {a['prompts']} prompts"


def _prefill_probe(d: dict) -> list[tuple[str, str]]:
    rows = []
    for name, cases in d["candidates"].items():
        calls = [c[k] for c in cases for k in ("new", "context") if k in c]
        rows += [
            (f"{name}: verify shapes, plan and run, total ms", f2(d["verify_ms_total"][name])),
            (f"{name}: largest output / log-sum-exp error against float32",
             f"{max(c['out_max_abs_err'] for c in calls):.1e} / {max(c['lse_max_abs_err'] for c in calls):.1e}"),
            (f"{name}: every call within tolerance", "yes" if all(c["correct"] for c in calls) else "no"),
        ]
    not_measured = "; ".join(f"{k}: {v}" for k, v in d["not_measured"].items())
    return rows + [("chosen", d["chosen"]), ("not measured", not_measured)]


# --- the claims, one per results file ------------------------------------


def _acceptance(d: dict) -> list[tuple[str, str]]:
    b = d["bench"]
    trained8 = b["eagle3_trained"]["batch8"]["mean_acceptance_length"]
    early8 = b["eagle3_early_aux_ids"]["batch8"]["mean_acceptance_length"]
    return [
        ("outcome", d["outcome"]),
        ("mean acceptance length, trained drafter, batch 1 / 8 / 32", mal(b["eagle3_trained"])),
        ("the same weights eager, batch 1 / 8", mal(b["eagle3_trained_eager"], (1, 8))),
        ("greedy output equal to plain decoding", agree(b["eagle3_trained"]["agreement_with_plain"])),
        ("control: the drafter fed layers (0, 1, 2), batch 8",
         f"{f2(early8)} (a drop of {f2(trained8 - early8)})"),
        ("recorded: ids shifted by one (0, 2, 5), batch 8",
         f2(b["eagle3_shifted_aux_ids"]["batch8"]["mean_acceptance_length"])),
        ("drafter training: predicted acceptance length", f2(b["training"]["predicted_acceptance_length"])),
    ]


def _acceptance_readme(d: dict) -> str:
    b = d["bench"]
    return (f"trained drafter {mal(b['eagle3_trained'])} at batch 1 / 8 / 32; fed layers (0, 1, 2) "
            f"instead: {f2(b['eagle3_early_aux_ids']['batch8']['mean_acceptance_length'])}; greedy output "
            f"equal on {agree(b['eagle3_trained']['agreement_with_plain'])}")


def _dsa(d: dict) -> list[tuple[str, str]]:
    rows = []
    for kind, name in (("glm5", "GLM-5"), ("deepseek-v32", "DeepSeek-V3.2")):
        a, r = d[kind]["acceptance_bench"], d[kind]["aux_states_reference"]["reference"]
        rows += [
            (f"{name}: mean acceptance length, trained drafter, batch 1 / 8 / 32", mal(a["eagle3_trained"])),
            (f"{name}: random drafter", mal(a["eagle3_random"])),
            (f"{name}: greedy output equal to plain (trained drafter)",
             agree(a["eagle3_trained"]["agreement_with_plain"])),
            (f"{name}: aux ids 1 / 3 / 6, nearest float64 layer",
             slash(str(p["nearest_reference_layer"]) for p in r["per_id"])),
            (f"{name}: aux error / layer gap (an independent bf16/fp8 forward's)",
             slash(f"{f2(p['ratio'])} ({f2(p['served_reference_ratio'])})" for p in r["per_id"])),
        ]
    return rows


def _dsa_readme(d: dict) -> str:
    g, v = (d[k]["acceptance_bench"]["eagle3_trained"] for k in ("glm5", "deepseek-v32"))
    worst = max(p["ratio"] / p["served_reference_ratio"] for k in ("glm5", "deepseek-v32")
                for p in d[k]["aux_states_reference"]["reference"]["per_id"])
    return (f"trained drafter {mal(g)} (GLM-5) and {mal(v)} (V3.2); aux states nearest their own layer, "
            f"error at most {worst:.2f}x an independent bf16/fp8 forward's")


def _int4_acceptance(d: dict) -> list[tuple[str, str]]:
    b = d["bench"]
    return [
        ("outcome", d["outcome"]),
        ("MoE method in every engine", slash(sorted({m for r in ("plain", "eagle3_random", "eagle3_trained")
                                                      for m in b[r]["engine"]["moe_quant_methods"]}))),
        ("mean acceptance length, trained drafter, batch 1 / 8 / 32", mal(b["eagle3_trained"])),
        ("random drafter", mal(b["eagle3_random"])),
        ("the same weights eager, batch 1 / 8", mal(b["eagle3_trained_eager"], (1, 8))),
        ("greedy output equal to plain", agree(b["eagle3_trained"]["agreement_with_plain"])),
    ]


def _int4_aux(d: dict) -> list[tuple[str, str]]:
    per = d["reference"]["per_id"]
    return [
        ("outcome", d["outcome"]),
        ("target training", f"{d['target_training']['steps']} steps, rule accuracy "
                            f"{f2(d['target_training']['final_rule_accuracy'])}"),
        ("aux ids 1 / 3 / 6, nearest float64 layer", slash(str(p["nearest_reference_layer"]) for p in per)),
        ("rms error / layer gap (bound)",
         f"{slash(pct(p['ratio']) for p in per)} ({pct(d['reference']['bound'])})"),
        ("speculators' generator (ids 0 / 2 / 5) against the engine",
         slash(pct(p["speculators_vs_engine_ratio"]) for p in per)),
    ]


def _int4_readme(d: dict) -> str:
    per = d["reference"]["per_id"]
    return (f"aux states nearest their own layer, rms error {slash(pct(p['ratio']) for p in per)} of the "
            f"layer gap (bound {pct(d['reference']['bound'])}); speculators' generator within "
            f"{pct(max(p['speculators_vs_engine_ratio'] for p in per))} of the engine")


def _int4_acc_readme(d: dict) -> str:
    b = d["bench"]
    return (f"Marlin MoE; trained drafter {mal(b['eagle3_trained'])}, random "
            f"{mal(b['eagle3_random'])}; greedy output equal on {agree(b['eagle3_trained']['agreement_with_plain'])}")


def _smoke(d: dict) -> list[tuple[str, str]]:
    passed = [ln.split("::", 1)[1] for ln in d["pytest_summary"] if ln.startswith("PASSED")]
    return [("passed", ", ".join(f"`{t}`" for t in passed)),
            *((f"{k}: greedy output equal to plain", "yes" if r["equal"] else "no")
              for k, r in d["results"].items())]


def _reason(row: dict) -> str:
    """The reason vLLM gave for refusing a backend (its engine log's "Reason: [...]")."""
    cause = row.get("root_cause_from_engine_log") or ""
    return cause.split("Reason: ", 1)[1].split("]", 1)[0].strip("['\"") if "Reason: " in cause else ""


def _backends(d: dict) -> list[tuple[str, str]]:
    return [(f"{r['backend']} forced, {r['drafter'] or 'plain'}",
             r["outcome"] + (f": {_reason(r)}" if _reason(r) else "")) for r in d["rows"]]


def _backends_readme(d: dict) -> str:
    served = sorted({r["backend"] for r in d["rows"] if r["outcome"] == "served"})
    ok = all(r["outcome"] == "served" for r in d["rows"])
    return (f"{' and '.join(served)} forced on the target: "
            f"{'the Llama and the MLA drafter both served' if ok else 'not all served'}")


def _refused(d: dict) -> list[tuple[str, str]]:
    return [row for r, row in zip(d["rows"], _backends(d)) if r["backend"] not in ("FLASH_ATTN_MLA", "TRITON_MLA")]


def _server(d: dict) -> list[tuple[str, str]]:
    return [("answered", f"{sum(1 for t in d['completion_tokens'] if t)} of {d['concurrent_requests']} "
                         f"concurrent requests"),
            ("ready after", f"{d['ready_s']:.0f} s"),
            ("mean acceptance length (/metrics)", f2(d["mean_acceptance_length"])),
            ("note", d.get("note", ""))]


def _server_trained(d: dict) -> list[tuple[str, str]]:
    m = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in d["metrics"] if "{" in ln}
    return [("answered", f"{len(d['completion_tokens'])} of {d['concurrent_requests']} concurrent requests"),
            ("draft tokens accepted (/metrics)", f"{m['vllm:spec_decode_num_accepted_tokens_total']:.0f} of "
                                                 f"{m['vllm:spec_decode_num_draft_tokens_total']:.0f}"),
            ("mean acceptance length", f2(d["mean_acceptance_length"]))]


def _cache(d: dict) -> list[tuple[str, str]]:
    return [("drafter (1, 3, 6), then (0, 2, 5): mean acceptance length",
             slash(f2(d[k]["mean_acceptance_length"]) for k in ("first_trained_1_3_6", "second_shifted_0_2_5"))),
            ("compile-cache directories", str(len({p.split("/")[1] for p in d["cache_dirs"]})))]


def _kernels(d: dict) -> list[tuple[str, str]]:
    t, dg = d["kernels_json"]["timings"], d["kernels_json"]["deep_gemm"]
    return [("total (configure / compile / relink / import check)",
             f"{t['total_s']} s ({t['configure_s']} / {t['compile_s']} / {t['relink_s']} / {t['import_check_s']} s)"),
            ("DeepGEMM's setup.py build, beside ninja", f"{dg['build_s']} s ({dg['compiler']})"),
            ("slowest object", "{} ({} s)".format(*max(t["slowest_objects_s"].items(), key=lambda kv: kv[1])))]


def _kernels_readme(d: dict) -> str:
    t = d["kernels_json"]["timings"]
    return (f"{t['total_s']} s cold on 16 cores: `_C`, `_moe_C`, the FA3 subset, DeepGEMM "
            f"({d['kernels_json']['deep_gemm']['build_s']} s beside ninja)")


def _speed(d: dict) -> list[tuple[str, str]]:
    def spread(x: dict, fmt=f2) -> str:
        return f"{fmt(x['median'])} ({fmt(x['min'])}-{fmt(x['max'])})"

    bs = d["batches"]
    return [(f"batch {b}: speed-up, median (range) of {d['repeats']}", spread(bs[f"batch{b}"]["speedup"]))
            for b in BATCHES] + [
        ("mean acceptance length, batch 1 / 8 / 32",
         slash(f2(bs[f"batch{b}"]["mean_acceptance_length"]["median"]) for b in BATCHES)),
        ("efficiency (speed-up / acceptance length)",
         slash(f2(bs[f"batch{b}"]["efficiency"]["median"]) for b in BATCHES))]


def _speed_readme(d: dict) -> str:
    bs = d["batches"]
    return (f"speed-up {slash(f2(bs[f'batch{b}']['speedup']['median']) + 'x' for b in BATCHES)} at batch "
            f"1 / 8 / 32 (medians of {d['repeats']}), acceptance "
            f"{slash(f2(bs[f'batch{b}']['mean_acceptance_length']['median']) for b in BATCHES)}: the tiny "
            f"target's step is CPU-bound")


def _profile(d: dict) -> list[tuple[str, str]]:
    return [(f"{n}: one decode step at batch {d['batch']}, GPU busy",
             f"{f2(d[n]['steps']['median']['period_ms'])} ms, {pct(d[n]['steps']['median']['gpu_busy_fraction'])}")
            for n in ("plain", "eagle3")]


def _project(d: dict) -> list[tuple[str, str]]:
    rows = []
    for b in BATCHES:
        p = d["projection_gpu_time"][f"batch{b}"]
        ms = p["gpu_ms_at_projected_layers"]
        sp = p.get("projected_speedup_by_drafter") or {"eagle3": p["projected_speedup"]}
        for drafter, s in sp.items():
            rows.append((f"batch {b}: 61-layer GPU ms per step, plain / {drafter}",
                         f"{ms['plain']:.1f} / {ms[drafter]:.1f}"))
            for mode in ("overlapped", "serial"):
                rows.append((f"batch {b}: speed-up at acceptance length 2.5 / 3.0 / 3.5, CPU cost {mode}",
                             slash(f"{s[mode][a]:.2f}x" for a in ("2.5", "3.0", "3.5"))))
    res = max(f["max_relative_residual"] for b in BATCHES
              for f in d["projection_gpu_time"][f"batch{b}"]["gpu_fits"].values())
    rows.append(("largest residual of the per-layer GPU-time lines", pct(res)))
    return rows


def _project_readme(d: dict) -> str:
    p = d["projection_gpu_time"]["batch1"]
    s = p.get("projected_speedup_by_drafter") or {"eagle3": p["projected_speedup"]}
    s = next(iter(s.values()))
    return (f"at batch 1, acceptance length 3.0: {s['overlapped']['3.0']:.2f}x if the CPU cost hides behind "
            f"the GPU, {s['serial']['3.0']:.2f}x if it adds (per-rank compute only: no all-reduce)")


FULL_BATCHES = ("1", "8", "32", "64", "128")
FULL_DRAFTERS = {"eagle3": "Llama drafter", "eagle3_mla": "MLA drafter"}


def _fulldepth(d: dict) -> list[tuple[str, str]]:
    s, rows = d["summary"], []
    for b in (b for b in FULL_BATCHES if "plain" in s.get(b, {})):
        p = s[b]["plain"]
        rows.append((f"batch {b}: plain wall ms per step, median (range) / GPU ms / GPU idle ms",
                     f"{f2(p['wall_ms'])} ({f2(p['wall_min_ms'])}-{f2(p['wall_max_ms'])}) / "
                     f"{f2(p['gpu_ms'])} / {f2(p['gpu_idle_ms'])}"))
        for key, name in ((k, n) for k, n in FULL_DRAFTERS.items() if k in s[b]):
            e = s[b][key]
            rows.append((f"batch {b}: {name}, EAGLE-3 wall ms per step (range) / GPU ms / GPU idle ms",
                         f"{f2(e['wall_ms'])} ({f2(e['wall_min_ms'])}-{f2(e['wall_max_ms'])}) / "
                         f"{f2(e['gpu_ms'])} / {f2(e['gpu_idle_ms'])}"))
            rows.append((f"batch {b}: {name}, speed-up at acceptance length 2.5 / 3.0 / 3.5 (range)",
                         slash(f"{f2(e['speedup'][a]['median'])}x ({f2(e['speedup'][a]['low'])}-"
                               f"{f2(e['speedup'][a]['high'])})" for a in ("2.5", "3.0", "3.5"))))
            # Where EAGLE-3 stops paying: the acceptance length at which its
            # step, AL tokens, costs what AL plain steps cost.
            rows.append((f"batch {b}: {name}, break-even acceptance length (EAGLE-3 wall / plain wall, range)",
                         f"{f2(e['wall_ms'] / p['wall_ms'])} ({f2(e['wall_min_ms'] / p['wall_max_ms'])}-"
                         f"{f2(e['wall_max_ms'] / p['wall_min_ms'])})"))
        for key in ("plain", *FULL_DRAFTERS):  # files of fulldepth.py since the graph mode and the bound
            e, name = s[b].get(key, {}), "plain" if key == "plain" else FULL_DRAFTERS[key]
            if "graph_mode" in e:
                rows.append((f"batch {b}: {name}, CUDA graph the measured steps replayed", e["graph_mode"]))
            if "attention" in e:
                a = e["attention"]
                rows.append((f"batch {b}: {name}, attention GPU ms per step / KV-bandwidth bound ms "
                             f"({a['kv_read_mb']:.0f} MB of latent KV)",
                             f"{_ms(a['total_ms'])} / {_ms(a['kv_bound_ms'])} ({a['over_bound']:.1f}x the bound)"))
    return rows


FULL_ENGINES = {"plain": "plain", **FULL_DRAFTERS}


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def _kernel_phases(k: dict) -> str:
    """The phase most of a kernel's time launched from, and how many more."""
    more = len(k.get("phases", {})) - 1
    return k["phase"] + (f" (+{more} more)" if more > 0 else "")


def _fulldepth_breakdown(d: dict) -> list[str]:
    """Where a step's time goes, per engine and batch, for a summary whose
    batches carry fulldepth's ``breakdown``: per phase in the order the
    runner runs them, the GPU time of the work it launched, its host time and
    the host time before its first launch (medians per step); then the
    batch's five longest kernels with their grid and block."""
    s, out = d["summary"], []
    batches = sorted(s, key=int)
    for key, name in ((k, n) for k, n in FULL_ENGINES.items() if any(k in s[b] for b in batches)):
        for b in (b for b in batches if "breakdown" in s[b].get(key, {})):
            cell = s[b][key]
            bd = cell["breakdown"]
            out += [f"### Step breakdown: {name}, batch {b}", "",
                    f"Wall {f2(cell['wall_ms'])} ms per step, GPU {f2(cell['gpu_ms'])} ms; GPU ms without "
                    f"its launch: {_ms(bd.get('unmatched_gpu_ms', 0.0))}.", "",
                    "| phase | GPU ms | host ms | host ms before its first launch | launches |",
                    "| --- | --- | --- | --- | --- |"]
            out += [f"| {_cell(ph)} | {_ms(r['gpu_ms'])} | {_ms(r['host_ms'])} | "
                    f"{_ms(r.get('host_before_launch_ms'))} | {r.get('launches', 0):g} |"
                    for ph, r in bd["phases"].items()]
            if "draft" in bd:
                out.append(f"| drafter, all {bd['draft']['passes']} passes | {_ms(bd['draft']['gpu_ms'])} | "
                           f"{_ms(bd['draft']['host_ms'])} |  |  |")
            out += ["", "| kernel | grid | block | calls per step | GPU ms per step | phase |",
                    "| --- | --- | --- | --- | --- | --- |"]
            out += [f"| {_cell(k['name'][:80])} | {k.get('grid') or ''} | {k.get('block') or ''} | "
                    f"{k['calls_per_step']:g} | {_ms(k['ms_per_step'])} | {_cell(_kernel_phases(k))} |"
                    for k in bd.get("top_kernels", [])[:5]]
            out.append("")
    return out


def _fulldepth_triton_readme(d: dict) -> str:
    s = d["summary"]
    bs = [b for b in FULL_BATCHES if "eagle3" in s.get(b, {})]
    return (f"with the proposed TRITON_MLA mails, context {d['prompt_tokens']}: plain decode "
            f"{slash(f2(s[b]['plain']['wall_ms']) for b in bs)} ms a step, "
            f"Llama drafter {slash(f2(s[b]['eagle3']['speedup']['3.0']['median']) + 'x' for b in bs)} at batch "
            f"{' / '.join(bs)}, acceptance length 3.0; verify and decode replay "
            f"{slash(sorted({s[b][k]['graph_mode'] for b in bs for k in ('plain', 'eagle3')}))} graphs")


def _acceptance_cut(d: dict) -> list[tuple[str, str]]:
    b = d["bench"]
    rows = [("outcome", d["outcome"]),
            ("graph mode kept / drafter's", f"{b['eagle3_trained']['engine']['target_dispatcher_mode']} / "
                                           f"{b['eagle3_trained']['engine']['drafter_dispatcher_mode']}"),
            ("mean acceptance length, trained drafter, batch 1 / 8 / 32", mal(b["eagle3_trained"])),
            ("greedy output equal to plain decoding", agree(b["eagle3_trained"]["agreement_with_plain"]))]
    if "eagle3_random" in b:
        rows += [("random drafter", mal(b["eagle3_random"])),
                 ("random drafter: greedy output equal to plain", agree(b["eagle3_random"]["agreement_with_plain"]))]
    if "eagle3_shifted_aux_ids" in b:
        rows.append(("recorded: ids shifted by one (0, 2, 5), batch 8",
                     f2(b["eagle3_shifted_aux_ids"]["batch8"]["mean_acceptance_length"])))
    return rows


def _fulldepth_readme(d: dict) -> str:
    s = d["summary"]
    return "; ".join(
        f"{name} {slash(f2(s[b][key]['speedup']['3.0']['median']) + 'x' for b in ('1', '8', '32'))}"
        for key, name in FULL_DRAFTERS.items() if key in s["1"]) + (
        " at batch 1 / 8 / 32, acceptance length 3.0, from measured 61-layer steps (ranges in docs/results.md)")


def _p(p: float) -> str:
    return f"{p:.3g}" if p > 0 else "< 1e-300"  # a chi-square tail below float64's range


def _serving_al(case: dict) -> str:
    """Mean acceptance length under the condition, and in the clean run."""
    return f"{f2(case['counters']['mean_acceptance_length'])} (clean {f2(case['clean_eagle3']['mean_acceptance_length'])})"


def _serving(d: dict) -> list[tuple[str, str]]:
    h, c, p, a, s = (d[k] for k in ("prefix_cache_hit_rate", "chunked_prefill", "preemption", "aborts", "sampling"))
    rows = [("outcome", d["outcome"]), ("what it does not show", d["limits"])]
    for key, name in (("prefix_caching", "prefix caching, shared prompt"),
                      ("prefix_caching_conversation", "prefix caching, 3-turn conversation"),
                      ("chunked_prefill", "chunked prefill"), ("preemption", "preemption")):
        rows.append((f"{name}: greedy output equal to plain; acceptance length (clean run)",
                     f"{agree(d[key]['agreement_with_plain'])}; {_serving_al(d[key])}"))
    rows += [
        ("prefix-cache hit rate, shared prompt / conversation (vllm:prefix_cache_hits / queries)",
         f"{f2(h['shared_prompt'])} / {f2(h['conversation'])}"),
        ("chunked prefill: prompt tokens; steps scheduling context; largest step (vLLM's per-step log)",
         f"{' + '.join(map(str, c['workload']['prompt_tokens']))}; {c['context_steps']}; {c['max_step_tokens']} tokens"),
        ("preemption: vllm:num_preemptions / requests; finished (vllm:request_success)",
         f"{p['counters']['num_preemptions']} / {p['requests']}; {p['counters']['request_success']['length']}"),
        ("aborts: streaming clients, disconnected; server healthy; KV cache usage after",
         f"{a['clients']}, {len(a['disconnected'])}; {'yes' if a['server_healthy'] else 'no'}; "
         f"{pct(a['kv_cache_usage_after'])}"),
    ]
    for run, name in (("eagle3", "EAGLE-3"), ("plain", "plain"), ("accept_every_draft", "every draft accepted")):
        t = s[run]["test"]
        rows.append((f"sampling at T {s['settings']['temperature']}, top-p {s['settings']['top_p']}: {name}, "
                     f"p-value against the float64 target over {t['positions']} tokens", _p(t["p_value"])))
    return rows


def _serving_readme(d: dict) -> str:
    h, s = d["prefix_cache_hit_rate"], d["sampling"]
    return (f"greedy output equal and acceptance within 0.05 of a clean run under prefix caching (hit rate "
            f"{f2(h['hit_rate'])}), chunked prefill ({d['chunked_prefill']['context_steps']} steps of at most "
            f"{d['chunked_prefill']['max_step_tokens']} tokens), preemption "
            f"({pct(d['preemption']['preempted_share'])} of requests) and {len(d['aborts']['disconnected'])} of "
            f"{d['aborts']['clients']} clients disconnecting; sampling follows the target (p "
            f"{s['eagle3']['test']['p_value']:.2f}; with every draft accepted, p {_p(s['accept_every_draft']['test']['p_value'])})")


def _replay(d: dict) -> list[tuple[str, str]]:
    return [(f"aux ids {k}", v) for k, v in d["results"].items()]


def _offline(d: dict) -> list[tuple[str, str]]:
    return [(r["name"], ("served" if r["ok"] else "failed") + f", {r['compilation']['cudagraph_mode']}")
            for r in d["runs"]]


STAND_INS = ("the 14-patch series; torch stand-ins for vLLM's compiled ops (since retired: vLLM's "
             "own kernels are built now)")
BUILT = ("vLLM's own kernels with FA3 and DeepGEMM, built by an earlier `kernels.py` from the pinned sdist and "
         "git snapshots of CUTLASS, flash-attention, DeepGEMM and fmt, no torch stand-in")
REGISTRY = ("vLLM's own kernels built by `kernels.py` from registry sources only (the sdist, nvidia-cutlass); "
            "no FA3: TRITON_MLA target, MLA prefill on FlashInfer 0.6.3's fa2 template (harness switch)")
# README's kernels column: which build produced a row.
KERNELS = ((REGISTRY, "registry build"), (BUILT, "FA3 build"), (STAND_INS, "torch stand-ins"))


def kernels_of(claim: "Claim") -> str:
    return next((label for prefix, label in KERNELS if claim.ran_on.startswith(prefix)), "CPU")
CLAIMS = [
    Claim("acceptance", "EAGLE-3 acceptance in production settings (DeepSeek-V3-shaped target)",
          "2026-12-02_h200_acceptance_pytest_built_kernels_early_control.json",
          f"{BUILT}; bf16, torch.compile, FULL_AND_PIECEWISE CUDA graphs; FLASH_ATTN_MLA target, FLASH_ATTN drafter",
          "pytest -m gpu tests/e2e/gpu/test_eagle3_acceptance.py", _acceptance, _acceptance_readme),
    Claim("dsa", "GLM-5 and DeepSeek-V3.2 (DeepSeek Sparse Attention)",
          "2026-12-02_h200_dsa_built_deep_gemm.json",
          f"{BUILT}, DeepGEMM built from its pin; torch stand-ins for FlashMLA's two sparse kernels only; bf16, eager",
          "pytest -m gpu tests/e2e/gpu/test_eagle3_dsa.py", _dsa, _dsa_readme),
    Claim("int4-acceptance", "Kimi-K2.5 INT4 (routed experts W4A16, the published quantization_config)",
          "2026-12-02_h200_bench_kimi_k25_int4_built_kernels.json", f"{BUILT}; production settings",
          "pytest -m gpu tests/e2e/gpu/test_eagle3_int4.py -k acceptance", _int4_acceptance, _int4_acc_readme),
    Claim("int4-aux", "Kimi-K2.5 INT4 aux states against a float64 forward, and speculators' generator",
          "2026-12-02_h200_int4_kimi_k25_aux_trained_target.json", f"{BUILT}; production settings",
          "pytest -m gpu tests/e2e/gpu/test_eagle3_int4.py -k aux", _int4_aux, _int4_readme),
    Claim("smoke", "Smoke tests: greedy output equal with each drafter layout",
          "2026-12-02_h200_smoke_built_kernels.json", f"{BUILT}; float32, eager",
          "pytest -m gpu tests/e2e/gpu/test_eagle3_e2e.py tests/e2e/gpu/test_eagle3_mla_drafter_e2e.py", _smoke),
    Claim("backends", "A forced MLA backend on the target, plain and with each drafter",
          "2026-12-02_h200_backends_matrix_drafter_backend_patch.json", f"{BUILT}; production settings",
          "python tools/gpu_harness/prod_check.py backends --out DIR", _backends, _backends_readme),
    Claim("backends-refused", "MLA backends this build cannot run: refused at start",
          "2026-12-02_h200_backends_matrix_built_kernels.json", f"{BUILT}; the 23-patch series",
          "python tools/gpu_harness/prod_check.py backends --out DIR", _refused),
    Claim("offline-kimi", "Kimi-K2.5 offline with the Llama and the MLA drafter (random weights)",
          "2026-12-02_h200_prod_offline_kimi_k25_built_kernels.json", f"{BUILT}; production settings",
          "python tools/gpu_harness/prod_check.py offline --only kimi_k25 --out DIR", _offline),
    Claim("server-deepseek", "OpenAI server: DeepSeek-V3 + Llama drafter (random weights)",
          "2026-12-02_h200_server_deepseek_v3_built_kernels.json", BUILT,
          "python tools/gpu_harness/prod_check.py server --out DIR", _server),
    Claim("server-kimi-llama", "OpenAI server: Kimi-K2.5 + Llama drafter (random weights)",
          "2026-12-02_h200_server_kimi_k25_llama_drafter_built_kernels.json", BUILT,
          "python tools/gpu_harness/prod_check.py server --kimi llama --out DIR", _server),
    Claim("server-kimi-mla", "OpenAI server: Kimi-K2.5 + MLA drafter (random weights)",
          "2026-12-02_h200_server_kimi_k25_mla_drafter_built_kernels.json", BUILT,
          "python tools/gpu_harness/prod_check.py server --kimi --out DIR", _server),
    Claim("server-trained", "OpenAI server: the trained pair, acceptance from /metrics",
          "2026-12-01_h200_server_eagle3_trained.json", STAND_INS,
          "python tools/gpu_harness/prod_check.py server --target T --drafter D --out DIR", _server_trained),
    Claim("cache", "Two drafters, one compile cache: with the series",
          "2026-12-01_h200_cache_patched.json", STAND_INS,
          "python tools/gpu_harness/bench_eagle3.py cache --artifacts A --out DIR", _cache),
    Claim("cache-nopatch", "Two drafters, one compile cache: without the compile-cache patch",
          "2026-12-01_h200_cache_without_compile_cache_patch.json", STAND_INS,
          "python tools/gpu_harness/bench_eagle3.py cache --artifacts A --out DIR --tag without-compile-cache-patch",
          _cache),
    Claim("kernels", "vLLM's own kernels and DeepGEMM built cold on the H200 (16 cores)",
          "2026-12-02_h200_kernels_build_call50.json", f"{BUILT}; the pinned sdist's CMake, sm_90a, the subset in `SUBSET`",
          "python3 tools/gpu_harness/kernels.py build --out DIR -j 16", _kernels, _kernels_readme),
    Claim("prefill-probe", "MLA prefill without FA3: FlashInfer's two templates on the verify and prompt shapes",
          "2026-12-05_h100_prefill_probe.json",
          "FlashInfer 0.6.3 from PyPI, bf16, one TP-8 rank's heads of DeepSeek-V3 (16) and Kimi-K2.5 (8), qk 192 / "
          "v 128; on an H100 (no H200 could be started)",
          "python3 tools/gpu_harness/prefill_probe.py --out DIR", _prefill_probe),
    Claim("fulldepth", "Kimi-K2.5 INT4, one TP-8 rank's share of all 61 layers: EAGLE-3 speed-up",
          "2026-12-03_h200_fulldepth_kimi_k25_int4_summary.json",
          f"{BUILT}; Marlin MoE; random weights (acceptance 1.0 measured, so the speed-up is AL x plain wall / "
          "EAGLE-3 wall); k = 3, 16-token prompts, 64 tokens, 3 interleaved repeats; async scheduling on, "
          "FULL_AND_PIECEWISE graphs, FLASH_ATTN_MLA target; leaves out the all-reduce between ranks, expert "
          "parallelism and long contexts",
          "python tools/gpu_harness/fulldepth.py run --model kimi-k25-int4 --out DIR", _fulldepth,
          _fulldepth_readme, _fulldepth_breakdown),
    Claim("fulldepth-triton-before", "61 layers on TRITON_MLA (registry build), plain decode: before the TRITON_MLA mails",
          "2026-12-07_h100_fulldepth_kimi_k25_int4_registry_before.json",
          f"{REGISTRY}; Marlin MoE; random weights; on an H100; 16-token prompts, 48 tokens, one repeat; the "
          "26-patch series (main at 5db8d4c), PIECEWISE graphs (vLLM drops FULL for TritonMLABackend)",
          "python tools/gpu_harness/fulldepth.py run --model kimi-k25-int4 --engines plain --batches 1,8 "
          "--repeats 1 --gen-tokens 48 --out DIR", _fulldepth),
    Claim("fulldepth-triton-after-128", "61 layers on TRITON_MLA with the proposed TRITON_MLA mails, context 128",
          "2026-12-07_h100_fulldepth_kimi_k25_int4_triton_mla_after_ctx128.json",
          f"{REGISTRY}; Marlin MoE; random weights (acceptance 1.0 measured, so the speed-up is AL x plain wall / "
          "EAGLE-3 wall); on an H100; the series plus `patches/proposed/triton-mla-verify-as-decode.mbox`; k = 3, "
          "prompts from the prefix cache, 64 tokens, 2 interleaved repeats, Llama drafter on TRITON_ATTN",
          "python tools/gpu_harness/fulldepth.py run --model kimi-k25-int4 --engines plain,llama --contexts 128,8192 "
          "--batches 1,8 --repeats 2 --gen-tokens 64 --out DIR", _fulldepth, _fulldepth_triton_readme),
    Claim("fulldepth-triton-after-8192", "61 layers on TRITON_MLA with the proposed TRITON_MLA mails, context 8192",
          "2026-12-07_h100_fulldepth_kimi_k25_int4_triton_mla_after_ctx8192.json",
          f"{REGISTRY}; as the row above, the same engines; batch 8 at 8192 does not fit an H100 beside the weights",
          "python tools/gpu_harness/fulldepth.py run --model kimi-k25-int4 --engines plain,llama --contexts 128,8192 "
          "--batches 1,8 --repeats 2 --gen-tokens 64 --out DIR", _fulldepth, _fulldepth_triton_readme),
    Claim("acceptance-triton", "EAGLE-3 acceptance on TRITON_MLA with the proposed TRITON_MLA mails (cut)",
          "2026-12-07_h100_acceptance_triton_mla_after_cut.json",
          f"{REGISTRY}; production settings, FULL_AND_PIECEWISE kept; on an H100; the series plus "
          "`patches/proposed/triton-mla-verify-as-decode.mbox`",
          "pytest -m gpu tests/e2e/gpu/test_eagle3_acceptance.py", _acceptance_cut),
    Claim("int4-acceptance-triton", "Kimi-K2.5 INT4 acceptance on TRITON_MLA with the proposed TRITON_MLA mails (cut)",
          "2026-12-07_h100_int4_acceptance_triton_mla_after_cut.json", f"{REGISTRY}; as the row above",
          "pytest -m gpu tests/e2e/gpu/test_eagle3_int4.py -k acceptance", _acceptance_cut),
    Claim("smoke-registry", "Smoke tests on the registry build: greedy output equal with each drafter layout",
          "2026-12-07_h100_smoke_registry.json", f"{REGISTRY}; float32, eager, MLA off (TRITON_ATTN); on an H100",
          "pytest -m gpu tests/e2e/gpu/test_eagle3_e2e.py tests/e2e/gpu/test_eagle3_mla_drafter_e2e.py", _smoke),
    Claim("fulldepth-fa3-series", "61 layers, the series, back to back with the zero-bubble mail: before",
          "2026-12-04_h200_fulldepth_kimi_k25_int4_fa3_series_summary.json",
          f"{BUILT}; as the 61-layer row, 2 repeats of 64 tokens; the 26-patch series (main at 87d0ee3)",
          "python tools/gpu_harness/fulldepth.py run --model kimi-k25-int4 --batches 1,8,32 --repeats 2 "
          "--gen-tokens 64 --out DIR", _fulldepth),
    Claim("fulldepth-fa3-zero-bubble", "61 layers, the series with the zero-bubble mail (patches/proposed): after",
          "2026-12-04_h200_fulldepth_kimi_k25_int4_fa3_zero_bubble_summary.json",
          f"{BUILT}; the same machine and lease, the series plus the first version of "
          "`patches/proposed/zero-bubble-async-spec-decode.mbox` (staged by `prepare.py`)",
          "python tools/gpu_harness/fulldepth.py run --model kimi-k25-int4 --batches 1,8,32 --repeats 2 "
          "--gen-tokens 64 --out DIR", _fulldepth),
    Claim("fulldepth-fa3-zero-bubble-64-128", "61 layers, the zero-bubble mail at batch 64 and 128",
          "2026-12-04_h200_fulldepth_kimi_k25_int4_fa3_zero_bubble_64_128_summary.json",
          f"{BUILT}; as above, Llama drafter",
          "python tools/gpu_harness/fulldepth.py run --model kimi-k25-int4 --engines plain,llama --batches 64,128 "
          "--repeats 2 --gen-tokens 64 --out DIR", _fulldepth),
    Claim("serving-dsv3", "Serving conditions: DeepSeek-V3-shaped target, Llama drafter",
          "2026-12-03_h200_serving_deepseek_v3_llama.json",
          f"{BUILT}; production settings; the OpenAI server with prefix caching, chunked prefill 2048 and a "
          "12,288-token KV cache, against clean offline runs",
          "pytest -m gpu tests/e2e/gpu/test_eagle3_serving.py -k 'dsv3 and not soak'", _serving, _serving_readme),
    Claim("serving-kimi", "Serving conditions: Kimi-K2.5 INT4 (Marlin MoE), MLA drafter",
          "2026-12-03_h200_serving_kimi_k25_int4_mla.json", f"{BUILT}; as above",
          "pytest -m gpu tests/e2e/gpu/test_eagle3_serving.py -k 'kimi and not soak'", _serving, _serving_readme),
    Claim("speed", "EAGLE-3 speed-up on the tiny pair, k = 3, 128 tokens, prefill timed apart",
          "2026-12-02_h200_speed_built_kernels.json", f"{BUILT}; production settings",
          "python tools/gpu_harness/speed.py --artifacts A --out DIR", _speed, _speed_readme),
    Claim("profile", "One decode step of the tiny pair at batch 1",
          "2026-12-02_h200_profile_built_kernels.json", f"{BUILT}; production settings",
          "python tools/gpu_harness/step_profile.py --artifacts A --out DIR", _profile),
    Claim("project-deepseek", "DeepSeek-V3 at TP = 8: one rank's share, projected to 61 layers (Llama drafter)",
          "2026-12-02_h200_project_deepseek_v3_tp8_rank_gpu_time.json",
          f"{BUILT}; random weights, 4 / 6 / 8 layers; per-rank compute only (no all-reduce, no expert "
          "parallelism, no fp8 weights)",
          "python tools/gpu_harness/project.py run --model deepseek-v3 --out DIR", _project, _project_readme),
    Claim("project-deepseek-mla", "DeepSeek-V3 at TP = 8, SpecForge's MLA drafter",
          "2026-12-02_h200_project_deepseek_v3_tp8_rank_mla_drafter.json", f"{BUILT}; as above",
          "python tools/gpu_harness/project.py run --model deepseek-v3 --drafters mla --out DIR", _project),
    Claim("project-kimi", "Kimi-K2.5 INT4 at TP = 8: one rank's share, projected to 61 layers (Llama drafter)",
          "2026-12-02_h200_project_kimi_k25_int4_tp8_rank_gpu_time.json",
          f"{BUILT}; Marlin MoE; random weights, 2 / 4 / 6 layers; per-rank compute only",
          "python tools/gpu_harness/project.py run --model kimi-k25-int4 --drafters llama --out DIR", _project),
    Claim("project-kimi-mla", "Kimi-K2.5 INT4 at TP = 8, TorchSpec's MLA drafter",
          "2026-12-02_h200_project_kimi_k25_int4_tp8_rank_mla_drafter.json", f"{BUILT}; as above",
          "python tools/gpu_harness/project.py run --model kimi-k25-int4 --drafters mla --out DIR", _project),
    Claim("cpu-replay", "The acceptance test's controls replayed on CPU (vLLM's drafter class, float32)",
          "2026-12-02_cpu_replay_acceptance_controls.json", "the cpu venv of ./test.sh; 8 prompts, 64 tokens",
          "python ctl.py (the script the file records)", _replay),
]


def load(claim: Claim) -> dict:
    path = RESULTS / claim.file
    if not path.exists():
        raise StackError(f"{claim.key}: {path.relative_to(REPO_ROOT)} does not exist; fix CLAIMS in "
                         f"tools/results_doc.py or restore the file")
    return json.loads(path.read_text())


# A device-call counter means nothing to a reader: a recorded "command" that
# is a description naming one is passed over for the next.
_COUNTER = re.compile(r"\b[Cc]alls? [0-9]+|\b[Ii]ssue [0-9]+")


def device_command(d: dict) -> str:
    """The command the file records: its device command, else its command."""
    for text in (d.get("device_command"), d.get("command"), (d.get("meta") or {}).get("device_command")):
        if not text or _COUNTER.search(str(text)):
            continue
        if "\n" in str(text):
            return "a script: the file's `command`"
        return f"`{' '.join(str(text).split())}`"
    return "not recorded in the file"


def date_of(claim: Claim, d: dict) -> str:
    return d.get("date") or claim.file[:10]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_doc() -> str:
    out = ["# Results",
           "",
           "Rendered by `python -m tools.results_doc` from the JSON files in",
           "[`tools/gpu_harness/results/`](../tools/gpu_harness/results/); do not edit by hand.",
           "Each section gives what ran, the command a user runs for it, the command and",
           "date the file records, and the figures read from it. The GPU runs are on one",
           "H200 through the harness ([gpu.md](gpu.md)), on tiny checkpoints with the",
           "published geometry; what that leaves out is in [gpu.md](gpu.md#not-verified).",
           ""]
    for c in CLAIMS:
        d = load(c)
        out += [f"## {c.title}",
                "",
                f"- file: [`{c.file}`](../tools/gpu_harness/results/{c.file}), {date_of(c, d)}",
                f"- ran on: {c.ran_on}",
                f"- command: `{c.command}`",
                f"- recorded command: {device_command(d)}",
                "",
                "| figure | value |",
                "| --- | --- |",
                *(f"| {_cell(k)} | {_cell(v)} |" for k, v in c.figures(d)),
                ""]
        if c.tables is not None:
            out += c.tables(d)
    return "\n".join(out)


def mla_backends(d) -> list[str]:
    """The MLA backends the target ran in a results file: every
    ``attention_backends`` record's ``target`` entries that are MLA."""
    found: set[str] = set()

    def walk(x):
        if isinstance(x, dict):
            t = (x.get("attention_backends") or {}).get("target") if isinstance(x.get("attention_backends"),
                                                                                dict) else None
            found.update(b for b in (t or []) if "MLA" in b)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(d)
    return sorted(found)


def render_readme_table() -> str:
    rows = ["| claim | result | kernels (target's MLA backend) | command | file |", "| --- | --- | --- | --- | --- |"]
    for c in CLAIMS:
        if c.readme is None:
            continue
        d = load(c)
        mla = mla_backends(d)
        build = kernels_of(c) + (f" ({', '.join(mla)})" if mla else "")
        rows.append(f"| {_cell(c.title)} | {_cell(c.readme(d))} | {build} | `{c.command}` | "
                    f"[{c.file[:10]}](tools/gpu_harness/results/{c.file}) |")
    return "\n".join(rows)


def readme_with_table(readme: str) -> str:
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise StackError(f"README.md must hold one {BEGIN} line and, after it, one {END} line")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{render_readme_table()}\n{END}{tail}"


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def main() -> int:
    ap = parser(TOOL, __doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if a document differs from its rendering")
    args = ap.parse_args()
    want = {DOC: render_doc(), README: readme_with_table(README.read_text())}
    stale = [p for p, text in want.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"[{TOOL}] {_shown(p)} is not what the results render: "
                  f"run `python -m tools.results_doc` and commit it", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(want[p])
        print(f"[{TOOL}] wrote {_shown(p)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
