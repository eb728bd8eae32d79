# SPDX-License-Identifier: Apache-2.0
"""tools/gpu_harness/project.py on CPU: the per-rank geometry it serves is
1/8 of the published configs (DeepSeek-R1 with SpecForge's drafters,
Kimi-K2.5 INT4 with TorchSpec's), vLLM takes every rank config it writes,
Marlin MoE takes the Kimi rank's INT4 experts, its line fit and projection
agree with numpy's least squares for each drafter, ``fit`` still reproduces
the committed DeepSeek-V3 result, and run()'s engine loop (with a stand-in
for vLLM's LLM) orders, refuses and stops as documented. The timing itself
runs on a GPU (docs/gpu.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import project
from gpu_e2e_helpers import REPO_ROOT

PUBLISHED = REPO_ROOT / "tests" / "v1" / "spec_decode" / "published_configs"


RESULTS = REPO_ROOT / "tools" / "gpu_harness" / "results"
COMMITTED = RESULTS / "2026-12-02_h200_project_deepseek_v3_tp8_rank_gpu_time.json"
# H200 calls 42, 44, 45 (one drafter each; README quotes them).
COMMITTED_BY_DRAFTER = {
    "2026-12-02_h200_project_kimi_k25_int4_tp8_rank_gpu_time.json": "eagle3",
    "2026-12-02_h200_project_kimi_k25_int4_tp8_rank_mla_drafter.json": "eagle3_mla",
    "2026-12-02_h200_project_deepseek_v3_tp8_rank_mla_drafter.json": "eagle3_mla",
}
KIMI = "moonshotai-kimi-k25-target"


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


# ---------------------------------------------------------------- Kimi-K2.5 INT4


def test_kimi_k25_target_is_the_published_text_config():
    published = _cfg(KIMI)
    text = project.published_target(KIMI)
    assert {k: v for k, v in published["text_config"].items() if k != "auto_map"} == text
    assert text["architectures"] == ["DeepseekV3ForCausalLM"] and text["model_type"] == "kimi_k2"
    # The deepseek target has no text_config and comes back whole.
    assert project.published_target("deepseek-r1-0528-target-ttmetal") == _cfg("deepseek-r1-0528-target-ttmetal")


def test_kimi_k25_rank_geometry_is_an_eighth_of_the_published_config():
    full = _cfg(KIMI)["text_config"]
    g = project.geometry(project.published_target(KIMI), 4)
    assert (g["num_attention_heads"], g["num_key_value_heads"], g["moe_intermediate_size"],
            g["intermediate_size"], g["vocab_size"]) == (8, 8, 256, 2304, 20480)
    assert (64 // 8, 2048 // 8, 18432 // 8, 163840 // 8) == (8, 256, 2304, 20480)
    # Unsplit under TP: hidden size, the MLA latent, the 384 experts and routing.
    for k in ("hidden_size", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
              "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
              "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "rope_scaling"):
        assert g[k] == full[k], k
    assert g["n_routed_experts"] == 384 and g["first_k_dense_replace"] == 1
    # INT4 experts as published: the quantization_config verbatim.
    assert g["quantization_config"] == full["quantization_config"]
    assert g["quantization_config"]["quant_method"] == "compressed-tensors"
    assert g["num_hidden_layers"] == 4 and "auto_map" not in g
    # One dense layer first: 2 layers hold one MoE layer, 1 none.
    assert project.geometry(project.published_target(KIMI), 2)["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match="no MoE layer"):
        project.geometry(project.published_target(KIMI), 1)


def test_marlin_moe_takes_the_kimi_rank_experts():
    from vllm.model_executor.layers.quantization.utils.marlin_utils import check_moe_marlin_supports_layer

    for layers in project.MODELS["kimi-k25-int4"]["default_layers"]:
        g = project.geometry(project.published_target(KIMI), layers)
        assert project.marlin_moe_supports(g)
    # vLLM's own rule on one rank's experts: hidden 7168, 256 per partition, group 32.
    group = g["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    layer = SimpleNamespace(hidden_size=g["hidden_size"], intermediate_size_per_partition=g["moe_intermediate_size"],
                            apply_router_weight_on_input=False)
    assert group == 32 and check_moe_marlin_supports_layer(layer, group)
    # The same rule refuses what project.marlin_moe_supports refuses.
    narrow = dict(g, moe_intermediate_size=96)
    assert not project.marlin_moe_supports(narrow)
    assert not check_moe_marlin_supports_layer(
        SimpleNamespace(**{**vars(layer), "intermediate_size_per_partition": 96}), group)
    # No INT4 experts (DeepSeek served as bf16): nothing for Marlin.
    assert not project.marlin_moe_supports(project.geometry(_cfg("deepseek-r1-0528-target-ttmetal"), 4))


def test_kimi_llama_drafter_rank_geometry():
    t = project.geometry(project.published_target(KIMI), 4)
    d = project.drafter_geometry(_cfg("torchspec-kimi-k25-eagle3"), t, [1, 2, 3])
    assert (d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"], d["intermediate_size"]) == (
        64 // 8, 64 // 8, 128, 12288 // 8)
    assert d["vocab_size"] == d["draft_vocab_size"] == 20480 and d["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]


@pytest.mark.parametrize("model", sorted(project.MODELS))
def test_mla_drafter_rank_geometry(model):
    spec = project.MODELS[model]
    t = project.geometry(project.published_target(spec["target"]), spec["default_layers"][1])
    published = _cfg(spec["drafters"]["mla"])
    d = project.mla_drafter_geometry(published, t, [1, 2, 3])
    assert d["architectures"] == published["architectures"] and d["num_hidden_layers"] == 1
    assert d["num_attention_heads"] == d["num_key_value_heads"] == published["num_attention_heads"] // 8
    assert d["intermediate_size"] == published["intermediate_size"] // 8  # its one dense MLP
    assert d["vocab_size"] == d["draft_vocab_size"] == t["vocab_size"]
    assert d["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and "eagle_config" not in d
    # The draft layer joins the target's MLA KV cache: vLLM refuses any difference.
    for f in project.MLA_SHARED_FIELDS:
        assert d[f] == t[f], f
    for k in ("hidden_size", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "rope_scaling", "model_type"):
        assert d[k] == published[k], k
    with pytest.raises(ValueError, match="kv_lora_rank"):
        project.mla_drafter_geometry(published, dict(t, kv_lora_rank=256), [1, 2, 3])


def test_aux_ids_are_three_distinct_boundaries():
    assert project.aux_ids(4) == [1, 2, 3] and project.aux_ids(8) == [1, 4, 7]  # as call 37 ran
    assert project.aux_ids(2) == [0, 1, 2] and project.aux_ids(3) == [1, 2, 3]
    for n in range(2, 12):
        ids = project.aux_ids(n)
        assert len(set(ids)) == 3 and 0 <= min(ids) and max(ids) <= n


@pytest.mark.parametrize("model", sorted(project.MODELS))
def test_vllm_takes_every_rank_config(model, tmp_path):
    """What each engine of ``run`` is given, through vLLM's own config
    checks (the draft class, MLA, aux id range and duplicates, INT4): a
    refusal here would otherwise cost an engine start on the GPU."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.config.speculative import get_eagle3_aux_layer_ids
    from vllm.model_executor.models.registry import ModelRegistry

    spec = project.MODELS[model]
    classes = {"llama": "Eagle3LlamaForCausalLM", "mla": "Eagle3DeepseekV2ForCausalLM"}
    for layers in spec["default_layers"]:
        t = project.target_geometry(model, layers)
        (tmp_path / f"t{layers}").mkdir()
        (tmp_path / f"t{layers}" / "config.json").write_text(json.dumps(t))
        target = ModelConfig(model=str(tmp_path / f"t{layers}"), skip_tokenizer_init=True, dtype="bfloat16",
                             max_model_len=1024)
        assert target.use_mla and target.hf_text_config.num_attention_heads == t["num_attention_heads"]
        assert target.quantization == {"kimi-k25-int4": "compressed-tensors", "deepseek-v3-fp8": "fp8"}.get(model)
        for kind, name in spec["drafters"].items():
            d = project.DRAFTER_GEOMETRY[kind](_cfg(name), t, project.aux_ids(layers))
            path = tmp_path / f"{kind}{layers}"
            path.mkdir()
            (path / "config.json").write_text(json.dumps(d))
            sc = SpeculativeConfig(method="eagle3", model=str(path), num_speculative_tokens=project.K,
                                   target_model_config=target, target_parallel_config=ParallelConfig())
            draft = sc.draft_model_config
            cls, _ = ModelRegistry.resolve_model_cls(draft.architectures, draft)
            assert cls.__name__ == classes[kind]
            assert draft.use_mla == (kind == "mla") and draft.quantization is None
            assert get_eagle3_aux_layer_ids(draft.hf_config)[0] == tuple(project.aux_ids(layers))
            assert draft.hf_config.draft_vocab_size == t["vocab_size"]


