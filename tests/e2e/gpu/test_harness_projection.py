# SPDX-License-Identifier: Apache-2.0
"""tools/gpu_harness/project.py on CPU: the per-rank geometry it serves is
1/8 of the published DeepSeek-R1 config and SpecForge drafter, and its line
fit and projection agree with numpy's least squares. The timing itself runs
on a GPU (docs/gpu.md)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import project
from gpu_e2e_helpers import REPO_ROOT

PUBLISHED = REPO_ROOT / "tests" / "v1" / "spec_decode" / "published_configs"


def _cfg(name):
    return json.loads((PUBLISHED / name / "config.json").read_text())


def test_deepseek_v3_rank_geometry_is_an_eighth_of_the_published_config():
    full = _cfg("deepseek-r1-0528-target-ttmetal")
    g = project.geometry(full, 6)
    assert (g["num_attention_heads"], g["moe_intermediate_size"], g["intermediate_size"], g["vocab_size"]) == (
        128 // 8, 2048 // 8, 18432 // 8, 129280 // 8)
    # Unsplit under TP: hidden size, the MLA latent, the experts and routing.
    for k in ("hidden_size", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
              "v_head_dim", "n_routed_experts", "num_experts_per_tok", "first_k_dense_replace", "rope_scaling"):
        assert g[k] == full[k], k
    assert g["num_hidden_layers"] == 6 and "quantization_config" not in g  # fp8 release served as bf16
    with pytest.raises(ValueError, match="no MoE layer"):
        project.geometry(full, 3)


def test_drafter_rank_geometry():
    t = project.geometry(_cfg("deepseek-r1-0528-target-ttmetal"), 6)
    d = project.drafter_geometry(_cfg("specforge-deepseek-v3-671b-eagle3"), t, [1, 3, 5])
    assert (d["num_attention_heads"], d["num_key_value_heads"], d["intermediate_size"]) == (56 // 8, 1, 40960 // 8)
    # The head dim as transformers (and so vLLM's Llama drafter) reads the
    # config: unchanged at 128 (FA3's hdim128). Without an explicit head_dim
    # it would be 7168 / 7 = 1024, which FlashAttention refuses (H200 call 34's
    # drafter fell back to TRITON_ATTN for that reason).
    from transformers import LlamaConfig

    assert LlamaConfig(**d).head_dim == 128
    assert d["vocab_size"] == d["draft_vocab_size"] == t["vocab_size"] and "eagle_config" not in d
    assert d["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]


def test_fit_and_projection_against_numpy():
    layers = [4, 6, 8]
    plain = [3.1, 4.05, 5.2]
    eagle = [7.0, 8.9, 11.1]
    out = project.project({"plain": dict(zip(layers, plain)), "eagle3": dict(zip(layers, eagle))})
    for name, ys in (("plain", plain), ("eagle3", eagle)):
        b, a = np.polyfit(layers, ys, 1)
        f = out["fits"][name]
        assert f["a_ms"] == pytest.approx(a) and f["b_ms_per_layer"] == pytest.approx(b)
        assert out["projected_step_ms"][name] == pytest.approx(np.polyval([b, a], 61))
        assert f["max_relative_residual"] == pytest.approx(max(abs(np.polyval([b, a], x) - y) / y
                                                               for x, y in zip(layers, ys)))
    ratio = np.polyval(np.polyfit(layers, plain, 1), 61) / np.polyval(np.polyfit(layers, eagle, 1), 61)
    assert out["projected_speedup"]["3.0"] == pytest.approx(3.0 * ratio)
    with pytest.raises(ValueError, match="fewer than three"):
        project.fit_line([4, 6], [1.0, 2.0])


def test_no_projection_from_points_that_are_not_a_line():
    # H200 call 34 (per-rank DeepSeek-V3, batch 1): the plain step did not
    # grow from 4 to 8 layers, and EAGLE-3's scattered by 30 %.
    pts = {"plain": {4: 1.484, 6: 2.232, 8: 1.455}, "eagle3": {4: 11.05, 6: 6.389, 8: 7.558}}
    out = project.project(pts)
    assert "projected_speedup" not in out and "projected_step_ms" not in out
    assert "does not grow" in out["not_projected"]["plain"]
    assert "does not grow" in out["not_projected"]["eagle3"]
    # Rising but scattered: refused for the scatter, by how much.
    out = project.project({"plain": {4: 2.0, 6: 3.5, 8: 3.6}, "eagle3": {4: 7.0, 6: 8.9, 8: 11.1}})
    assert "misses a measured step by" in out["not_projected"]["plain"] and "eagle3" not in out["not_projected"]


def test_run_turns_mla_on_before_the_engines_start(monkeypatch, tmp_path):
    # The smoke profile (the harness default) sets VLLM_MLA_DISABLE=1 in
    # configure_env(); run() must choose production first, or every timed
    # target runs FLASH_ATTN instead of MLA (H200, seventh session).
    import gpu_e2e_helpers as h

    monkeypatch.setenv("EAGLE3_GPU_PROFILE", "smoke")
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    seen = {}

    def stop_after_configure():
        h.configure_env.__wrapped__()
        seen.update(profile=os.environ["EAGLE3_GPU_PROFILE"], mla_disable=os.environ.get("VLLM_MLA_DISABLE"))
        raise RuntimeError("stop before vLLM")

    stop_after_configure.__wrapped__ = h.configure_env
    monkeypatch.setattr(h, "configure_env", stop_after_configure)
    with pytest.raises(RuntimeError, match="stop before vLLM"):
        project.run("deepseek-v3", [4, 6, 8], tmp_path)
    assert seen == {"profile": "production", "mla_disable": None}


def test_gpu_time_projection_bounds_the_step_between_overlap_and_serial():
    layers = [4, 6, 8]
    wall = {"plain": {4: 1.5, 6: 1.6, 8: 1.4}, "eagle3": {4: 6.0, 6: 6.2, 8: 5.8}}
    gpu = {"plain": {4: 0.30, 6: 0.41, 8: 0.50}, "eagle3": {4: 0.90, 6: 1.21, 8: 1.49}}
    out = project.project_gpu(wall, gpu)
    for n in ("plain", "eagle3"):
        b, a = np.polyfit(layers, [gpu[n][x] for x in layers], 1)
        g61 = np.polyval([b, a], 61)
        w = np.mean(list(wall[n].values()))
        assert out["gpu_ms_at_projected_layers"][n] == pytest.approx(g61)
        assert out["projected_step_ms"]["overlapped"][n] == pytest.approx(max(w, g61))
        assert out["projected_step_ms"]["serial"][n] == pytest.approx(w + g61 - np.mean(list(gpu[n].values())))
    st = out["projected_step_ms"]
    for how in ("overlapped", "serial"):
        assert out["projected_speedup"][how]["3.0"] == pytest.approx(3.0 * st[how]["plain"] / st[how]["eagle3"])
    assert "projection" in out["label"] and "no all-reduce" in out["label"]
    # GPU times that do not grow with the layers give no projection either.
    flat = project.project_gpu(wall, {"plain": {4: 0.3, 6: 0.3, 8: 0.3}, "eagle3": gpu["eagle3"]})
    assert "plain" in flat["not_projected"] and "projected_speedup" not in flat


def test_fit_reads_a_result_with_gpu_times(tmp_path, capsys):
    res = {"step_ms": {"batch1": {"plain": {"4": 1.5, "6": 1.6, "8": 1.4}, "eagle3": {"4": 6.0, "6": 6.2, "8": 5.8}}},
           "gpu_step_ms": {"batch1": {"plain": {"4": 0.30, "6": 0.41, "8": 0.50},
                                      "eagle3": {"4": 0.90, "6": 1.21, "8": 1.49}}}}
    f = tmp_path / "project_deepseek-v3.json"
    f.write_text(json.dumps(res))
    assert project.main(["fit", str(f)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert "not_projected" in printed["projection"]["batch1"]
    assert printed["projection_gpu_time"]["batch1"]["projected_speedup"]["overlapped"]["3.0"] > 0
