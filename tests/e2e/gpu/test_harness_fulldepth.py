# SPDX-License-Identifier: Apache-2.0
"""tools/gpu_harness/fulldepth.py on CPU: the 61-layer per-rank configs it
serves (Kimi-K2.5 INT4 with Marlin-servable experts, both drafters, DeepSeek-V3)
and its summary's speed-ups with their spread, against figures worked by hand
with exact fractions. The timing itself runs on a GPU (docs/gpu.md)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from tools.gpu_harness import fulldepth


def _res(plain, eagle, gpu_plain=None, gpu_eagle=None):
    def cell(walls, gpu):
        c = {"repeats": [{"step_ms": w} for w in walls]}
        if gpu is not None:
            c["profile"] = {"median": {"gpu_kernel_ms": gpu}}
        return c

    return {"engines": {"plain": {"batches": {"8": cell(plain, gpu_plain)}},
                        "eagle3": {"batches": {"8": cell(eagle, gpu_eagle)}}}}


def test_summary_speedup_and_spread_by_hand():
    # plain: median 9, lowest 8, highest 10; EAGLE-3: median 12, lowest 11, highest 13.
    s = fulldepth.summarize(_res([10.0, 8.0, 9.0], [12.0, 13.0, 11.0], gpu_plain=8.5, gpu_eagle=10.0))["8"]
    assert s["plain"]["wall_ms"] == 9.0 and s["plain"]["n"] == 3
    assert s["eagle3"]["gpu_idle_ms"] == pytest.approx(2.0)
    assert s["plain"]["gpu_idle_ms"] == pytest.approx(0.5)
    sp = s["eagle3"]["speedup"]
    assert set(sp) == {"2.5", "3.0", "3.5"}
    # AL 3: 3 * 9 / 12, 3 * 8 / 13, 3 * 10 / 11.
    assert sp["3.0"]["median"] == pytest.approx(float(Fraction(27, 12)))
    assert sp["3.0"]["low"] == pytest.approx(float(Fraction(24, 13)))
    assert sp["3.0"]["high"] == pytest.approx(float(Fraction(30, 11)))
    assert sp["2.5"]["median"] == pytest.approx(float(Fraction(5, 2) * 9 / 12))


def test_summary_without_plain_gives_no_speedup():
    res = _res([9.0], [12.0])
    del res["engines"]["plain"]
    assert "speedup" not in fulldepth.summarize(res)["8"]["eagle3"]


@pytest.mark.parametrize("model", ["kimi-k25-int4", "deepseek-v3", "deepseek-v3-fp8"])
def test_61_layer_configs(tmp_path, model):
    d = fulldepth.configs(model, ["plain", "llama", "mla"], 61, tmp_path)
    assert d["plain"] is None
    t = json.loads((tmp_path / "target" / "config.json").read_text())
    assert t["num_hidden_layers"] == 61
    for kind in ("llama", "mla"):
        c = json.loads((d[kind] / "config.json").read_text())
        ids = c["eagle_aux_hidden_state_layer_ids"]
        assert len(set(ids)) == 3 and max(ids) <= 61
    if model == "kimi-k25-int4":
        assert t["quantization_config"]["quant_method"] == "compressed-tensors"
    if model == "deepseek-v3-fp8":
        assert t["quantization_config"]["weight_block_size"] == [128, 128]


def test_unknown_engine_refused(tmp_path):
    with pytest.raises(ValueError, match="no drafter"):
        fulldepth.configs("kimi-k25-int4", ["plain", "medusa"], 61, tmp_path)


def _worker_trace(steps=4):
    """A worker trace as vLLM's torch profiler writes it: per step an execute
    range holding the target's forward (one graph replay of a 2 ms kernel),
    then a draft range of two passes (a graph replay of a 0.1 ms kernel, then
    aten::argmax), the GPU 5 ms behind the host."""
    cpu, gpu, ev, corr = {"pid": 9, "tid": 9}, {"pid": 0, "tid": 7}, [], [0]

    def x(cat, name, ts, dur, who=cpu, **args):
        ev.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **who, "args": args})

    def launch(ts, kernel, dur):
        corr[0] += 1
        x("cuda_runtime", "cudaGraphLaunch", ts, 5, correlation=corr[0])
        x("kernel", kernel, ts + 5000, dur, gpu, correlation=corr[0], grid=[8, 1, 1], block=[64, 1, 1])

    for i in range(steps):
        t = 10000.0 * i
        x("user_annotation", f"execute_context_0(0)_generation_{i}({i})", t, 3000)
        x("user_annotation", "gpu_model_runner: forward", t + 100, 2000)
        launch(t + 200, "marlin_moe", 2000)
        x("user_annotation", "gpu_model_runner: draft", t + 4000, 1000)
        for j in range(2):
            launch(t + 4100 + 400 * j, "drafter_piece", 100)
            x("cpu_op", "aten::argmax", t + 4300 + 400 * j, 50)
    return {"traceEvents": ev}


def test_a_profiled_batch_carries_its_breakdown_into_the_summary(tmp_path):
    (tmp_path / "rank0.1.pt.trace.json").write_text(json.dumps(_worker_trace()))
    steps = fulldepth._profiled_steps(tmp_path, set())
    assert steps["count"] == 2 and steps["median"]["gpu_kernel_ms"] > 0
    res = _res([10.0], [12.0])
    res["engines"]["eagle3"]["batches"]["8"]["profile"] = steps
    got = fulldepth.summarize(res)["8"]["eagle3"]["breakdown"]
    assert got["phases"]["forward"]["gpu_ms"] == pytest.approx(2.0)
    assert got["phases"]["draft pass 2"]["gpu_ms"] == pytest.approx(0.1)
    assert got["draft"] == {"gpu_ms": pytest.approx(0.2), "host_ms": pytest.approx(1.0), "passes": 2}
    assert got["top_kernels"][0]["name"] == "marlin_moe" and got["top_kernels"][0]["grid"] == [8, 1, 1]
    assert "breakdown" not in fulldepth.summarize(res)["8"]["plain"]  # no profile there


def test_summarize_command_carries_the_breakdown(tmp_path, capsys):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "rank0.1.pt.trace.json").write_text(json.dumps(_worker_trace()))
    res = _res([10.0], [12.0])
    res["engines"]["eagle3"]["batches"]["8"]["profile"] = fulldepth._profiled_steps(tmp_path / "t", set())
    (tmp_path / "r.json").write_text(json.dumps(res))
    assert fulldepth.main(["summarize", str(tmp_path / "r.json"), "--out", str(tmp_path / "s.json")]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((tmp_path / "s.json").read_text())["summary"]
    for s in (printed, written):
        assert s["8"]["eagle3"]["breakdown"]["phases"]["forward"]["gpu_ms"] == pytest.approx(2.0)


def test_a_breakdown_that_fails_keeps_the_step_times(tmp_path, monkeypatch):
    from tools.gpu_harness import step_trace

    def broken(*a, **k):
        raise KeyError("dur")

    monkeypatch.setattr(step_trace, "phase_breakdown", broken)
    (tmp_path / "rank0.1.pt.trace.json").write_text(json.dumps(_worker_trace()))
    steps = fulldepth._profiled_steps(tmp_path, set())
    assert steps["median"]["gpu_kernel_ms"] > 0 and "phases" not in steps
    assert steps["breakdown_error"] == "KeyError: 'dur'"


def _attention_trace(steps=4, kernels=(("_fwd_grouped_kernel_stage1", 300), ("_fwd_kernel_stage2", 50),
                                       ("marlin_moe", 2000))):
    """Steps of the named kernels (µs), one launch each, as the profiler writes them."""
    cpu, gpu, ev, corr = {"pid": 9, "tid": 9}, {"pid": 0, "tid": 7}, [], [0]

    def x(cat, name, ts, dur, who=cpu, **args):
        ev.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **who, "args": args})

    for i in range(steps):
        t = 10000.0 * i
        x("user_annotation", f"execute_context_0(0)_generation_{i}({i})", t, 3000)
        x("user_annotation", "gpu_model_runner: forward", t + 100, 2000)
        off = 200
        for name, dur in kernels:
            corr[0] += 1
            x("cuda_runtime", "cudaLaunchKernel", t + off, 5, correlation=corr[0])
            x("kernel", name, t + off + 100, dur, gpu, correlation=corr[0], grid=[1, 1, 1], block=[128, 1, 1])
            off += 10
    return {"traceEvents": ev}


def test_attention_kernels_against_the_kv_bandwidth_bound(tmp_path):
    (tmp_path / "rank0.1.pt.trace.json").write_text(json.dumps(_attention_trace()))
    steps = fulldepth._profiled_steps(tmp_path, set())
    assert steps["median"]["attn_decode_gpu_ms"] == pytest.approx(0.35)
    assert steps["median"]["attn_prefill_gpu_ms"] == 0.0
    res = _res([10.0], [12.0])
    res.update(layers=61, prompt_tokens=8192, prof_tokens=8)
    res["engines"]["eagle3"]["facts"] = {"copy_bandwidth_gbps": 3000.0}
    res["engines"]["eagle3"]["batches"]["8"]["profile"] = steps
    got = fulldepth.summarize(res)["8"]["eagle3"]["attention"]
    # 8 requests x (8192 + 8 / 2) tokens x 61 layers x 576 x 2 bytes at 3000 GB/s
    kv = 8 * (8192 + 4) * 61 * 576 * 2
    assert got["kv_read_mb"] == pytest.approx(kv / 1e6)
    assert got["kv_bound_ms"] == pytest.approx(kv / 3e12 * 1e3)
    assert got["over_bound"] == pytest.approx(0.35 / (kv / 3e12 * 1e3))


def test_prefill_kernels_count_as_attention(tmp_path):
    trace = _attention_trace(kernels=(("BatchPrefillWithRaggedKVCacheKernel<...>", 400),
                                      ("merge_attn_states_kernel", 20), ("gather_and_maybe_dequant_cache", 80),
                                      ("nvjet_gemm", 900)))
    (tmp_path / "rank0.1.pt.trace.json").write_text(json.dumps(trace))
    med = fulldepth._profiled_steps(tmp_path, set())["median"]
    assert med["attn_prefill_gpu_ms"] == pytest.approx(0.5) and med["attn_decode_gpu_ms"] == 0.0


def test_one_result_file_per_context_and_distinct_prompts(tmp_path):
    assert fulldepth.result_path(tmp_path, "m", "_t", 16, [16]).name == "fulldepth_m_t.json"
    assert fulldepth.result_path(tmp_path, "m", "_t", 8192, [128, 8192]).name == "fulldepth_m_t_ctx8192.json"
    p = fulldepth.prompts_for(300, 4)
    assert [len(x["prompt_token_ids"]) for x in p] == [300] * 4
    assert len({tuple(x["prompt_token_ids"][:64]) for x in p}) == 4  # no shared prefix block
    assert max(t for x in p for t in x["prompt_token_ids"]) < 163840 // 8  # the rank's vocabulary share


def test_a_run_that_fits_no_cell_stops_before_loading(tmp_path, capsys):
    # an H100's 79.19 GiB: 32k context at batch 8 needs the H200
    with pytest.raises(SystemExit, match=r"no cell fits H100.*GiB short"):
        fulldepth.run("kimi-k25-int4", ["plain"], tmp_path, batches=[8], contexts=[32768],
                      card=(int(79.19 * 2**30), int(78.6 * 2**30), "H100"))
    assert "SKIP context x batch 32768x8: does not fit H100" in capsys.readouterr().out
