#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Project EAGLE-3's speed-up to the 61-layer models users serve at TP = 8, from step times of their per-rank geometry.

    python3 tools/gpu_harness/project.py run --model deepseek-v3 --out DIR          (a GPU)
    python3 tools/gpu_harness/project.py run --model kimi-k25-int4 --out DIR        (a GPU)
    python3 tools/gpu_harness/project.py fit DIR/project_deepseek-v3.json           (anywhere)

At tensor parallelism 8 each GPU runs 1/8 of every layer: 1/8 of the
attention heads, of each expert's intermediate width and of the dense MLP,
with the full hidden size. ``geometry()`` derives that per-rank target from a
published config (tests/v1/spec_decode/published_configs, PROVENANCE.md),
and each drafter likewise from its published config: ``drafter_geometry()``
for the Llama drafters (SpecForge's, TorchSpec's), ``mla_drafter_geometry()``
for the drafters with one DeepSeek MLA layer (Eagle3DeepseekV2ForCausalLM);
the vocabulary, and so the LM head, is split over the ranks too. ``run``
serves them with random weights (``load_format="dummy"``: step time does not
depend on the values) at a few layer counts, times plain decode steps and
EAGLE-3 steps (k = 3: one verify of k + 1 tokens and k drafter passes) with
each drafter asked for (``--drafters``; results under "eagle3" for the Llama
drafter, the name results had before there was a choice, and "eagle3_mla"),
and ``fit`` fits T(L) = a + b * L to each, reports how well a line fits, and,
only where the plain line and a drafter's line rise and pass within 5 % of
each point, projects the 61-layer step times and that drafter's speed-up at
the acceptance lengths published for these drafters (H200 call 34's
whole-step times did not: flat plain steps). ``projected_speedup`` is the
Llama drafter's ("eagle3"), as in the results before; ``projected_speedup_by_drafter``
has every drafter's. ``run`` also profiles a short window of each engine and
batch (vLLM's torch profiler), and ``project_gpu`` fits the per-step GPU
kernel time, which grows with the layers even where the wall step does not,
to bound the 61-layer step (see its docstring).

The models (MODELS): ``deepseek-v3``, the published DeepSeek-R1-0528 config
(DeepSeek-V3's architecture) with SpecForge's drafters; ``kimi-k25-int4``,
the text model of moonshotai/Kimi-K2.5's published config.json (the INT4
release) with TorchSpec's drafters. The Kimi target is served as a plain
DeepSeek-V3-architecture text model: the vision tower takes no part in a
decode step. Its routed experts are INT4 as published (compressed-tensors
W4A16, group 32, served by Marlin MoE; ``run`` refuses another MoE method);
attention, shared experts, the dense MLP and the LM head are bf16, as in the
release.

Every projected figure is a projection. It leaves out the all-reduce between
the 8 ranks (two per layer, after attention and after the MoE), which the
seeds measured at 51.5 % of decode time on PCIe GPUs: a per-step cost that a
plain step and a verify step pay about equally (both are latency-bound at
these token counts), so adding it moves the speed-up toward the acceptance
length, and leaving it out understates the speed-up. The same holds for
Kimi-K2.5. It also leaves out expert parallelism, the fp8 weights of the
DeepSeek release (bf16 in ``deepseek-v3``; ``deepseek-v3-fp8`` keeps them)
and the scheduler's own per-step cost at 8 ranks.

Time: each engine start costs about 40-60 s on an H200 (plain and the Llama
drafter at three layer counts, six engines, took 377 s in call 37). The
engines run drafter by drafter (plain at every layer count, then the first
drafter, ...), the result file is rewritten after each, and ``--budget-s``
starts no engine that the longest one so far would carry past it, so a run
cut short still leaves plain and the first drafters complete.
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
# The result key of each kind of drafter. "eagle3" is the Llama drafter's: the
# key of the results measured when each model had that drafter alone, so
# those results (results/2026-12-02_h200_project_deepseek_v3_*.json) still fit.
DRAFTER_KEYS = {"llama": "eagle3", "mla": "eagle3_mla"}
MODELS = {
    "deepseek-v3": {
        "target": "deepseek-r1-0528-target-ttmetal",
        "drafters": {"llama": "specforge-deepseek-v3-671b-eagle3",
                     "mla": "specforge-deepseek-r1-eagle3-mla"},
        # The Llama drafter alone by default, as in call 37 (plain and it at
        # 4/6/8 layers, 377 s), so a rerun stays comparable and in budget.
        "default_drafters": ["llama"],
        "default_layers": [4, 6, 8],  # the first 3 layers are dense
        "prof_tokens": 16,
    },
    # The DeepSeek release as published: every linear and expert weight fp8
    # (e4m3, 128 x 128 blocks, the config's quantization_config). Which kernels
    # serve it depends on the build: engine_facts records the fp8 GEMM of each
    # linear shape (DeepGEMM or vLLM's Triton fallback) and the MoE backend.
    "deepseek-v3-fp8": {
        "target": "deepseek-r1-0528-target-ttmetal",
        "drafters": {"llama": "specforge-deepseek-v3-671b-eagle3",
                     "mla": "specforge-deepseek-r1-eagle3-mla"},
        "default_drafters": ["llama"],
        "default_layers": [4, 6, 8],
        "prof_tokens": 16,
        "weights": "fp8",
    },
    "kimi-k25-int4": {
        "target": "moonshotai-kimi-k25-target",
        "drafters": {"llama": "torchspec-kimi-k25-eagle3",
                     "mla": "torchspec-kimi-k25-eagle3-mla"},
        # Nine engines with both drafters. 2, 4, 6 layers (one dense layer
        # first, so 2 already hold a MoE layer) load and capture less than
        # 4, 6, 8; 8 profiled tokens still leave about six decode steps for
        # the median (step_breakdown drops the first and last); --budget-s
        # keeps the run inside a device call (see the docstring).
        "default_drafters": ["llama", "mla"],
        "default_layers": [2, 4, 6],
        "prof_tokens": 8,
        # The INT4 experts' step time is Marlin MoE's; any other method would
        # time another kernel than vLLM serves this release with on Hopper.
        "moe_method": "Marlin",
    },
}


def _shard(value: int, what: str) -> int:
    if value % TP:
        raise ValueError(f"{what} = {value} does not split over TP = {TP}")
    return value // TP


def published_target(name: str) -> dict:
    """A published target config as the text model vLLM builds: a multimodal
    release's ``text_config`` (Kimi-K2.5's: DeepseekV3ForCausalLM, model_type
    kimi_k2, its quantization_config inside) as a top-level config.

    The text config keeps model_type kimi_k2: this series loads a kimi_k2
    config that ships no configuration code as transformers' DeepseekV3Config
    (patch "Load kimi_k2 EAGLE-3 drafter configs that ship no code"), which is
    what KimiK25Config makes of the released text_config too, so the engine
    sees the model_type it sees for the release. Its auto_map goes: it names
    configuration_deepseek.py, which is not here, and with it vLLM would ask
    for that code (stock v0.16.0 with transformers 4.57 refuses kimi_k2
    either way: transformers does not know it)."""
    cfg = json.loads((PUBLISHED / name / "config.json").read_text())
    text = cfg.get("text_config")
    if text is None:
        return cfg
    text = dict(text)
    text.pop("auto_map", None)
    if text.get("architectures") != ["DeepseekV3ForCausalLM"]:
        raise ValueError(f"{name}: the text model is {text.get('architectures')}, not DeepseekV3ForCausalLM")
    return text


def geometry(target: dict, layers: int, fp8: bool = False) -> dict:
    """One rank's share of a DeepSeek-V3-architecture target at TP = 8, with
    ``layers`` layers (the first ``first_k_dense_replace`` dense, as published).
    bf16 but an INT4 release's routed experts, or with ``fp8`` the published
    fp8 quantization_config kept as it is."""
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
    if fp8 and (q or {}).get("quant_method") != "fp8":
        raise ValueError(f"fp8 asked for, but the published config's quantization_config is {q}")
    if q and q.get("quant_method") != "compressed-tensors" and not fp8:
        cfg.pop("quantization_config")
    return cfg


def target_geometry(model: str, layers: int) -> dict:
    """MODELS[model]'s per-rank target at ``layers`` layers."""
    spec = MODELS[model]
    return geometry(published_target(spec["target"]), layers, fp8=spec.get("weights") == "fp8")


def marlin_moe_supports(target: dict) -> bool:
    """Whether vLLM 0.16 serves the routed experts of ``target`` (a
    geometry()) with Marlin MoE: check_moe_marlin_supports_layer's shape and
    group rule (marlin_utils.py) on one rank's experts. Kimi-K2.5 at TP = 8:
    hidden 7168 = 56 x 128, 256 intermediate per rank, a multiple of
    max(64, group 32); so CompressedTensorsWNA16MarlinMoEMethod, as at TP = 8
    on eight GPUs (the rank's share is the partition there too)."""
    q = target.get("quantization_config") or {}
    groups = [g["weights"].get("group_size") or -1 for g in q.get("config_groups", {}).values()]
    return bool(groups) and all(
        target["hidden_size"] % 128 == 0 and target["moe_intermediate_size"] % max(64, g) == 0
        and g in (-1, 32, 64, 128) for g in groups)


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


# What Eagle3DeepseekV2ForCausalLM's MLA draft layer must share with an MLA
# target (_MLA_SHARED_FIELDS in the series' deepseek_eagle3.py): it joins the
# target's KV-cache group and MLA metadata, and refuses any difference.
MLA_SHARED_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                     "num_attention_heads")