# ---------------------------------------------------------------- several drafters


def _line(a, b, layers=(2, 4, 6)):
    return {x: a + b * x for x in layers}


def test_projection_per_drafter_against_numpy():
    layers = [2, 4, 6]
    pts = {"plain": {2: 3.0, 4: 4.1, 6: 5.0}, "eagle3": {2: 7.0, 4: 8.9, 6: 11.0},
           "eagle3_mla": {2: 6.0, 4: 7.5, 6: 9.1}}
    out = project.project(pts)
    at = {n: np.polyval(np.polyfit(layers, [p[x] for x in layers], 1), 61) for n, p in pts.items()}
    for n in pts:
        assert out["projected_step_ms"][n] == pytest.approx(at[n])
    by = out["projected_speedup_by_drafter"]
    assert set(by) == {"eagle3", "eagle3_mla"}
    for n in by:
        assert by[n]["3.0"] == pytest.approx(3.0 * at["plain"] / at[n])
    assert out["projected_speedup"] == by["eagle3"] and "not_projected" not in out
    # One drafter's points not a line: the other is still projected.
    scattered = dict(pts, eagle3={2: 7.0, 4: 11.0, 6: 11.1})
    out = project.project(scattered)
    assert "misses a measured step" in out["not_projected"]["eagle3"]
    assert set(out["projected_speedup_by_drafter"]) == {"eagle3_mla"} and "projected_speedup" not in out
    # Plain not a line: nothing.
    out = project.project(dict(pts, plain={2: 3.0, 4: 3.0, 6: 3.0}))
    assert "projected_speedup_by_drafter" not in out and "projected_step_ms" not in out
    # A drafter a stopped run measured at two layer counts only.
    out = project.project(dict(pts, eagle3_mla={2: 6.0, 4: 7.5}))
    assert "2 layer count" in out["not_projected"]["eagle3_mla"]
    assert set(out["projected_speedup_by_drafter"]) == {"eagle3"} and "eagle3_mla" not in out["fits"]


