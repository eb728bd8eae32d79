#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Kimi-K2.5 INT4 (routed experts in compressed-tensors W4A16, Marlin MoE) with EAGLE-3.

    python tools/gpu_harness/int4_check.py all --out DIR          (a GPU)
    python tools/gpu_harness/int4_check.py reference VIEW AUX.pt OUT.json

``all`` writes a tiny Kimi-K2.5 target (the kimi_k25 wrapper, MoonViT tower
and all; MLA with the published latent geometry, bf16), trains its text
model briefly on the bench's language (``TRAIN_STEPS``), and packs its routed
experts by compressed_tensors with the ``quantization_config`` of the
published Kimi-K2.5 config.json, verbatim
(tests/v1/spec_decode/published_configs/moonshotai-kimi-k25-target,
PROVENANCE.md), inside ``text_config`` as there. It serves it in production
settings, plain and with a random EAGLE-3 drafter (aux ids 1, 3, 6),
records which MoE method vLLM picked (Marlin, or the check fails) and the aux
states the proposer receives for a 256-token prompt, and then:

1. ``reference``: an independent float64 forward (transformers' DeepSeek-V3
   with vLLM's routing, fp64_reference.py) of the text model with the
   experts dequantized by compressed_tensors' own decompressor
   (tiny_checkpoints.kimi_text_view). Each captured state must be nearest the
   input of its own layer, with an error (over all tokens, and for the median
   token) below a tenth of the gap to the neighbouring layers' inputs
   (``BOUND``). The tokens at a float64 routing near-tie, where bf16 runs
   may take other experts, are listed with their errors (``ROUTING_TIE``).
2. ``speculators``: speculators 0.4.0.1's ``VllmHiddenStatesGenerator`` (the
   seeds' tool) on the same INT4 checkpoint with layer ids (0, 2, 5): its
   states (outputs of those layers) must equal the engine's capture with ids
   (1, 3, 6) within the same bound.

Results: DIR/int4_kimi_k25.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Run as a script, or imported by its bare name from the GPU tests: the
# repository root goes last on sys.path (so `tools.gpu_harness` resolves and
# the installed vllm stays first).
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e" / "gpu"))

import gpu_e2e_helpers as h  # noqa: E402
# The prompts, the long one whose states are checked and the tokens served,
# as dsa_check.py: engine.py's.
from tools.gpu_harness.data import PUBLISHED_KIMI, published_quantization_config  # noqa: E402, F401
from tools.gpu_harness.engine import LONG, MAX_TOKENS, PROMPT_LENGTHS, aux_run  # noqa: E402
from tools.gpu_harness.training import train_target_apart  # noqa: E402


AUX_IDS = (1, 3, 6)
# A random tiny target is chaotic at bf16: a routing near-tie at one token
# spreads through attention to most later tokens by the last layer, so that
# an independent bf16 forward is itself 34-60 % of the layer gap away from
# float64 at id 6 (H200 call 41 and the CPU). A little training calms it (150
# steps on the CPU: 2-3 % at every id), and a trained, then quantized, target
# is what a release is.
TRAIN_STEPS = 400
KIMI_EXTRA = {"limit_mm_per_prompt": {"vision_chunk": 0}}
MARLIN = "CompressedTensorsWNA16MarlinMoEMethod"


def write_models(work: Path, train_steps: int = TRAIN_STEPS) -> dict[str, Path]:
    """The INT4 target (its text model trained ``train_steps`` on the bench's
    language first, then quantized, as a release is; 0: random weights), its
    dequantized reference view and a random drafter."""
    tiny = h._tiny()
    kw = h.checkpoint_kwargs() or {"dtype": "bfloat16", **h.MLA_GEOMETRY}
    p = {"bf16": work / "kimi_k25_bf16", "int4": work / "kimi_k25_int4",
         "view": work / "kimi_k25_int4_dequantized", "drafter": work / "drafter"}
    tiny.write_checkpoint("kimi-k25", p["bf16"], seed=7, **kw)
    text = None
    if train_steps:
        text = tiny.kimi_text_view(p["bf16"], work / "kimi_k25_text")
        train_target_apart(text, train_steps, work)
    tiny.write_kimi_k25_int4(p["bf16"], p["int4"], published_quantization_config(), text_weights=text)
    tiny.kimi_text_view(p["int4"], p["view"])
    tiny.write_checkpoint("eagle3-drafter", p["drafter"], seed=8, dtype=kw["dtype"],
                          aux_layer_ids=AUX_IDS, **h.drafter_shape())
    return p


def engine(target: str, drafter: str | None, out: Path, capture: Path | None) -> None:
    """engine.aux_run (tokens, counters, engine facts, the long prompt's aux
    states) with Kimi-K2.5 served text only."""
    aux_run(target, drafter, out, capture, **KIMI_EXTRA)


def speculators_states(target: Path, layer_ids: list[int], prompt: list[int], out: Path) -> None:
    """speculators' own generator on ``target``; saves its states for
    ``prompt`` (one [len, hidden] tensor per id)."""
    import torch
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    # transformers' AutoConfig (which speculators calls) needs the published
    # checkpoint's auto_map for kimi_k25; vLLM's own KimiK25Config serves it,
    # as in tests/e2e/cpu/test_eagle3_cpu_speculators.py.
    ckpt = target.parent / f"{target.name}_autoconfig"
    if not ckpt.exists():
        shutil.copytree(target, ckpt)
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg["auto_map"] = {"AutoConfig": "configuration_kimi_k25.KimiK25Config"}
        (ckpt / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (ckpt / "configuration_kimi_k25.py").write_text(
            "from vllm.transformers_utils.configs.kimi_k25 import KimiK25Config  # noqa: F401\n")
    gen = VllmHiddenStatesGenerator(str(ckpt), layer_ids=layer_ids, max_model_len=1024,
                                    gpu_memory_utilization=h.GPU_MEMORY_UTILIZATION)
    try:
        res = gen.generate([prompt])
    finally:
        gen.executor.shutdown()
    if res[0]["input_ids"].tolist() != prompt:
        raise SystemExit("speculators served another prompt than the one given")
    torch.save({"layer_ids": list(gen.layer_ids),
                "states": [t.float().cpu() for t in res[0]["hidden_states"]]}, out)


def layer_inputs(view: Path, prompt: list[int], dtypes, margins: list | None = None) -> dict:
    """Each layer's input (and the last layer's output), per dtype, in an
    independent forward of the dequantized text model (transformers 4.57,
    vLLM's routing: fp64_reference.py). ``margins`` (a list) receives, for
    the float64 forward, each MoE layer's per-token routing margins, in
    layer order."""
    import torch

    from tools.gpu_harness import fp64_reference  # imports torch

    model = fp64_reference.load(view)
    model.config._attn_implementation = "eager"
    inputs: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(
            lambda m, a, kw, i=i: inputs.__setitem__(i, (a[0] if a else kw["hidden_states"])[0].double()),
            with_kwargs=True)
        layer.register_forward_hook(
            lambda m, a, o, i=i: inputs.__setitem__(i + 1, (o[0] if isinstance(o, tuple) else o)[0].double()))
    states = {}
    for dt in dtypes:
        inputs.clear()
        fp64_reference.TOKEN_MARGINS = margins if dt == torch.float64 else None
        try:
            with torch.no_grad():
                model.to(dt)(torch.tensor([prompt]))
        finally:
            fp64_reference.TOKEN_MARGINS = None
        states[str(dt).split(".")[-1]] = dict(inputs)
    return states


# A state is right when it is nearest the reference input of its own layer
# and its error, over all tokens and for the median token, is under this
# share of the gap between the reference inputs of layer k and of its
# neighbours.
BOUND = 0.1
# Reported, not asserted: tokens whose float64 routing margin (k-th vs
# (k+1)-th biased expert score, or group score) is below this at some MoE
# layer before k may take other experts in any bf16 forward (~1e-3 of bf16
# noise on sigmoid scores, relative precision 2^-8 and slope at most 1/4,
# times ten); the largest errors sit on them.
ROUTING_TIE = 1e-2


def reference(view: Path, aux_path: Path, out: Path, spec_path: Path | None = None) -> dict:
    import torch

    cfg = json.loads((view / "config.json").read_text())
    data = torch.load(aux_path)
    prompt, ids, aux = data["prompt"], data["layer_ids"], data["aux"]
    margins: list = []
    st = layer_inputs(view, prompt, (torch.float64, torch.bfloat16), margins)
    ref, bf16 = st["float64"], st["bfloat16"]
    dense = cfg["first_k_dense_replace"]
    if len(margins) != cfg["num_hidden_layers"] - dense:
        raise RuntimeError(f"{len(margins)} routed layers seen, {cfg['num_hidden_layers'] - dense} expected")
    margin = torch.stack(margins).double()  # [MoE layers, tokens]
    hid = cfg["hidden_size"]
    rms = lambda t: t.pow(2).mean().sqrt().item()  # noqa: E731
    med = lambda t: t.pow(2).mean(-1).sqrt().median().item()  # noqa: E731 (per-token rms)
    tok = lambda t: t.pow(2).mean(-1).sqrt()  # noqa: E731 (per-token rms)
    spec = torch.load(spec_path) if spec_path else None
    res = {"layer_ids": ids, "prompt_len": len(prompt), "routing_tie": ROUTING_TIE, "bound": BOUND,
           "per_id": []}
    ok = True
    for j, k in enumerate(ids):
        gap = min(rms(ref[k] - ref[n]) for n in (k - 1, k + 1) if n in ref)
        got = aux[:, j * hid:(j + 1) * hid].double()
        dist = {kk: rms(got - v) for kk, v in ref.items()}
        nearest = min(dist, key=dist.get)
        # Tokens whose routing is decided in every MoE layer before k.
        before = margin[: max(0, k - dense)]
        decided = before.min(0).values >= ROUTING_TIE if len(before) else torch.ones(len(prompt), dtype=torch.bool)
        err, bf16_err = tok(got - ref[k]) / gap, tok(bf16[k] - ref[k]) / gap
        row = {"id": k, "rms_gap_to_neighbouring_layers": gap, "rms_state": rms(ref[k]),
               "rms_error": dist[k], "max_abs_error": (got - ref[k]).abs().max().item(),
               "nearest_reference_layer": nearest,
               "ratio": dist[k] / gap, "median_token_ratio": med(got - ref[k]) / gap,
               "bf16_reference_ratio": rms(bf16[k] - ref[k]) / gap,
               "bf16_reference_median_token_ratio": med(bf16[k] - ref[k]) / gap,
               "tokens_with_a_routing_tie": int((~decided).sum()),
               "max_token_ratio_decided": err[decided].max().item(),
               "max_token_ratio_tied": err[~decided].max().item() if (~decided).any() else None,
               "bf16_reference_max_token_ratio_decided": bf16_err[decided].max().item(),
               "tokens_over_bound": [int(i) for i in (err >= BOUND).nonzero().flatten()],
               "tied_tokens": [int(i) for i in (~decided).nonzero().flatten()]}
        row["ok"] = nearest == k and row["ratio"] < BOUND and row["median_token_ratio"] < BOUND
        if spec is not None:
            # speculators' id k - 1 is the output of layer k - 1: vLLM's id k.
            s = spec["states"][spec["layer_ids"].index(k - 1)].double()
            row["speculators_id"] = k - 1
            same = s.shape == got.shape
            d = tok(s - got) / gap if same else None
            row["speculators_vs_engine_ratio"] = rms(s - got) / gap if same else None
            row["speculators_vs_engine_median_token_ratio"] = d.median().item() if same else None
            row["speculators_vs_engine_max_token_ratio_decided"] = d[decided].max().item() if same else None
            row["speculators_ok"] = (same and row["speculators_vs_engine_ratio"] < BOUND
                                     and row["speculators_vs_engine_median_token_ratio"] < BOUND)
            row["ok"] &= row["speculators_ok"]
        ok &= row["ok"]
        res["per_id"].append(row)
        print("REF", json.dumps(row), flush=True)
    res["speculators_checked"] = spec is not None
    res["ok"] = ok
    out.write_text(json.dumps(res, indent=1))
    return res


def _sub(args: list[str], log: Path, **env) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                       env={**os.environ, **env})
    log.write_text(r.stdout + r.stderr)
    return r


def run_all(out_dir: Path, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    p = write_models(work)
    res = {"profile": h.profile(), "prompt_lengths": PROMPT_LENGTHS, "max_tokens": MAX_TOKENS,
           "quantization_config": published_quantization_config(),
           "quantization_config_source": str(PUBLISHED_KIMI.relative_to(REPO_ROOT)),
           "target": json.loads((p["int4"] / "config.json").read_text()),
           "command": " ".join([Path(sys.executable).name, *sys.argv])}
    tt = work / "target_training.json"
    if tt.exists():
        res["target_training"] = {k: v for k, v in json.loads(tt.read_text()).items() if k != "log"}
    out_json = out_dir / "int4_kimi_k25.json"

    def fail(name, r):
        res[name] = {"ok": False, "error": (r.stdout + r.stderr)[-4000:]}
        print(f"INT4 {name} FAILED\n{res[name]['error']}", flush=True)
        out_json.write_text(json.dumps(res, indent=1))
        return res

    runs = {"plain": ["engine", str(p["int4"]), "-", str(work / "plain.json")],
            "eagle3": ["engine", str(p["int4"]), str(p["drafter"]), str(work / "eagle3.json"),
                       "--capture", str(work / "aux.pt")]}
    for name, args in runs.items():
        r = _sub(args, out_dir / f"int4_{name}.log")
        if r.returncode != 0:
            return fail(name, r)
        res[name] = json.loads(Path(args[3]).read_text())
        print(f"INT4 {name} ok; engine {json.dumps(res[name]['engine'])}; metrics "
              f"{json.dumps(res[name]['metrics'])}", flush=True)
    res["agreement"] = h.token_agreement(res["plain"]["tokens"], res["eagle3"]["tokens"])
    res["marlin"] = all(res[n]["engine"].get("moe_quant_methods") == [MARLIN] for n in runs)
    print(f"INT4 agreement {json.dumps(res['agreement'])}; Marlin MoE: {res['marlin']}", flush=True)
    prompt = h.token_prompts(PROMPT_LENGTHS, seed=0)[LONG]["prompt_token_ids"]
    (work / "prompt.json").write_text(json.dumps(prompt))
    r = _sub(["speculators", str(p["int4"]), ",".join(str(k - 1) for k in AUX_IDS), str(work / "prompt.json"),
              str(work / "spec.pt")], out_dir / "int4_speculators.log")
    if r.returncode != 0:
        fail("speculators", r)
    spec = work / "spec.pt" if r.returncode == 0 else None
    # The reference runs on the CPU in float64, in its own process.
    args = ["reference", str(p["view"]), str(work / "aux.pt"), str(work / "ref.json")]
    r = _sub(args + (["--speculators", str(spec)] if spec else []), out_dir / "int4_reference.log",
             CUDA_VISIBLE_DEVICES="")
    res["reference"] = (json.loads((work / "ref.json").read_text()) if r.returncode == 0
                        else {"ok": False, "error": (r.stdout + r.stderr)[-3000:]})
    res["ok"] = bool(res["marlin"] and res["reference"].get("ok") and spec is not None
                     and res["reference"].get("speculators_checked"))
    print(f"INT4 reference ok={res['reference'].get('ok')}; all ok={res['ok']}", flush=True)
    out_json.write_text(json.dumps(res, indent=1))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("all")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--work", type=Path, default=Path("/tmp/int4_kimi_k25"))
    e = sub.add_parser("engine")
    e.add_argument("target")
    e.add_argument("drafter")
    e.add_argument("out", type=Path)
    e.add_argument("--capture", type=Path)
    s = sub.add_parser("speculators")
    s.add_argument("target", type=Path)
    s.add_argument("layer_ids")
    s.add_argument("prompt", type=Path)
    s.add_argument("out", type=Path)
    r = sub.add_parser("reference")
    r.add_argument("view", type=Path)
    r.add_argument("aux", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--speculators", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "all":
        os.environ.setdefault("EAGLE3_GPU_PROFILE", "production")
        args.out.mkdir(parents=True, exist_ok=True)
        return 0 if run_all(args.out, args.work).get("ok") else 1
    if args.cmd == "engine":
        engine(args.target, None if args.drafter == "-" else args.drafter, args.out, args.capture)
        return 0
    if args.cmd == "speculators":
        h.configure_env()
        speculators_states(args.target, [int(x) for x in args.layer_ids.split(",")],
                           json.loads(args.prompt.read_text()), args.out)
        return 0
    reference(args.view, args.aux, args.out, args.speculators)  # the verdict is in OUT's "ok"
    return 0


if __name__ == "__main__":
    sys.exit(main())