def mla_drafter_geometry(drafter: dict, target: dict, aux_ids: list[int]) -> dict:
    """The MLA drafter's share at TP = 8 against ``target`` (a geometry()):
    one DeepSeek MLA layer (heads split like the target's) and a dense MLP
    (intermediate split), vocabulary as drafter_geometry(). The MoE fields
    some of these configs carry (copied from their target) are left as
    published: the draft layer's MLP is dense whatever they say."""
    cfg = dict(drafter)
    heads = _shard(cfg["num_attention_heads"], "drafter num_attention_heads")
    cfg.update(vocab_size=target["vocab_size"], draft_vocab_size=target["vocab_size"],
               num_attention_heads=heads, num_key_value_heads=heads,
               intermediate_size=_shard(cfg["intermediate_size"], "drafter intermediate_size"),
               eagle_aux_hidden_state_layer_ids=aux_ids)
    # The ids above replace the published (61-layer) ones; the nested copy
    # would disagree with them, which vLLM refuses.
    cfg.pop("eagle_config", None)
    diff = [f for f in MLA_SHARED_FIELDS if cfg.get(f) != target.get(f)]
    if diff:
        raise ValueError(f"the MLA drafter's {diff} differ from the target's: vLLM refuses it beside an MLA target")
    return cfg