def test_gpu_time_projection_per_drafter():
    wall = {"plain": _line(1.5, 0.0), "eagle3": _line(6.0, 0.0), "eagle3_mla": _line(5.0, 0.0)}
    gpu = {"plain": _line(0.1, 0.16), "eagle3": _line(0.6, 0.18), "eagle3_mla": _line(0.5, 0.17)}
    out = project.project_gpu(wall, gpu)
    st = out["projected_step_ms"]
    for n in ("eagle3", "eagle3_mla"):
        for how in ("overlapped", "serial"):
            assert out["projected_speedup_by_drafter"][n][how]["2.5"] == pytest.approx(
                2.5 * st[how]["plain"] / st[how][n])
    assert out["projected_speedup"] == out["projected_speedup_by_drafter"]["eagle3"]
    out = project.project_gpu(wall, dict(gpu, eagle3=_line(0.6, -0.01)))
    assert "does not grow" in out["not_projected"]["eagle3"] and "projected_speedup" not in out
    assert set(out["projected_speedup_by_drafter"]) == {"eagle3_mla"}


def test_fit_reproduces_the_committed_deepseek_result(capsys):
    """H200 call 37's result (plain and the Llama drafter, "eagle3"): ``fit``
    on the file gives every figure it holds, and adds only the per-drafter view."""
    stored = json.loads(COMMITTED.read_text())
    assert project.main(["fit", str(COMMITTED)]) == 0
    printed = json.loads(capsys.readouterr().out)

    def contains(new, old, where):
        if isinstance(old, dict):
            for k, v in old.items():
                assert k in new, f"{where}/{k}"
                contains(new[k], v, f"{where}/{k}")
        elif isinstance(old, float):
            assert new == pytest.approx(old, rel=1e-12), where
        else:
            assert new == old, where

    for key in ("projection", "projection_gpu_time"):
        contains(printed[key], stored[key], key)
    for b, p in printed["projection_gpu_time"].items():
        assert p["projected_speedup_by_drafter"] == {"eagle3": p["projected_speedup"]}, b
        assert set(p) - set(stored["projection_gpu_time"][b]) == {"projected_speedup_by_drafter"}
    # The wall steps of call 37 fit no line: still no wall projection.
    assert all("not_projected" in p for p in printed["projection"].values())


