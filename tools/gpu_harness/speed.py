#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The speed bench: plain and EAGLE-3 decode tok/s of a trained pair.

    python tools/gpu_harness/speed.py --artifacts A --out DIR [--repeats 5] [--batches 1,8,32]

A is the pair bench_eagle3.py all trained (its --work directory, or its
artifacts.tar.gz unpacked). Both engines are up side by side on one GPU and
measured in turn (plain, EAGLE-3, plain, ...) so that machine noise hits
both; prefill is timed apart. Writes DIR/speed.json: per batch the median and
range over the repeats of decode tok/s, speed-up, acceptance and efficiency
(speed-up / mean acceptance length).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Run as a script: the repository root goes last on sys.path (so
# `tools.gpu_harness` resolves and the installed vllm stays first).
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e" / "gpu"))

import gpu_e2e_helpers as h  # noqa: E402
from tools.gpu_harness import engine  # noqa: E402
from tools.gpu_harness.data import K, rule_prompts  # noqa: E402


def spread(values: list[float]) -> dict:
    """Median and range of repeated measurements (the median, not the mean:
    one slow repeat on a shared machine must not move the figure)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _decode_rate(llm, prompts, gen_tokens):
    """Prefill timed apart: one generate() of 1 token (prefill and the first
    token), one of gen_tokens; decode tok/s counts the tokens after the first."""
    from vllm import SamplingParams

    def run(n):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0

    prefill_s = run(1)
    before = h.spec_counters(llm)
    total_s = run(gen_tokens)
    delta = h.counters_delta(before, h.spec_counters(llm))
    decode_s = total_s - prefill_s
    return {"prefill_s": prefill_s, "decode_s": decode_s,
            "decode_tok_s": len(prompts) * (gen_tokens - 1) / decode_s, **delta}


def speed(out_dir: Path, artifacts: Path, repeats: int, batches, gen_tokens: int) -> dict:
    """Plain and EAGLE-3 (the trained drafter, k = K) engines side by side on
    one GPU, measured in turn (plain, EAGLE-3, plain, ...) so that machine
    noise hits both; per batch the median and range over the repeats of
    decode tok/s, speed-up, acceptance and efficiency (speed-up / mean
    acceptance length)."""
    h.configure_env()
    # A fixed KV cache: vLLM's memory profile would count the other engine.
    os.environ.setdefault("EAGLE3_GPU_KV_BYTES", str(2 << 30))
    target, trained = artifacts / "deepseek_v3", artifacts / "drafter_trained"
    prompts = rule_prompts(max(batches), seed=1000)
    engines = {"plain": engine.make_llm(target), "eagle3": engine.make_llm(target, trained)}
    res = {"k": K, "gen_tokens": gen_tokens, "repeats": repeats, "profile": h.profile(),
           "command": engine.command_line(),
           "engine": {n: h.engine_facts(e) for n, e in engines.items()}, "batches": {}}
    try:
        for e in engines.values():
            _decode_rate(e, prompts[:2], 8)  # warm-up: Triton JIT, allocator
        runs = {b: {"plain": [], "eagle3": []} for b in batches}
        for _ in range(repeats):
            for b in batches:
                for name, e in engines.items():
                    runs[b][name].append(_decode_rate(e, prompts[:b], gen_tokens))
        for b, r in runs.items():
            ratios = [e["decode_tok_s"] / p["decode_tok_s"] for p, e in zip(r["plain"], r["eagle3"])]
            mal = [e["mean_acceptance_length"] for e in r["eagle3"]]
            if None in mal:
                raise RuntimeError(f"batch {b}: an EAGLE-3 run proposed no draft: {r['eagle3']}")
            res["batches"][f"batch{b}"] = {
                "plain_decode_tok_s": spread([x["decode_tok_s"] for x in r["plain"]]),
                "eagle3_decode_tok_s": spread([x["decode_tok_s"] for x in r["eagle3"]]),
                "prefill_s": {n: spread([x["prefill_s"] for x in r[n]]) for n in r},
                "speedup": spread(ratios),
                "mean_acceptance_length": spread(mal),
                "efficiency": spread([s / m for s, m in zip(ratios, mal)]),
                "accepted_per_position": [sum(x) for x in zip(*(e["accepted_per_position"] for e in r["eagle3"]))],
                "num_drafts": sum(e["num_drafts"] for e in r["eagle3"]),
                "runs": r,
            }
            print("SPEED", b, json.dumps({k: v for k, v in res["batches"][f"batch{b}"].items() if k != "runs"}),
                  flush=True)
    finally:
        for e in engines.values():
            h.shutdown(e)
    (out_dir / "speed.json").write_text(json.dumps(res, indent=1))
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--artifacts", type=Path, required=True, help="the trained pair of bench_eagle3.py all")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=lambda t: tuple(int(x) for x in t.split(",")), default=engine.PROD_BATCHES)
    ap.add_argument("--gen-tokens", type=int, default=engine.GEN_TOKENS)
    ap.add_argument("--profile", choices=h.PROFILES, default="production")
    args = ap.parse_args(argv)
    os.environ["EAGLE3_GPU_PROFILE"] = args.profile
    args.out.mkdir(parents=True, exist_ok=True)
    speed(args.out, args.artifacts, args.repeats, args.batches, args.gen_tokens)


if __name__ == "__main__":
    main()
