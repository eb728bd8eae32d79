#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Train and serve the EAGLE-3 pair: a tiny target, a drafter trained on its aux states.

    python tools/gpu_harness/bench_eagle3.py all --out DIR [--profile production] [--speed]
    python tools/gpu_harness/bench_eagle3.py control --artifacts A --ids 0,1,2 --out DIR
    python tools/gpu_harness/bench_eagle3.py cache --artifacts A --out DIR [--tag T]

A random target's next token cannot be predicted, so the target is first
trained on a language with a skip rule, t[i+1] = f(t[i-1]): the token the
drafter needs is not its own input, so it must come from the target's aux
states. Then: plain serving (the drafter's training data), the aux states
captured from the EAGLE proposer of a real engine, a drafter trained on them
(k = 3, training-time-test unrolling), and serving it: acceptance, tok/s,
greedy equality with plain, as controls the aux ids shifted by one and the
target's first layers only, and, in production, the same run eager.
``control``: the trained drafter served with other aux ids. ``cache``: two
drafters in turn, one VLLM_CACHE_ROOT. ``all --speed`` then runs speed.py and
step_profile.py on the pair. docs/gpu.md describes each step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Run as a script, or imported by its bare name from the GPU tests: the
# repository root goes last on sys.path (so `tools.gpu_harness` resolves and
# the installed vllm stays first).
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e" / "gpu"))

import gpu_e2e_helpers as h  # noqa: E402
from tools.gpu_harness import engine  # noqa: E402
from tools.gpu_harness.data import K, published_quantization_config, rule_prompts, with_aux_ids  # noqa: E402
from tools.gpu_harness.training import predicted_acceptance_length, train, train_target_apart  # noqa: E402

N_TRAIN = 512
SHIFTED_AUX_IDS = (0, 2, 5)  # the trained drafter's (1, 3, 6), each one layer earlier
# The target's first layers only: none of the states the drafter was trained
# on past layer 2. On the 6-layer target the inputs of layers 5 and 6 carry
# nearly the same information, so a 128-wide drafter loses little to the
# shift by one (3.93 of 4.00 on the H200); fed these it falls to about 2
# (2.04 in the CPU replay of that pair,
# results/2026-12-02_cpu_replay_acceptance_controls.json).
EARLY_AUX_IDS = (0, 1, 2)
DSA_KINDS = {"glm5": 32, "deepseek-v32": 64}  # index heads of the published configs
# Kimi-K2.5 with its routed experts in W4A16 (Marlin MoE), quantized after
# training with the published quantization_config (data.py).
INT4_KIND = "kimi-k25-int4"


def capture(target, drafter, seqs_path, out_path):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    h.configure_env()
    import torch
    from vllm import SamplingParams

    seqs = json.loads(Path(seqs_path).read_text())
    llm = engine.make_llm(target, drafter, max_num_batched_tokens=16384)
    print(f"capture engine: profile {h.profile()}", flush=True)
    aux, layer_ids = engine.record_prefill_aux(llm, seqs)
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i in range(0, len(seqs), 32):
        llm.generate([{"prompt_token_ids": s} for s in seqs[i:i + 32]], sp, use_tqdm=False)
    missing = [i for i, a in enumerate(aux) if a is None]
    torch.save({"aux": aux, "missing": missing, "layer_ids": layer_ids}, out_path)
    print(f"captured aux states for {len(seqs) - len(missing)}/{len(seqs)} sequences, "
          f"width {aux[0].shape[-1] if aux[0] is not None else None}, layer ids {layer_ids}")


def run_all(out_dir: Path, work: Path, steps: int, target_steps: int, random_drafter: bool = True,
            kind: str = "deepseek-v3", batches=None, early_control: bool = True):
    """The whole benchmark in the active profile (EAGLE3_GPU_PROFILE). Every
    stage is recorded in DIR/bench_eagle3.json as soon as it ends; a failing
    stage is recorded with its error and the stages that need it are skipped.
    ``early_control`` serves the drafter fed EARLY_AUX_IDS too (one more
    engine start)."""
    import traceback

    h.configure_env()
    work.mkdir(parents=True, exist_ok=True)
    tiny = h._tiny()
    prof = h.profile()
    ckw = h.checkpoint_kwargs()
    dkw = {"dtype": ckw["dtype"]} if ckw else {}
    target = work / kind.replace("-", "_")
    # What the target training trains (a DeepSeek-V3 checkpoint): the target
    # itself, or for Kimi-K2.5 INT4 the text model of its bf16 original, which
    # is quantized after training, as a release is.
    train_dir = target
    rnd = work / "drafter_random"
    trained = work / "drafter_trained"
    if kind in DSA_KINDS:
        # The published index geometry; index_topk 128 (the smallest that
        # FLASHMLA_SPARSE takes) is at least every sequence here with
        # --gen-tokens 96 or less, so the dense-trained target serves as
        # trained (dsa_check.py covers top-k below the length).
        ckw = {**ckw, "index_head_dim": 128, "index_topk": 128, "index_n_heads": DSA_KINDS[kind]}
    if kind == INT4_KIND:
        bf16 = work / "kimi_k25_bf16"
        tiny.write_checkpoint("kimi-k25", bf16, seed=0, **ckw)
        train_dir = tiny.kimi_text_view(bf16, work / "kimi_k25_text")
    else:
        tiny.write_checkpoint(kind, target, seed=0, **ckw)
    tiny.write_checkpoint("eagle3-drafter", rnd, seed=2, draft_vocab_size=tiny.VOCAB_SIZE,
                          **h.drafter_shape(), **dkw)
    batches = batches or (engine.PROD_BATCHES if prof != "smoke" else engine.BENCH_BATCHES)
    results = {"k": K, "gen_tokens": engine.GEN_TOKENS, "profile": prof, "batches": list(batches), "kind": kind,
               "target": json.loads(((target if kind != INT4_KIND else bf16) / "config.json").read_text()),
               "command": engine.command_line()}
    out_json = out_dir / "bench_eagle3.json"

    def save():
        out_json.write_text(json.dumps(results, indent=1))

    def stage(name, fn):
        t0 = time.perf_counter()
        try:
            val = fn()
            shown = val[0] if isinstance(val, tuple) else val
            if isinstance(shown, dict):
                shown = {k: (engine.summary(v) if isinstance(v, dict) and "tokens_per_s" in v else v)
                         for k, v in shown.items() if k != "log"}
            print(f"RESULT {name} ({time.perf_counter() - t0:.0f} s)", json.dumps(shown), flush=True)
            return val
        except BaseException as e:  # noqa: BLE001 - recorded; later stages decide
            results.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-4000:]}"
            print(f"RESULT {name} FAILED: {type(e).__name__}: {e}", flush=True)
            return None
        finally:
            save()

    results["target_training"] = stage("target_training", lambda: train_target_apart(train_dir, target_steps, work))
    if results["target_training"] is None:
        return
    if kind == INT4_KIND:
        q = published_quantization_config()
        tiny.write_kimi_k25_int4(bf16, target, q, text_weights=train_dir)
        results["target"] = json.loads((target / "config.json").read_text())
        results["quantization_config_source"] = "published Kimi-K2.5 config.json (tools/gpu_harness/data.py PUBLISHED_KIMI)"

    eval_prompts = rule_prompts(max(8, max(batches)), seed=1000)
    train_prompts = rule_prompts(N_TRAIN, seed=1)

    got = stage("plain", lambda: engine.bench_engine(target, None, eval_prompts, train_prompts, batches))
    if got is None:
        return
    results["plain"], plain_outs, train_outs = got[0], got[1], got[2]
    save()
    seqs = [p["prompt_token_ids"] + o for p, o in zip(train_prompts, train_outs)]
    prompt_lens = [len(p["prompt_token_ids"]) for p in train_prompts]
    (work / "seqs.json").write_text(json.dumps(seqs))

    if random_drafter:
        got = stage("eagle3_random", lambda: engine.bench_engine(target, rnd, eval_prompts, batches=batches))
        if got is not None:
            results["eagle3_random"] = got[0]
            results["eagle3_random"]["agreement_with_plain"] = engine.agreement(got[1], plain_outs)
            results["eagle3_random"]["equal_to_plain"] = got[1] == plain_outs

    def cap():
        r = subprocess.run(
            [sys.executable, __file__, "capture", "--target", str(target), "--drafter", str(rnd),
             "--seqs", str(work / "seqs.json"), "--out", str(work / "aux.pt")],
            capture_output=True, text=True)
        (work / "capture.log").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            raise RuntimeError(f"capture failed:\n{(r.stdout + r.stderr)[-6000:]}")
        return r.stdout.strip().splitlines()[-1]

    results["capture"] = stage("capture", cap)
    if results["capture"] is None:
        return
    tr = stage("training", lambda: train(target, rnd, seqs, prompt_lens, work / "aux.pt", trained, steps))
    if tr is None:
        return
    tr["predicted_acceptance_length"] = predicted_acceptance_length(tr["kept_val_acc"])
    results["training"] = tr
    shifted = with_aux_ids(trained, work / "drafter_shifted", SHIFTED_AUX_IDS)
    early = with_aux_ids(trained, work / "drafter_early", EARLY_AUX_IDS) if early_control else None
    # The weights, for later calls (compile cache, server): a few MB.
    import tarfile
    with tarfile.open(out_dir / "artifacts.tar.gz", "w:gz") as tf:
        for d in (target, trained, shifted):
            tf.add(d, arcname=d.name)
    save()

    got = stage("eagle3_trained", lambda: engine.bench_engine(target, trained, eval_prompts, batches=batches))
    if got is not None:
        results["eagle3_trained"] = got[0]
        results["eagle3_trained"]["agreement_with_plain"] = engine.agreement(got[1], plain_outs)
        results["eagle3_trained"]["equal_to_plain"] = got[1] == plain_outs
        for b in batches:
            m, pm = got[0][f"batch{b}"], results["plain"][f"batch{b}"]
            sp = m["tokens_per_s"] / pm["tokens_per_s"]
            mal = m.get("mean_acceptance_length")
            results.setdefault("speedup", {})[f"batch{b}"] = {
                "plain_tok_s": pm["tokens_per_s"], "eagle3_tok_s": m["tokens_per_s"],
                "speedup": sp, "mean_acceptance_length": mal,
                "efficiency": sp / mal if mal else None}
    save()

    got = stage("eagle3_shifted_aux_ids", lambda: engine.bench_engine(target, shifted, eval_prompts, batches=(8,)))
    if got is not None:
        results["eagle3_shifted_aux_ids"] = {"aux_layer_ids": list(SHIFTED_AUX_IDS), **got[0]}
    if early_control:
        got = stage("eagle3_early_aux_ids", lambda: engine.bench_engine(target, early, eval_prompts, batches=(8,)))
        if got is not None:
            results["eagle3_early_aux_ids"] = {"aux_layer_ids": list(EARLY_AUX_IDS), **got[0]}

    if prof == "production":
        os.environ["EAGLE3_GPU_PROFILE"] = "eager"
        try:
            got = stage("eagle3_trained_eager", lambda: engine.bench_engine(target, trained, eval_prompts, batches=(1, 8)))
            if got is not None:
                results["eagle3_trained_eager"] = got[0]
        finally:
            os.environ["EAGLE3_GPU_PROFILE"] = prof
    save()
    _print_table(results, batches)