@pytest.mark.parametrize("name", sorted(COMMITTED_BY_DRAFTER))
def test_committed_projections_agree_with_numpy(name):
    """What README quotes from each committed projection: the per-step GPU
    time is a line in the layer count (residuals under 1 %), its value at 61
    layers is numpy's least squares on the measured steps, and the overlapped
    speed-up is acceptance length x plain / EAGLE-3 at 61 layers."""
    stored = json.loads((RESULTS / name).read_text())
    drafter = COMMITTED_BY_DRAFTER[name]
    assert set(stored["gpu_step_ms"]) == {"batch1", "batch8", "batch32"}
    for b, by_engine in stored["gpu_step_ms"].items():
        at61 = {}
        for engine in ("plain", drafter):
            layers = np.array([float(n) for n in by_engine[engine]])
            ms = np.array(list(by_engine[engine].values()))
            assert len(layers) >= 3, (name, b, engine)
            slope, icept = np.polyfit(layers, ms, 1)
            assert np.max(np.abs(icept + slope * layers - ms) / ms) < 0.01, (name, b, engine)
            at61[engine] = icept + slope * 61
        p = stored["projection_gpu_time"][b]
        assert p["gpu_ms_at_projected_layers"] == pytest.approx(at61, rel=1e-9)
        speedup = p["projected_speedup_by_drafter"][drafter]["overlapped"]
        for al in ("2.5", "3.0", "3.5"):
            assert speedup[al] == pytest.approx(float(al) * at61["plain"] / at61[drafter], rel=1e-9), (b, al)


def test_run_flags_follow_the_last_model(monkeypatch, tmp_path):
    # device_run.sh passes --model deepseek-v3 before PROJECT_ARGS: argparse
    # keeps the last --model, and the per-model defaults follow it.
    seen = {}
    monkeypatch.setattr(project, "run", lambda model, layers, out, **kw: seen.update(model=model, layers=layers, **kw)
                        or {})
    project.main(["run", "--model", "deepseek-v3", "--out", str(tmp_path), "--model", "kimi-k25-int4",
                  "--drafters", "mla", "--budget-s", "480"])
    assert seen["model"] == "kimi-k25-int4" and seen["layers"] is None
    assert seen["drafters"] == ["mla"] and seen["budget_s"] == 480 and seen["prof_tokens"] is None
    monkeypatch.undo()
    with pytest.raises(ValueError, match="no drafter"):
        project.run("kimi-k25-int4", None, tmp_path, drafters=["medusa"])


