# SPDX-License-Identifier: Apache-2.0
"""EAGLE-3 aux hidden states with prefix caching and chunked prefill on, from
the real vLLM v0.16.0 CPU engine, against transformers' layer inputs.

A prompt whose first blocks are already cached is computed from the first
uncached token on: the engine hands the drafter aux states for those tokens
only, and they must be the target's layer inputs at those positions, with
the cached prefix as context (a wrong block table, a position offset or a
capture that assumes the prompt starts at 0 would all show here). Prompts
longer than the step budget are chunked, cached or not.

One engine (prefix caching on, block size 32, 16 tokens a step) serves
prompt A alone, then B (A's first 64 tokens + its own) and C (unrelated)
together. Checked: the engine's own counters saw the hit; B's recorded rows
start at token 64; every recorded row of every request equals HF's input of
its layer (ids 0..6) at its position; the same rows compared with the layer
above or below (a capture shifted by one layer) are off by far more than the
tolerance, so this test fails for such a capture.
"""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.e2e

BLOCK = 32  # the CPU backend wants multiples of 32
STEP_TOKEN_BUDGET = 16
MAX_TOKENS = 6
SHARED = 64  # two full blocks of A that B reuses
ATOL = 2e-4  # as test_eagle3_cpu_targets.py: float32, other summation order
SHIFT_MARGIN = 100  # a shifted capture is off by at least this many ATOLs


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(3)
    a = [rng.randrange(256) for _ in range(80)]
    return {"A": a, "B": a[:SHARED] + [rng.randrange(256) for _ in range(21)],
            "C": [rng.randrange(256) for _ in range(37)]}


def _rows(steps: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per engine request: the tokens it computed, in order, and the aux rows."""
    rows: dict[str, dict[str, Any]] = {}
    for step in steps:
        start = 0
        for req_id, count in zip(step["req_ids"], step["num_scheduled"]):
            r = rows.setdefault(req_id, {"ids": [], "aux": [], "chunks": []})
            r["ids"].append(step["input_ids"][start:start + count])
            r["aux"].append([a[start:start + count] for a in step["aux"]])
            r["chunks"].append(count)
            start += count
    return {k: {"ids": torch.cat(v["ids"]).tolist(), "aux": [torch.cat(a) for a in zip(*v["aux"])],
                "chunks": v["chunks"]} for k, v in rows.items()}


@pytest.fixture(scope="module")
def run(harness: ModuleType, tiny_ckpts: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.v1.metrics.reader import Counter

    kwargs = harness.engine_kwargs(
        tiny_ckpts["dsv3"], draft=tiny_ckpts["draft_all_ids"], max_model_len=512,
        max_num_batched_tokens=STEP_TOKEN_BUDGET, enable_prefix_caching=True, block_size=BLOCK,
        disable_log_stats=False,
    )
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def hits(llm) -> dict[str, int]:
        return {m.name: m.value for m in llm.get_metrics()
                if isinstance(m, Counter) and m.name.startswith("vllm:prefix_cache_")}

    with harness.running_engine(**kwargs) as llm:
        outs = {"A": llm.generate([{"prompt_token_ids": prompts["A"]}], params, use_tqdm=False)[0]}
        before = hits(llm)
        for name, o in zip("BC", llm.generate([{"prompt_token_ids": prompts[n]} for n in "BC"], params,
                                              use_tqdm=False)):
            outs[name] = o
        after = hits(llm)
        report = llm.collective_rpc("eagle3_e2e_report")[0]
    return {"prompts": prompts, "outputs": {k: list(o.outputs[0].token_ids) for k, o in outs.items()},
            "report": report, "rows": _rows(report["steps"]),
            "hits": {k: after[k] - before.get(k, 0) for k in after}}


def _match(run: dict[str, Any]) -> dict[str, tuple[list[int], int, dict[str, Any]]]:
    """Each prompt's fed tokens, where its computed rows start, and its rows:
    the one engine request whose computed tokens end its fed tokens."""
    out = {}
    for name, prompt in run["prompts"].items():
        fed = prompt + run["outputs"][name][:-1]  # the last sampled token is never fed
        found = [r for r in run["rows"].values()
                 if MAX_TOKENS < len(r["ids"]) <= len(fed) and fed[len(fed) - len(r["ids"]):] == r["ids"]]
        assert len(found) == 1, f"{name}: {len(found)} engine requests match"
        out[name] = (fed, len(fed) - len(found[0]["ids"]), found[0])
    return out


def _errors(ref_by_id: dict[int, torch.Tensor], start: int, aux: list[torch.Tensor],
            ids: tuple[int, ...], shift: int) -> dict[int, float]:
    """Per id k: max |row - HF input of layer k + shift| over the computed tokens."""
    out = {}
    for k, got in zip(ids, aux):
        if 0 <= k + shift < len(ref_by_id):
            want = ref_by_id[k + shift][start:]
            assert got.shape == want.shape
            out[k] = (got - want).abs().max().item()
    return out


def test_prefix_hit_is_read_from_the_engine(run: dict[str, Any]) -> None:
    m = _match(run)
    # The engine's counters: B's shared blocks hit (tokens).
    assert run["hits"]["vllm:prefix_cache_hits"] >= SHARED, run["hits"]
    # B was computed from its first uncached token; A and C from 0.
    assert m["B"][1] == SHARED, m["B"][1]
    assert m["A"][1] == 0 and m["C"][1] == 0
    # Chunked: A's prompt and B's uncached part each span several steps.
    for name in "AB":
        prompt_rows = len(run["prompts"][name]) - m[name][1]
        assert prompt_rows > STEP_TOKEN_BUDGET
        assert max(m[name][2]["chunks"]) <= STEP_TOKEN_BUDGET


def test_aux_states_match_hf_and_a_shifted_capture_fails(
    harness: ModuleType, tiny_ckpts: dict[str, Any], run: dict[str, Any], record_property: Any,
) -> None:
    n = tiny_ckpts["dsv3_layers"]
    ids = tuple(range(n + 1))
    assert run["report"]["setup"].aux_layers == ids
    hf = harness.load_hf_reference(tiny_ckpts["dsv3"])
    errs: dict[str, dict[str, float]] = {}
    for name, (fed, start, row) in _match(run).items():
        ref = harness.hf_states(hf, fed)
        # Greedy tokens are HF's (the same model), near-ties skipped.
        checked, mismatches = harness.greedy_vs_hf(ref.logits[len(run["prompts"][name]) - 1:],
                                                   run["outputs"][name])
        assert mismatches == 0 and checked >= MAX_TOKENS - 1, (name, checked, mismatches)
        per = {s: _errors(ref.by_id, start, row["aux"], ids, s) for s in (0, -1, 1)}
        errs[name] = {"right": max(per[0].values()),
                      # Each id's rows read as the layer below or above: what a
                      # capture shifted by one layer would hand over.
                      "shifted": min(min(per[-1].values()), min(per[1].values()))}
    print("\nmax |vLLM - HF| per prompt (right layer; least of the shifted ones):", errs)
    for name, e in errs.items():
        record_property(f"{name}_errors", e)
        assert e["right"] <= ATOL, (name, e)
        assert e["shifted"] >= SHIFT_MARGIN * ATOL, (name, e)
