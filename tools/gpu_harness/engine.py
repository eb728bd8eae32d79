# SPDX-License-Identifier: Apache-2.0
"""Engines, shared by the GPU harness jobs: vLLM's LLM with the active
profile's settings (gpu_e2e_helpers.py), greedy generation timed with the
spec-decode counters, the aux states an EAGLE proposer receives, and one
engine run for the aux-state checks (dsa_check.py, int4_check.py)."""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Imported by its package name (tools.gpu_harness...) from the job scripts, and
# by the GPU tests: the repository root goes last on sys.path, so that the
# installed vllm stays first.
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e" / "gpu"))

import gpu_e2e_helpers as h  # noqa: E402
from tools.gpu_harness.data import K  # noqa: E402

GEN_TOKENS = 128  # tokens per prompt; bench_eagle3.py --gen-tokens sets it
BENCH_BATCHES = (1, 8)
PROD_BATCHES = (1, 8, 32)
# The aux-state checks: the prompts, the long one whose states are checked,
# and the tokens served.
PROMPT_LENGTHS = [5, 40, 256]
LONG = 2
MAX_TOKENS = 32


def command_line() -> str:
    """This process's command, as the results JSON records it."""
    return " ".join([Path(sys.executable).name, *sys.argv])


def make_llm(model, drafter=None, **extra):
    from vllm import LLM

    if json.loads((Path(model) / "config.json").read_text()).get("model_type") == "kimi_k25":
        # Text only, as test_eagle3_e2e.py serves Kimi-K2.5: no vision_chunk items.
        extra.setdefault("limit_mm_per_prompt", {"vision_chunk": 0})
    return LLM(**h.engine_kwargs(model, drafter, num_spec_tokens=K, max_num_seqs=64, **extra))


def timed(llm, prompts, batch):
    """Greedy-generate GEN_TOKENS per prompt, `batch` prompts per generate()."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True)
    before = h.spec_counters(llm)
    outs, tokens, elapsed = [], 0, 0.0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        t0 = time.perf_counter()
        res = llm.generate(chunk, sp, use_tqdm=False)
        elapsed += time.perf_counter() - t0
        for r in res:
            outs.append(list(r.outputs[0].token_ids))
            tokens += len(r.outputs[0].token_ids)
    delta = h.counters_delta(before, h.spec_counters(llm))
    return outs, {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, **delta}


def bench_engine(model, drafter, eval_prompts, train_prompts=None, batches=BENCH_BATCHES):
    t0 = time.perf_counter()
    llm = make_llm(model, drafter)
    start_s = time.perf_counter() - t0
    try:
        timed(llm, eval_prompts[:2], 2)  # warm-up: Triton JIT, allocator
        res, outs = {"engine_start_s": start_s, "profile": h.profile(), "engine": h.engine_facts(llm)}, {}
        for b in batches:
            outs[b], res[f"batch{b}"] = timed(llm, eval_prompts[: max(4, b)], b)
        train = None
        if train_prompts is not None:
            train, _ = timed(llm, train_prompts, 64)
        return res, outs, train
    finally:
        h.shutdown(llm)


def record_prefill_aux(llm, seqs) -> tuple[list, list[int]]:
    """Wrap the EAGLE proposer of an in-process engine so that it records,
    for each of ``seqs`` (token id lists) served as a prompt, the aux states
    of its prefill as the proposer receives them. Returns the list it fills
    (one entry per sequence, None until seen) and the drafter's layer ids."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    proposer = runner.drafter
    orig = proposer.propose
    sig = inspect.signature(orig)
    index = {tuple(s): i for i, s in enumerate(seqs)}
    aux = [None] * len(seqs)

    def recording_propose(*args, **kwargs):
        ba = sig.bind(*args, **kwargs)
        tok = ba.arguments["target_token_ids"].cpu()
        hid = ba.arguments["target_hidden_states"]
        cam = ba.arguments["common_attn_metadata"]
        qsl = cam.query_start_loc_cpu[: cam.num_reqs + 1].tolist()
        for r in range(cam.num_reqs):
            i = index.get(tuple(tok[qsl[r]:qsl[r + 1]].tolist()))
            if i is not None and aux[i] is None:
                aux[i] = hid[qsl[r]:qsl[r + 1]].float().cpu().clone()
        return orig(*args, **kwargs)

    proposer.propose = recording_propose
    return aux, list(proposer.model.config.eagle_aux_hidden_state_layer_ids)


def aux_run(target: str, drafter: str | None, out: Path, capture: Path | None, **extra) -> None:
    """One engine in this process (``extra``: more LLM arguments): greedy
    tokens, counters, the engine's facts (engine_facts), and (capture) the
    aux states of the long prompt's prefill as the proposer receives them."""
    if capture is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    h.configure_env()
    import torch
    from vllm import LLM

    prompts = h.token_prompts(PROMPT_LENGTHS, seed=0)
    t0 = time.perf_counter()
    engine = LLM(**h.engine_kwargs(target, drafter, **extra))
    rec = {"engine_start_s": time.perf_counter() - t0, "profile": h.profile(), "engine": h.engine_facts(engine)}
    if capture is not None:
        got, rec["aux_layer_ids"] = record_prefill_aux(engine, [prompts[LONG]["prompt_token_ids"]])
    toks, metrics = h.generate_tokens(engine, prompts, MAX_TOKENS)
    rec.update(tokens=toks, metrics=metrics)
    if capture is not None:
        if got[0] is None:
            raise SystemExit("the long prompt's prefill never reached the proposer")
        torch.save({"aux": got[0], "layer_ids": rec["aux_layer_ids"],
                    "prompt": prompts[LONG]["prompt_token_ids"]}, capture)
        rec["captured_shape"] = list(got[0].shape)
    out.write_text(json.dumps(rec))
    h.shutdown(engine)


def agreement(outs, plain_outs):
    keys = sorted(set(outs) & set(plain_outs))
    a = [t for b in keys for t in outs[b]]
    p = [t for b in keys for t in plain_outs[b]]
    return h.token_agreement(p, a)


def summary(m):
    return {k: m.get(k) for k in ("tokens_per_s", "mean_acceptance_length", "accepted_per_position",
                                  "num_drafts", "num_draft_tokens", "num_accepted_tokens")}