def _print_table(results, batches):
    rows = []
    for name in ("plain", "eagle3_random", "eagle3_trained", "eagle3_shifted_aux_ids", "eagle3_early_aux_ids",
                 "eagle3_trained_eager"):
        r = results.get(name)
        if not r:
            continue
        for b in batches:
            m = r.get(f"batch{b}")
            if not m:
                continue
            mal = m.get("mean_acceptance_length")
            rows.append(f"{name:24s} batch {b:2d}: {m['tokens_per_s']:8.1f} tok/s"
                        + (f"  mean acceptance length {mal:.2f} (accepted {m['num_accepted_tokens']}/"
                           f"{m['num_draft_tokens']}, per position {m['accepted_per_position']})" if mal else ""))
    print("\n".join(rows))
    if "speedup" in results:
        print("SPEEDUP", json.dumps(results["speedup"]))
    if "training" in results:
        print(f"predicted acceptance length {results['training']['predicted_acceptance_length']:.2f}; "
              f"target rule accuracy {results['target_training']['final_rule_accuracy']:.3f}")


def cache_check(out_dir: Path, artifacts: Path, tag: str) -> None:
    """Two drafters served in turn against one target with one compile-cache
    directory (VLLM_CACHE_ROOT): the trained drafter (aux ids 1, 3, 6), then
    the same weights with aux ids (0, 2, 5). Each gets the acceptance it gets
    alone only if each gets its own compiled graphs; a reused target graph
    hands the second drafter the first one's layers (and acceptance)."""
    import tempfile

    h.configure_env()
    target, trained = artifacts / "deepseek_v3", artifacts / "drafter_trained"
    shifted = with_aux_ids(trained, Path(tempfile.mkdtemp()) / "drafter_shifted", SHIFTED_AUX_IDS)
    eval_prompts = rule_prompts(8, seed=1000)
    root = Path(tempfile.mkdtemp(prefix=f"vllm-cache-{tag}-"))
    os.environ["VLLM_CACHE_ROOT"] = str(root)
    res = {"tag": tag, "cache_root": str(root), "profile": h.profile()}
    for name, d in (("first_trained_1_3_6", trained), ("second_shifted_0_2_5", shifted)):
        t0 = time.perf_counter()
        try:
            r, _, _ = engine.bench_engine(target, d, eval_prompts, batches=(8,))
            res[name] = {"engine_start_s": r["engine_start_s"], **engine.summary(r["batch8"])}
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        res[name]["seconds"] = time.perf_counter() - t0
        print("CACHE", tag, name, json.dumps(res[name]), flush=True)
    res["cache_dirs"] = sorted(str(p.relative_to(root)) for p in root.glob("torch_compile_cache/*/rank_0_0/*"))
    res["aot_dirs"] = sorted(str(p.relative_to(root)) for p in root.glob("torch_aot_compile/*"))
    print("CACHE", tag, "dirs", json.dumps({"compile": res["cache_dirs"], "aot": res["aot_dirs"]}), flush=True)
    (out_dir / f"cache_{tag}.json").write_text(json.dumps(res, indent=1))