DRAFTER_GEOMETRY = {"llama": drafter_geometry, "mla": mla_drafter_geometry}


def aux_ids(layers: int) -> list[int]:
    """Three distinct aux ids for a ``layers``-layer target: [1, L // 2, L - 1]
    as the DeepSeek runs had, and where those repeat (fewer than 4 layers:
    Kimi's 2) the last three boundaries, up to the last layer's output (id L,
    which vLLM accepts). Which states are copied does not change a step's
    cost; their number, 3 as published, does."""
    ids = [1, layers // 2, layers - 1]
    return ids if len(set(ids)) == 3 else [layers - 2, layers - 1, layers]


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
    (or was measured at fewer than three layer counts: a run its budget
    stopped) cannot be extrapolated."""
    fits = {n: fit_line(sorted(p), [p[k] for k in sorted(p)]) for n, p in points.items() if len(p) >= 3}
    refused = {n: f"measured at {len(p)} layer count(s), a line needs three (the run stopped early)"
               for n, p in points.items() if len(p) < 3}
    refused.update({n: why for n, f in fits.items() if (why := not_linear(f))})
    return fits, refused


def _drafters_to_project(points: dict, refused: dict) -> list[str]:
    """The EAGLE-3 engines (every name but "plain") whose line, and plain's,
    may be extrapolated."""
    if "plain" not in points or "plain" in refused:
        return []
    return [n for n in points if n != "plain" and n not in refused]


def _speedups(step: dict[str, float], drafters: list[str], acceptance) -> dict:
    return {n: {str(al): al * step["plain"] / step[n] for al in acceptance} for n in drafters}


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
    """points: {"plain"|"eagle3"|"eagle3_mla": {layers: step ms}} -> fits,
    projected step times and each drafter's speed-up (acceptance length x
    plain step / its EAGLE-3 step: ``projected_speedup_by_drafter``, and the
    Llama drafter's, "eagle3", also as ``projected_speedup``, where results
    before the MLA drafter had it). A drafter whose fit is not a line
    (not_linear) is left out, with why, under ``not_projected``; when plain's
    is not, or no drafter's is, nothing is projected."""
    fits, refused = _fits(points)
    drafters = _drafters_to_project(points, refused)
    if not drafters:
        return {"fits": fits, "projected_layers": layers, "not_projected": refused,
                "label": "no projection: the measured step times are not linear in layers"}
    at = {n: f["a_ms"] + f["b_ms_per_layer"] * layers for n, f in fits.items() if n not in refused}
    out = {"fits": fits, "projected_layers": layers, "projected_step_ms": at}
    by = _speedups(at, drafters, acceptance)
    if "eagle3" in by:
        out["projected_speedup"] = by["eagle3"]
    out["projected_speedup_by_drafter"] = by
    if refused:
        out["not_projected"] = refused
    out["label"] = "projection: per-rank compute only, no all-reduce (see project.py)"
    return out


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
    same assumption for both, per drafter as in project()."""
    fits, refused = _fits(gpu)
    label = ("projection from per-step GPU kernel time: per-rank compute only, no all-reduce, CPU cost "
             "held at its measured value (see project.py)")
    drafters = _drafters_to_project(gpu, refused)
    if not drafters:
        return {"gpu_fits": fits, "not_projected": refused, "label": label}
    names = ["plain", *drafters]
    g61 = {n: fits[n]["a_ms"] + fits[n]["b_ms_per_layer"] * layers for n in names}
    w = {n: sum(wall[n].values()) / len(wall[n]) for n in names}
    g = {n: sum(gpu[n].values()) / len(gpu[n]) for n in names}
    step = {"overlapped": {n: max(w[n], g61[n]) for n in names},
            "serial": {n: w[n] + g61[n] - g[n] for n in names}}
    by = {n: {how: _speedups(st, [n], acceptance)[n] for how, st in step.items()} for n in drafters}
    out = {"gpu_fits": fits, "projected_layers": layers, "gpu_ms_at_projected_layers": g61,
           "mean_wall_step_ms": w, "projected_step_ms": step}
    if "eagle3" in by:
        out["projected_speedup"] = by["eagle3"]
    out["projected_speedup_by_drafter"] = by
    if refused:
        out["not_projected"] = refused
    out["label"] = label
    return out


def _gpu_step_ms(trace_dir: Path, seen: set[str]) -> float:
    """Median GPU kernel time per decode step of the worker trace written
    under ``trace_dir`` that is not in ``seen`` (which it joins)."""
    from tools.gpu_harness.step_trace import step_breakdown, worker_trace

    path, trace = worker_trace(trace_dir, seen)
    seen.add(path)
    steps = step_breakdown(trace).get("steps")
    if not steps:
        raise RuntimeError(f"{path}: no decode steps (is VLLM_CUSTOM_SCOPES_FOR_PROFILING=1?)")
    return steps["median"]["gpu_kernel_ms"]


def _is_marlin(moe: dict) -> bool:
    method = moe.get("wrapped") or moe.get("quant_method") or ""
    return "Marlin" in method and moe.get("kernel_backend") in (None, "Marlin")


def serves_fp8(facts: dict) -> bool:
    """Whether an engine's facts (engine_facts) show fp8 weights served: the
    experts by vLLM's Fp8MoEMethod and some linear through an fp8 block GEMM."""
    moe, linear = facts.get("moe", {}), facts.get("fp8_linear") or {}
    return ((moe.get("wrapped") or moe.get("quant_method")) == "Fp8MoEMethod"
            and bool(linear) and "error" not in linear)