class _FakeLLM:
    """vLLM's LLM as run() drives it, without a GPU: each start costs 100 s
    of the fake clock, and the target's MoE method is what the test says."""

    clock = 0.0
    moe = {}
    started: list = []

    def __init__(self, **kw):
        _FakeLLM.clock += 100.0
        self.kw = kw
        self.layers = json.loads((Path(kw["model"]) / "config.json").read_text())["num_hidden_layers"]
        _FakeLLM.started.append(kw)

    def generate(self, prompts, sp, use_tqdm=False):
        # Steps that grow with the layers, so the result holds lines to fit.
        _FakeLLM.clock += 0.01 * self.layers * (2 if "speculative_config" in self.kw else 1)
        return []

    def start_profile(self):
        pass

    def stop_profile(self):
        pass


@pytest.fixture
def fake_engine(monkeypatch, tmp_path_factory):
    import tempfile

    import vllm

    import gpu_e2e_helpers as h

    monkeypatch.setenv("EAGLE3_GPU_PROFILE", "production")
    monkeypatch.setenv("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "1")
    monkeypatch.setattr(h, "configure_env", lambda: None)
    monkeypatch.setattr(h, "engine_facts", lambda llm: {"attention_backends": {"target": ["FLASH_ATTN_MLA"]},
                                                         "moe": dict(_FakeLLM.moe)})
    monkeypatch.setattr(h, "shutdown", lambda llm: None)
    monkeypatch.setattr(h, "spec_counters", lambda llm: {})
    monkeypatch.setattr(h, "counters_delta", lambda a, b: {"num_drafts": 64})
    monkeypatch.setattr(vllm, "LLM", _FakeLLM)
    monkeypatch.setattr(project.time, "perf_counter", lambda: _FakeLLM.clock)
    monkeypatch.setattr(project, "_gpu_step_ms", lambda traces, seen: 1.0)
    monkeypatch.setattr(tempfile, "mkdtemp", lambda prefix="": str(tmp_path_factory.mktemp(prefix)))
    monkeypatch.setattr(_FakeLLM, "clock", 0.0)
    monkeypatch.setattr(_FakeLLM, "started", [])
    monkeypatch.setattr(_FakeLLM, "moe", {"layer": "model.layers.1.mlp.experts", "wrapped": None,
                                          "quant_method": "CompressedTensorsWNA16MarlinMoEMethod",
                                          "kernel_backend": "Marlin"})
    return _FakeLLM


def test_run_times_drafter_by_drafter_within_its_budget(fake_engine, tmp_path):
    res = project.run("kimi-k25-int4", None, tmp_path, budget_s=510)
    # About 100 s an engine: five fit in 510 s, plain at every layer count first.
    served = [(json.loads((Path(kw["model"]) / "config.json").read_text())["num_hidden_layers"],
               kw.get("speculative_config", {}).get("model")) for kw in fake_engine.started]
    assert [n for n, _ in served] == [2, 4, 6, 2, 4]
    assert [d is None for _, d in served] == [True, True, True, False, False]
    assert res["skipped_engines"] == ["eagle3_6", "eagle3_mla_2", "eagle3_mla_4", "eagle3_mla_6"]
    assert res["drafters"] == {"eagle3": "torchspec-kimi-k25-eagle3", "eagle3_mla": "torchspec-kimi-k25-eagle3-mla"}
    assert res["engine"]["plain_2"]["moe"]["quant_method"] == "CompressedTensorsWNA16MarlinMoEMethod"
    # What was written after the last engine is what fit reads back.
    saved = json.loads((tmp_path / "project_kimi-k25-int4.json").read_text())
    assert saved["projection"]["batch1"]["not_projected"]["eagle3"].startswith("measured at 2 layer count")
    drafter = json.loads((Path(served[3][1]) / "config.json").read_text())
    assert drafter["architectures"] == ["LlamaForCausalLMEagle3"] and drafter["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]


def test_run_refuses_int4_experts_off_marlin(fake_engine, tmp_path):
    fake_engine.moe = {"layer": "model.layers.1.mlp.experts", "quant_method": "CompressedTensorsWNA16MoEMethod",
                       "wrapped": None, "kernel_backend": None}
    with pytest.raises(RuntimeError, match="not Marlin MoE"):
        project.run("kimi-k25-int4", None, tmp_path, drafters=["mla"])
    # The same method read on a bf16 target refuses nothing (its experts are not INT4).
    fake_engine.moe = {"layer": "model.layers.3.mlp.experts", "quant_method": "UnquantizedFusedMoEMethod",
                       "wrapped": None, "kernel_backend": None}
    res = project.run("deepseek-v3", None, tmp_path)
    assert set(res["step_ms"]["batch1"]) == {"plain", "eagle3"} and res["layers"] == [4, 6, 8]
    # A Marlin class running FlashInfer's kernels is not Marlin MoE either.
    assert not project._is_marlin({"quant_method": "CompressedTensorsWNA16MarlinMoEMethod",
                                   "kernel_backend": "Flashinfer"})
    assert project._is_marlin({"quant_method": "FusedMoEModularMethod", "kernel_backend": "Marlin",
                               "wrapped": "CompressedTensorsWNA16MarlinMoEMethod"})


def test_engine_facts_name_the_first_moe_layers_method(monkeypatch):
    """gpu_e2e_helpers._worker_facts, as the workers run it, on a model whose
    first FusedMoE layer's method is wrapped (expert parallelism): every
    method in use by class, and the first layer's with the wrapped method and
    its kernel backend, which is what project.py's Marlin check reads."""
    import torch

    import vllm.model_executor.layers.fused_moe as fused_moe

    import gpu_e2e_helpers as h

    class FakeMoE(torch.nn.Module):
        def __init__(self, quant_method):
            super().__init__()
            self.quant_method = quant_method

    class CompressedTensorsWNA16MarlinMoEMethod:
        kernel_backend = "Marlin"

    class FusedMoEModularMethod:
        def __init__(self, old):
            self.old_quant_method = old

    monkeypatch.setattr(fused_moe, "FusedMoE", FakeMoE)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Module(), torch.nn.Module()])
    model.layers[1].experts = FakeMoE(FusedMoEModularMethod(CompressedTensorsWNA16MarlinMoEMethod()))
    model.layers[2].experts = FakeMoE(CompressedTensorsWNA16MarlinMoEMethod())

    def worker(get_model):
        modes = SimpleNamespace(cudagraph_mode="FULL_AND_PIECEWISE", mode=3)
        return SimpleNamespace(model_runner=SimpleNamespace(
            get_model=get_model, attn_groups=[], compilation_config=modes, cudagraph_dispatcher=modes))

    facts = h._worker_facts(worker(lambda: model))
    assert facts["moe_quant_methods"] == ["CompressedTensorsWNA16MarlinMoEMethod", "FusedMoEModularMethod"]
    assert facts["moe"] == {"layer": "layers.1.experts", "quant_method": "FusedMoEModularMethod",
                            "wrapped": "CompressedTensorsWNA16MarlinMoEMethod", "kernel_backend": "Marlin",
                            "fp8_backend": None}
    assert facts["fp8_linear"] == {}
    assert project._is_marlin(facts["moe"])
    assert h._worker_facts(worker(torch.nn.Module))["moe"] == {"layer": None}


