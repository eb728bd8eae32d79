# SPDX-License-Identifier: Apache-2.0
"""Proof by acceptance: the compiled, CUDA-graphed MLA target hands the
EAGLE-3 drafter the hidden states it was trained on.

Greedy "EAGLE-3 output == plain output" (the smoke tests) holds for any
drafter at temperature 0, so it cannot tell right aux states from wrong ones.
This test trains a drafter on the states the target really returns and checks
that serving it reaches a high acceptance length, in production settings
(EAGLE3_GPU_PROFILE=production: bfloat16, MLA with the real latent geometry,
torch.compile + CUDA graphs, vLLM's own backend choice):

1. a tiny DeepSeek-V3 target is trained on a language with a skip rule
   (t[i+1] = f(t[i-1]), 15% noise), so its greedy continuations are
   predictable only from the token before the current one;
2. its aux states (layers 1, 3, 6) are captured from a production-mode engine
   and a Llama-architecture drafter is trained on them
   (tools/gpu_harness/bench_eagle3.py);
3. served at k = 3, the drafter must reach a mean acceptance length of at
   least 3.0 at batch 1, 8 and 32, within 5% of the same weights served in
   eager mode, with greedy output equal to plain decoding (the trained
   target's logit margins are far above bf16 noise);
4. control: the same drafter fed the target's first layers only, aux ids
   (0, 1, 2), must accept far less, so the 4.00 above rests on the deep states
   the engine hands over, not on the drafter's own token attention. The ids
   shifted by one, (0, 2, 5), are served and recorded too.

The same run is what ``device_run.sh bench-prod`` does on the H200 harness
(its result: docs/results.md). The shift by one is not what this test
asserts: on the 6-layer tiny target the inputs of layers 5 and 6 carry nearly
the same information, and a drafter with heads 128 wide, the published
drafters' width, loses little to it (3.92 of 4.00 in a CPU replay of the
pair, which gave 2.04 with (0, 1, 2):
tools/gpu_harness/results/2026-12-02_cpu_replay_acceptance_controls.json).
That the engine's ids are the target's layer inputs exactly, the off-by-one
itself, is proven on CPU (tests/e2e/cpu). Takes about 8 minutes on one GPU.
"""

from __future__ import annotations

import json

import pytest


pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

MIN_ACCEPTANCE = 3.0
EAGER_TOLERANCE = 0.05
# The CPU replay of the 128-wide pair: 4.00 with (1, 3, 6), 2.04 with (0, 1, 2).
CONTROL_MIN_DROP = 1.0
BATCHES = (1, 8, 32)


def _bench():
    import bench_eagle3

    return bench_eagle3


def test_eagle3_acceptance_in_production(tmp_path, results_dir, monkeypatch):
    monkeypatch.setenv("EAGLE3_GPU_PROFILE", "production")
    bench = _bench()
    out = results_dir / "acceptance"
    out.mkdir(parents=True, exist_ok=True)
    bench.run_all(out, tmp_path / "work", steps=1500, target_steps=400, random_drafter=False)
    r = json.loads((out / "bench_eagle3.json").read_text())
    assert not r.get("errors"), r.get("errors")
    assert r["target_training"]["final_rule_accuracy"] >= 0.99

    trained = r["eagle3_trained"]
    assert tuple(r["batches"]) == BATCHES
    for b in BATCHES:
        m = trained[f"batch{b}"]
        assert m["num_draft_tokens"] == 3 * m["num_drafts"] > 0, m
        assert m["mean_acceptance_length"] >= MIN_ACCEPTANCE, (b, m)
    assert trained["equal_to_plain"], trained["agreement_with_plain"]

    eager = r["eagle3_trained_eager"]
    for b in (1, 8):
        prod_mal = trained[f"batch{b}"]["mean_acceptance_length"]
        eager_mal = eager[f"batch{b}"]["mean_acceptance_length"]
        assert abs(prod_mal - eager_mal) <= EAGER_TOLERANCE * eager_mal, (b, prod_mal, eager_mal)

    assert r["eagle3_shifted_aux_ids"]["batch8"]["num_drafts"] > 0, r["eagle3_shifted_aux_ids"]
    early = r["eagle3_early_aux_ids"]["batch8"]["mean_acceptance_length"]
    right = trained["batch8"]["mean_acceptance_length"]
    assert early <= right - CONTROL_MIN_DROP, (early, right)