def control(out_dir: Path, artifacts: Path, ids: list[int]) -> None:
    """The trained drafter served with other aux layer ids (same weights), batch 8."""
    import tempfile

    h.configure_env()
    target, trained = artifacts / "deepseek_v3", artifacts / "drafter_trained"
    name = "_".join(str(i) for i in ids)
    d = with_aux_ids(trained, Path(tempfile.mkdtemp()) / f"drafter_ids_{name}", ids)
    r, _, _ = engine.bench_engine(target, d, rule_prompts(max(engine.PROD_BATCHES), seed=1000), batches=(8,))
    res = {"aux_layer_ids": ids, "profile": h.profile(), "engine_start_s": r["engine_start_s"],
           **engine.summary(r["batch8"])}
    print("CONTROL", json.dumps(res), flush=True)
    (out_dir / f"control_{name}.json").write_text(json.dumps(res, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("all")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--work", type=Path, default=Path("/tmp/eagle3_bench_work"))
    a.add_argument("--steps", type=int, default=1500, help="drafter training steps")
    a.add_argument("--target-steps", type=int, default=400, help="target training steps")
    a.add_argument("--profile", choices=h.PROFILES, default=None,
                   help="engine settings (gpu_e2e_helpers.py); default: $EAGLE3_GPU_PROFILE or smoke")
    a.add_argument("--no-random-drafter", action="store_true", help="skip the random-drafter run")
    a.add_argument("--kind", choices=("deepseek-v3", *DSA_KINDS, INT4_KIND), default="deepseek-v3",
                   help="target")
    a.add_argument("--gen-tokens", type=int, default=engine.GEN_TOKENS, help="tokens generated per prompt")
    a.add_argument("--batches", type=lambda t: tuple(int(x) for x in t.split(",")), default=None,
                   help="batch sizes to measure, e.g. 1,8 (default: the profile's)")
    a.add_argument("--speed", action="store_true",
                   help="then the speed and profile runs on the pair just trained (DeepSeek-V3 target only)")
    c = sub.add_parser("capture")
    for n in ("--target", "--drafter", "--seqs", "--out"):
        c.add_argument(n, required=True)
    k = sub.add_parser("cache")
    k.add_argument("--out", type=Path, required=True)
    k.add_argument("--artifacts", type=Path, required=True, help="unpacked artifacts.tar.gz of a bench run")
    k.add_argument("--tag", default="patched")
    k.add_argument("--profile", choices=h.PROFILES, default="production")
    o = sub.add_parser("control")
    o.add_argument("--out", type=Path, required=True)
    o.add_argument("--artifacts", type=Path, required=True)
    o.add_argument("--ids", required=True, help="aux layer ids, e.g. 0,1,2")
    o.add_argument("--profile", choices=h.PROFILES, default="production")
    args = ap.parse_args(argv)
    if getattr(args, "profile", None):
        os.environ["EAGLE3_GPU_PROFILE"] = args.profile
    if args.cmd == "all":
        args.out.mkdir(parents=True, exist_ok=True)
        engine.GEN_TOKENS = args.gen_tokens
        if args.speed and args.kind != "deepseek-v3":
            ap.error("--speed measures the DeepSeek-V3 target only")
        if args.speed and h.profile() != "production":
            ap.error(f"--speed measures production settings, not the {h.profile()} profile: "
                     "add --profile production")
        run_all(args.out, args.work, args.steps, args.target_steps,
                random_drafter=not args.no_random_drafter, kind=args.kind, batches=args.batches)
        if args.speed:  # one command for the whole measurement on a GPU machine
            if not (args.work / "drafter_trained").is_dir():
                ap.error(f"--speed: no trained drafter in {args.work}; see {args.out}/bench_eagle3.json")
            # The two timing jobs, each in a process of its own, as the device stages run them.
            here = Path(__file__).resolve().parent
            subprocess.run([sys.executable, str(here / "speed.py"), "--artifacts", str(args.work),
                            "--out", str(args.out), "--gen-tokens", str(args.gen_tokens)], check=True)
            subprocess.run([sys.executable, str(here / "step_profile.py"), "--artifacts", str(args.work),
                            "--out", str(args.out / "profile")], check=True)
    elif args.cmd == "control":
        args.out.mkdir(parents=True, exist_ok=True)
        control(args.out, args.artifacts, [int(x) for x in args.ids.split(",")])
    elif args.cmd == "cache":
        args.out.mkdir(parents=True, exist_ok=True)
        cache_check(args.out, args.artifacts, args.tag)
    else:
        capture(args.target, args.drafter, args.seqs, args.out)


if __name__ == "__main__":
    main()