# ---------------------------------------------------------------- DeepSeek-V3's fp8 release


def test_fp8_model_keeps_the_published_quantization_config():
    published = _cfg("deepseek-r1-0528-target-ttmetal")["quantization_config"]
    assert published == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                         "weight_block_size": [128, 128]}
    fp8, bf16 = project.target_geometry("deepseek-v3-fp8", 61), project.target_geometry("deepseek-v3", 61)
    assert fp8["quantization_config"] == published and "quantization_config" not in bf16
    assert {k: v for k, v in fp8.items() if k != "quantization_config"} == bf16
    # Every sharded dimension an fp8 GEMM sees is whole 128-blocks, as at TP = 8.
    for dim in (fp8["moe_intermediate_size"], fp8["intermediate_size"], fp8["hidden_size"],
                fp8["num_attention_heads"] * (fp8["qk_nope_head_dim"] + fp8["qk_rope_head_dim"]),
                fp8["num_attention_heads"] * fp8["v_head_dim"]):
        assert dim % 128 == 0, dim
    with pytest.raises(ValueError, match="fp8 asked for"):
        project.geometry(project.published_target(KIMI), 4, fp8=True)


def test_fp8_linear_facts_follow_vllms_deepgemm_rule():
    """Which GEMM engine_facts names for a shape: vLLM's own
    should_use_deepgemm_for_fp8_linear (N % 64, K % 128), else the op the
    layer's W8A8BlockFp8LinearOp dispatched."""
    from types import SimpleNamespace

    import torch

    import gpu_e2e_helpers as h

    def _run_triton(*a):  # W8A8BlockFp8LinearOp's Triton path is its bound method of this name
        raise AssertionError("not called")

    def linear(n, k, deep_gemm):
        m = torch.nn.Module()
        m.weight = torch.nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
        m.quant_method = SimpleNamespace(w8a8_block_fp8_linear=SimpleNamespace(
            is_deep_gemm_supported=deep_gemm, w8a8_blockscale_op=_run_triton))
        return m

    for deep_gemm in (True, False):
        model = torch.nn.Module()
        model.a, model.b, model.c = linear(2048, 7168, deep_gemm), linear(576, 7168, deep_gemm), linear(96, 7168, deep_gemm)
        model.plain = torch.nn.Linear(4, 4)
        facts = h.fp8_linear_facts(model)
        if deep_gemm:
            assert facts == {"deep_gemm": ["2048x7168", "576x7168"], "_run_triton": ["96x7168"]}
        else:
            assert facts == {"_run_triton": ["2048x7168", "576x7168", "96x7168"]}


