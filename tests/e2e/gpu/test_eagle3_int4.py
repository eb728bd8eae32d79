# SPDX-License-Identifier: Apache-2.0
"""Kimi-K2.5 INT4 with EAGLE-3 on a GPU: the seeds' target.

A tiny Kimi-K2.5 (the kimi_k25 wrapper, MLA with the published latent
geometry, bf16) whose routed experts are packed W4A16 by compressed_tensors
with the published config's ``quantization_config``, verbatim
(tests/v1/spec_decode/published_configs/moonshotai-kimi-k25-target), served
through Marlin MoE in production settings (EAGLE3_GPU_PROFILE=production).

1. The aux states are right (tools/gpu_harness/int4_check.py): each captured
   state is nearest the input of its own layer in an independent float64
   forward of the experts as compressed_tensors dequantizes them, with an error
   below a tenth of the gap to the neighbouring layers (or within 1.5x of an
   independent bf16 forward); speculators 0.4.0.1's VllmHiddenStatesGenerator
   on the same checkpoint, ids shifted by one, gives the same states.
2. Acceptance (tools/gpu_harness/bench_eagle3.py --kind kimi-k25-int4): a
   target trained on the bench's skip-rule language, then quantized, and a
   drafter trained on the INT4 target's captured states reach a mean
   acceptance length of at least 3.0 at k = 3; a random drafter stays near 1.0.
"""

from __future__ import annotations

import importlib
import json

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

MARLIN = "CompressedTensorsWNA16MarlinMoEMethod"


@pytest.fixture(autouse=True)
def _production(monkeypatch):
    monkeypatch.setenv("EAGLE3_GPU_PROFILE", "production")


def test_int4_aux_states_match_a_dequantized_reference_and_speculators(tmp_path, results_dir):
    pytest.importorskip("speculators", reason="pip install --no-deps speculators==0.4.0.1 (the seeds' tool)")
    res = importlib.import_module("int4_check").run_all(results_dir, tmp_path)
    for name in ("plain", "eagle3", "speculators"):
        assert res.get(name, {}).get("ok", True), res[name]["error"]
    for name in ("plain", "eagle3"):
        assert res[name]["engine"]["moe_quant_methods"] == [MARLIN], res[name]["engine"]
    assert res["eagle3"]["metrics"]["num_drafts"] > 0
    ref = res["reference"]
    assert "error" not in ref, ref["error"]
    assert ref["speculators_checked"]
    for row in ref["per_id"]:
        assert row["ok"], row  # the criteria: int4_check.reference
    assert res["ok"]


def test_int4_acceptance_of_a_trained_drafter(tmp_path, results_dir):
    bench = importlib.import_module("bench_eagle3")
    out = results_dir / "bench_kimi_k25_int4"
    out.mkdir(parents=True, exist_ok=True)
    bench.run_all(out, tmp_path / "work", steps=1500, target_steps=400, kind="kimi-k25-int4",
                  early_control=False)
    r = json.loads((out / "bench_eagle3.json").read_text())
    assert not r.get("errors"), r.get("errors")
    assert r["target"]["text_config"]["quantization_config"]["format"] == "pack-quantized"
    assert r["target_training"]["final_rule_accuracy"] >= 0.99
    for run in ("plain", "eagle3_trained", "eagle3_random"):
        assert r[run]["engine"]["moe_quant_methods"] == [MARLIN], r[run]["engine"]
    for b in r["batches"]:
        assert r["eagle3_trained"][f"batch{b}"]["mean_acceptance_length"] >= 3.0, r["eagle3_trained"]
        assert r["eagle3_random"][f"batch{b}"]["mean_acceptance_length"] <= 1.2, r["eagle3_random"]
