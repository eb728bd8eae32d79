# SPDX-License-Identifier: Apache-2.0
"""GLM-5 and DeepSeek-V3.2 (DeepSeek sparse attention) with EAGLE-3 on a GPU.

DSA runs only with MLA on, in 16-bit, through the FLASHMLA_SPARSE backend and
the indexer's DeepGEMM/fp8 kernels (a GPU with the real wheel and deep_gemm;
on the lent H200, kernels.py's build with EAGLE3_HARNESS_DSA=1, which puts
the torch stand-ins of tools/gpu_harness/dsa_ops.py in place of FlashMLA's
sparse kernels and DeepGEMM's indexer logits: neither has a registry release
at v0.16.0's pins). bf16, eager (EAGLE3_GPU_PROFILE=eager).

1. The aux states are right (tools/gpu_harness/dsa_check.py): a tiny target
   with the published attention geometry and index_topk 128 serves a
   256-token prompt with a random drafter; each captured state must be
   nearest the float64 reference's input of its own layer, nearer the sparse
   reference than a dense one (the indexer's choice reached it), and no
   further from float64 than a tenth of the neighbouring-layer gap or 1.5x
   an independent forward at the served precision (bf16, fp8 indexer).
2. Acceptance (tools/gpu_harness/bench_eagle3.py --kind): a target trained
   on the bench's skip-rule language and a drafter trained on its captured
   states reach a mean acceptance length of at least 3.0 at k = 3; a random
   drafter stays near 1.0.
"""

from __future__ import annotations

import importlib
import json

import pytest


pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

KINDS = ["glm5", "deepseek-v32"]


def _tool(name):
    return importlib.import_module(name)


@pytest.fixture(autouse=True)
def _eager_bf16(monkeypatch):
    monkeypatch.setenv("EAGLE3_GPU_PROFILE", "eager")
    from vllm.utils.import_utils import has_deep_gemm

    if not has_deep_gemm():
        pytest.skip("the DSA indexer needs DeepGEMM (the real wheel's environment: v0.16.0's "
                    "tools/install_deepgemm.sh) or the harness stand-in (EAGLE3_HARNESS_DSA=1, "
                    "tools/gpu_harness/dsa_ops.py)")


@pytest.mark.parametrize("kind", KINDS)
def test_dsa_aux_states_match_float64_reference(kind, tmp_path, results_dir):
    res = _tool("dsa_check").run_all(kind, results_dir, tmp_path)
    for name in ("plain", "eagle3"):
        assert "error" not in res[name], res[name]["error"]
    assert res["eagle3"]["metrics"]["num_drafts"] > 0
    ref = res["reference"]
    assert "error" not in ref, ref["error"]
    assert ref["rows_with_a_choice_per_layer"] > 0  # top-k below the prompt length
    for row in ref["per_id"]:
        assert row["ok"], row  # the criterion: dsa_check.reference
    assert ref["ok"]


@pytest.mark.parametrize("kind", KINDS)
def test_dsa_acceptance_of_a_trained_drafter(kind, tmp_path, results_dir, monkeypatch):
    bench = _tool("bench_eagle3")
    out = results_dir / f"bench_{kind}"
    out.mkdir(parents=True, exist_ok=True)
    # Prompt (8-24) + continuation <= index_topk (128): the dense-trained target serves as trained.
    monkeypatch.setattr(_tool("tools.gpu_harness.engine"), "GEN_TOKENS", 96)
    # No early-ids control: nothing here asserts on it, and each DSA stage of
    # device_run.sh runs both tests of a target in 540 s (about 505 s in call 36).
    bench.run_all(out, tmp_path / "work", steps=1500, target_steps=400, kind=kind, early_control=False)
    r = json.loads((out / "bench_eagle3.json").read_text())
    assert not r.get("errors"), r.get("errors")
    assert r["target_training"]["final_rule_accuracy"] >= 0.99
    assert r["gen_tokens"] == 96
    for b in (1, 8, 32):
        assert r["eagle3_trained"][f"batch{b}"]["mean_acceptance_length"] >= 3.0, r["eagle3_trained"]
        assert r["eagle3_random"][f"batch{b}"]["mean_acceptance_length"] <= 1.2, r["eagle3_random"]