def test_serves_fp8_needs_fp8_experts_and_an_fp8_gemm():
    good = {"moe": {"quant_method": "Fp8MoEMethod", "fp8_backend": "TRITON"}, "fp8_linear": {"deep_gemm": ["1x1"]}}
    assert project.serves_fp8(good)
    assert not project.serves_fp8({**good, "moe": {"quant_method": "UnquantizedFusedMoEMethod"}})
    assert not project.serves_fp8({**good, "fp8_linear": {}})
    assert not project.serves_fp8({**good, "fp8_linear": {"error": ["ImportError: x"]}})
    # What fulldepth.run and project.run call on each engine's facts.
    mla = {"attention_backends": {"target": ["FLASH_ATTN_MLA"]}}
    project.check_served("deepseek-v3-fp8", {**good, **mla})
    project.check_served("deepseek-v3", {**mla, "moe": {"quant_method": "UnquantizedFusedMoEMethod"}})
    with pytest.raises(RuntimeError, match="not served in fp8"):
        project.check_served("deepseek-v3-fp8", {**mla, "moe": {"quant_method": "UnquantizedFusedMoEMethod"}})
    with pytest.raises(RuntimeError, match="not an MLA backend"):
        project.check_served("deepseek-v3-fp8", {**good, "attention_backends": {"target": ["TRITON_ATTN"]}})