def check_served(model: str, facts: dict) -> None:
    """Stop a timing run whose engine (engine_facts) does not serve ``model``
    as vLLM does on Hopper: the target on an MLA backend, an INT4 release's
    experts on Marlin MoE, an fp8 release in fp8."""
    spec = MODELS[model]
    target_backends = facts.get("attention_backends", {}).get("target", [])
    if not any("MLA" in b for b in target_backends):
        raise RuntimeError(f"the target runs {target_backends}, not an MLA backend: these step "
                           f"times would not be {model}'s (is VLLM_MLA_DISABLE set?)")
    if spec.get("moe_method") == "Marlin" and not _is_marlin(facts.get("moe", {})):
        raise RuntimeError(f"the INT4 experts run {facts.get('moe')}, not Marlin MoE: these step "
                           f"times would not be {model}'s as vLLM serves it on Hopper")
    if spec.get("weights") == "fp8" and not serves_fp8(facts):
        raise RuntimeError(f"the fp8 target is not served in fp8 ({facts.get('moe')}, "
                           f"{facts.get('fp8_linear')}): these step times would not be {model}'s")


def _write(res: dict, out: Path) -> None:
    (out / f"project_{res['model']}.json").write_text(json.dumps(res, indent=1))


def run(model: str, layer_counts: list[int] | None, out: Path, drafters: list[str] | None = None,
        batches=(1, 8, 32), gen_tokens: int = 64, mem_util: float = 0.8, prof_tokens: int | None = None,
        budget_s: float | None = None) -> dict:
    """Time plain and each of ``drafters`` (MODELS[model]["drafters"] keys;
    None: the model's defaults) at ``layer_counts`` (None: the model's), one
    engine at a time, drafter by drafter; OUT/project_MODEL.json is rewritten
    after each engine. ``budget_s``: start no engine that the longest so far
    would carry past this many seconds from the start of run()."""
    import tempfile

    t_run = time.perf_counter()
    spec = MODELS[model]
    layer_counts = list(layer_counts or spec["default_layers"])
    drafters = list(dict.fromkeys(drafters or spec["default_drafters"]))
    if unknown := [d for d in drafters if d not in spec["drafters"]]:
        raise ValueError(f"{model} has no drafter {unknown}: {sorted(spec['drafters'])}")
    prof_tokens = prof_tokens or spec["prof_tokens"]
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
    work = Path(tempfile.mkdtemp(prefix=f"project-{model}-"))
    # Every config first: a geometry the drafter or Marlin cannot take stops
    # the run before the first engine, not after several.
    engines = [("plain", None, {})]
    for kind in drafters:
        published = json.loads((PUBLISHED / spec["drafters"][kind] / "config.json").read_text())
        engines.append((DRAFTER_KEYS[kind], kind, published))
    for L in layer_counts:
        tcfg = target_geometry(model, L)
        if spec.get("moe_method") == "Marlin" and not marlin_moe_supports(tcfg):
            raise ValueError(f"{model} at {L} layers: Marlin MoE cannot take this rank's experts")
        (work / f"target_L{L}").mkdir(parents=True)
        (work / f"target_L{L}" / "config.json").write_text(json.dumps(tcfg, indent=1))
        for name, kind, published in engines[1:]:
            d = work / f"{name}_L{L}"
            d.mkdir()
            cfg = DRAFTER_GEOMETRY[kind](published, tcfg, aux_ids(L))
            (d / "config.json").write_text(json.dumps(cfg, indent=1))
    res = {"model": model, "tp": TP, "k": K, "gen_tokens": gen_tokens, "layers": layer_counts,
           "target_config": spec["target"],
           "drafters": {DRAFTER_KEYS[k]: spec["drafters"][k] for k in drafters},
           "prof_tokens": prof_tokens, "budget_s": budget_s, "profile": h.profile(),
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "step_ms": {}}
    from vllm import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    # Capture only the graphs these batches replay: b tokens (plain decode and
    # the drafter) and (k + 1) * b (the verify). vLLM's default list holds all
    # of them, so the graphs timed are the ones a default engine replays; the
    # 46 others would only lengthen each engine's start.
    capture = sorted({b for b in batches} | {(K + 1) * b for b in batches})
    res["cudagraph_capture_sizes"] = capture
    longest = 0.0
    # Drafter by drafter, not layer count by layer count: a run cut short
    # (budget, device limit) then leaves plain and the first drafters at every
    # layer count, which fit, rather than every engine at too few.
    for name, kind, _ in engines:
        for L in layer_counts:
            key = f"{name}_{L}"
            if budget_s is not None and time.perf_counter() - t_run + longest > budget_s:
                res.setdefault("skipped_engines", []).append(key)
                print("SKIP", model, L, name, f"(budget {budget_s:.0f} s)", flush=True)
                continue
            t_engine = time.perf_counter()
            traces, seen = work / f"trace_{key}", set()
            traces.mkdir()
            dr = None if kind is None else work / f"{name}_L{L}"
            # One engine at a time: the harness's default share (sized for a few
            # tiny engines side by side) leaves no KV cache at this geometry
            # (H200 call 29: "No available memory for the cache blocks").
            llm = LLM(**h.engine_kwargs(work / f"target_L{L}", dr, load_format="dummy",
                                        max_num_seqs=max(batches), skip_tokenizer_init=True,
                                        gpu_memory_utilization=mem_util,
                                        compilation_config={"cudagraph_capture_sizes": capture},
                                        profiler_config={"profiler": "torch", "torch_profiler_dir": str(traces),
                                                         "torch_profiler_with_stack": False}))
            try:
                facts = h.engine_facts(llm)  # its "moe": the first MoE layer's method
                res.setdefault("engine", {})[key] = facts
                check_served(model, facts)
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
            finally:
                h.shutdown(llm)
            wall = time.perf_counter() - t_engine
            longest = max(longest, wall)
            res.setdefault("engine_wall_s", {})[key] = wall
            _write(res, out)
            print("STEP", model, L, name, json.dumps({b: v[name].get(L) for b, v in res["step_ms"].items()}),
                  f"engine {wall:.0f} s", flush=True)
    _project_all(res)
    _write(res, out)
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
    # Given twice (device_run.sh's --model deepseek-v3, then PROJECT_ARGS'),
    # argparse keeps the last, and the defaults below follow it.
    r.add_argument("--model", choices=MODELS, required=True)
    r.add_argument("--layers", type=lambda t: [int(x) for x in t.split(",")], default=None,
                   help="layer counts (default: the model's, " + "; ".join(
                       f"{m} {','.join(map(str, s['default_layers']))}" for m, s in MODELS.items()) + ")")
    r.add_argument("--drafters", type=lambda t: [x for x in t.split(",") if x], default=None,
                   help=f"drafters to time beside plain, of {sorted(DRAFTER_KEYS)} (default: the model's, "
                   + "; ".join(f"{m} {','.join(s['default_drafters'])}" for m, s in MODELS.items()) + ")")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--mem-util", type=float, default=0.8, help="gpu_memory_utilization of each engine")
    r.add_argument("--prof-tokens", type=int, default=None,
                   help="tokens in each profiled window (default: the model's)")
    r.add_argument("--budget-s", type=float, default=None,
                   help="start no engine that the longest so far would carry past this many seconds")
    f = sub.add_parser("fit")
    f.add_argument("result", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        res = run(args.model, args.layers, args.out, drafters=args.drafters, mem_util=args.mem_util,
                  prof_tokens=args.prof_tokens, budget_s=args.budget_s)
    else:
        res = json.loads(args.result.read_text())
        _project_all(res)
    print(json.dumps({k: res[k] for k in ("projection", "projection_gpu_time") if k in res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
