# SPDX-License-Identifier: Apache-2.0
"""step_trace.step_breakdown reads a real torch-profiler trace: the CPU
time and call count of each of vLLM's runner ranges agree with the
profiler's own aggregation (key_averages). Not marked ``gpu``: on CPU the
trace has no CUDA launches, which the GPU run (``step_profile.py``)
adds."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import bench_eagle3
from tools.gpu_harness import step_trace


def test_breakdown_matches_the_profilers_own_totals(tmp_path):
    x = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with record_function("gpu_model_runner: forward"):
                y = x @ x
            with record_function("gpu_model_runner: sample"):
                y.softmax(-1)
        with record_function("gpu_model_runner: draft"):
            for _ in range(4):
                y = y @ x
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    got = step_trace.step_breakdown(json.loads(path.read_text()))["ranges"]
    want = {e.key[len(step_trace.RUNNER_RANGES):]: e for e in prof.key_averages()
            if e.key.startswith(step_trace.RUNNER_RANGES)}
    assert set(got) == set(want) == {"forward", "sample", "draft"}
    for name, e in want.items():
        assert got[name]["count"] == e.count
        assert got[name]["cpu_ms"] == pytest.approx(e.cpu_time_total / 1000, rel=0.02)
        assert got[name]["graph_launches"] == got[name]["kernel_launches"] == 0


def test_steps_split_each_period_at_the_end_of_execute(tmp_path):
    """Five worker steps, each an execute range followed by 3 ms of work
    outside it (as sampling and drafting follow execute_model in vLLM 0.16):
    the median execute time is the profiler's own, and the after-execute part
    holds the 3 ms. The first and last periods are dropped."""
    import time

    x = torch.randn(128, 128)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(5):
            with record_function(f"{step_trace.STEP_RANGE}0(0)_generation_{i}(1)"):
                for _ in range(20):
                    x = (x @ x).tanh()
            time.sleep(0.003)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    got = step_trace.step_breakdown(json.loads(path.read_text()))["steps"]
    assert got["count"] == 3
    med = got["median"]
    own = [e for e in prof.key_averages() if e.key.startswith(step_trace.STEP_RANGE)]
    own_ms = sorted(e.cpu_time_total / 1000 for e in own)
    assert own_ms[0] * 0.9 <= med["execute_ms"] <= own_ms[-1] * 1.1
    # The 3 ms sleep, plus what little the loop does outside the range (a
    # loaded 2-core CI machine stretches it; medians of the parts need not
    # add up to the median period, so each is bounded on its own).
    assert 3.0 <= med["after_execute_ms"] < 3.0 + 50
    assert own_ms[0] * 0.9 + 3.0 <= med["period_ms"] <= own_ms[-1] * 1.1 + 3.0 + 50
    assert med["gpu_kernel_ms"] == 0 and got["median"]["gpu_busy_fraction"] == 0


@pytest.mark.parametrize("extra", [
    ["--profile", "production", "--kind", next(iter(bench_eagle3.DSA_KINDS))],  # speed reads the DeepSeek-V3 pair
    ["--profile", "smoke"],  # speed is a production measurement
])
def test_all_with_speed_refuses_what_speed_does_not_measure(tmp_path, monkeypatch, extra):
    """``all --speed`` is refused before any training for a target ``speed``
    cannot load, or settings other than production."""
    monkeypatch.delenv("EAGLE3_GPU_PROFILE", raising=False)
    with pytest.raises(SystemExit) as e:
        bench_eagle3.main(["all", "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w"),
                           "--speed", *extra])
    assert e.value.code == 2
    assert not (tmp_path / "w").exists()


def test_worker_trace_reads_the_worker_file_not_seen_yet(tmp_path):
    # vLLM's torch profiler writes one trace per start/stop window and process,
    # gzipped or not, under a name that holds the worker's rank.
    import gzip

    (tmp_path / "engine_core.json").write_text(json.dumps({"who": "engine"}))
    (tmp_path / "rank0.1.pt.trace.json").write_text(json.dumps({"who": "first"}))
    with gzip.open(tmp_path / "rank0.2.pt.trace.json.gz", "wt") as f:
        json.dump({"who": "second"}, f)
    path, trace = step_trace.worker_trace(tmp_path)
    assert trace == {"who": "first"}
    path, trace = step_trace.worker_trace(tmp_path, {path})
    assert trace == {"who": "second"} and path.endswith(".gz")
    with pytest.raises(RuntimeError, match="no trace"):
        step_trace.worker_trace(tmp_path / "none")


class _Trace:
    """A worker trace as vLLM 0.16's torch profiler writes it (Chrome trace
    events, ph "X", microseconds): the runner's ranges (user_annotation) and
    ops (cpu_op) on the worker thread, its CUDA calls (cuda_runtime,
    cuda_driver), and on the GPU stream the kernels, copies and fills each
    call started, named by args.correlation, plus the profiler's mirror of
    each range on the GPU timeline (gpu_user_annotation)."""

    CPU = {"pid": 4242, "tid": 4242}
    GPU = {"pid": 0, "tid": 7}

    def __init__(self, lag_us: float):
        self.events, self.corr, self.gpu_free = [], 1000, 0.0
        self.lag = lag_us  # the GPU runs this far behind the host

    def range(self, name, ts, dur, cat="user_annotation"):
        self.events.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **self.CPU,
                            "args": {"External id": len(self.events)}})
        self.events.append({"ph": "X", "cat": "gpu_user_annotation", "name": name, "ts": ts + self.lag,
                            "dur": dur, **self.GPU, "args": {}})

    def op(self, name, ts, dur):
        self.events.append({"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, **self.CPU,
                            "args": {"External id": len(self.events)}})

    def launch(self, ts, gpu, call="cudaLaunchKernel", cat="cuda_runtime"):
        """A host call at ts that starts ``gpu``: [(name, dur, cat, grid, block)]."""
        self.corr += 1
        self.events.append({"ph": "X", "cat": cat, "name": call, "ts": ts, "dur": 4, **self.CPU,
                            "args": {"correlation": self.corr, "cbid": 211}})
        start = max(ts + self.lag, self.gpu_free)
        for name, dur, gcat, grid, block in gpu:
            args = {"correlation": self.corr, "device": 0, "stream": 7}
            if gcat == "kernel":
                args.update({"grid": grid, "block": block, "registers per thread": 64})
            self.events.append({"ph": "X", "cat": gcat, "name": name, "ts": start, "dur": dur, **self.GPU,
                                "args": args})
            start += dur + 1
        self.gpu_free = start

    def doc(self):
        return {"schemaVersion": 1, "traceEvents": [*self.events, {"ph": "M", "name": "process_name", "pid": 0}]}


def _k(name, dur, grid=(132, 1, 1), block=(128, 1, 1)):
    return (name, dur, "kernel", list(grid), list(block))


def _eagle_trace(scale=(1.0, 1.0, 1.0, 1.0, 1.0), k=3, lag_us=3000.0, graphs=True):
    """Five worker steps of an EAGLE-3 runner (so three periods are kept):
    execute (preprocess with a host-to-device copy, forward as one graph
    replay of three kernels), then sample (rejection sampler), draft (k
    passes, each: an input kernel, then a PIECEWISE forward: graph, eager
    attention, graph, lm_head and argmax; then the drafts' copy to the host),
    bookkeep, and one launch outside any range. The GPU runs ``lag_us``
    behind the host, so a kernel's own time stamp lies in a later phase than
    its launch. Step i's forward kernels take ``scale[i]`` x their base time."""
    t = _Trace(lag_us)
    ts = 0.0
    for i in range(5):
        s = scale[i]
        t.range(f"execute_context_0(0)_generation_{4 * (i + 1)}({4 * (i + 1)})", ts, 900)
        t.range("gpu_model_runner: preprocess", ts + 10, 500)
        t.launch(ts + 300, [("Memcpy HtoD (Pageable -> Device)", 12, "gpu_memcpy", None, None)],
                 call="cudaMemcpyAsync")
        t.launch(ts + 400, [_k("prepare_inputs_kernel", 8)], call="cuLaunchKernel", cat="cuda_driver")
        t.range("gpu_model_runner: forward", ts + 520, 300)
        t.launch(ts + 600, [_k("fused_marlin_moe", 2000 * s, (256, 1, 1), (256, 1, 1)),
                            _k("flash_mla_fwd", 500 * s, (16, 8, 1)), _k("fused_marlin_moe", 1000 * s,
                                                                          (256, 1, 1), (256, 1, 1))],
                 call="cudaGraphLaunch")
        ts += 920
        t.range("gpu_model_runner: sample", ts, 200)
        t.launch(ts + 150, [_k("rejection_greedy_sample_kernel", 40)], call="cuLaunchKernel", cat="cuda_driver")
        ts += 220
        t.range("gpu_model_runner: draft", ts, 400 * k + 100)
        p = ts
        for j in range(k):
            t.launch(p + 20, [_k(f"slot_mapping_{j + 1}", 5)])
            call = "cudaGraphLaunch" if graphs else "cudaLaunchKernel"
            t.launch(p + 100, [_k("llama_pre_attn", 70)], call=call)
            t.launch(p + 150, [_k("flash_attn_fwd", 30 + 10 * j)])
            t.launch(p + 200, [_k("llama_post_attn", 90)], call=call)
            t.launch(p + 250, [_k("lm_head_gemm", 60)])
            t.op("aten::argmax", p + 300, 50)
            t.launch(p + 320, [_k("argmax_kernel", 4)])
            p += 400
        t.launch(p + 30, [_k("stack_kernel", 3), ("Memcpy DtoH (Device -> Pinned)", 2, "gpu_memcpy", None, None)])
        ts += 400 * k + 120
        t.range("gpu_model_runner: bookkeep", ts, 150)
        ts += 200
        t.launch(ts, [("Memset (Device)", 1, "gpu_memset", None, None)], call="cudaMemsetAsync")
        ts += 300
    return t


def _phases(trace):
    return step_trace.step_breakdown(trace.doc())["steps"]


def test_each_gpu_kernel_counts_to_the_phase_that_launched_it():
    """The GPU lags the host by 3 ms, so every kernel's own time stamp lies in
    a later phase (or step) than its launch: only the correlation to the
    launch puts the forward's 3.5 ms in forward, not in draft."""
    got = _phases(_eagle_trace())
    ph = got["phases"]
    assert list(ph) == ["preprocess", "forward", "sample",
                        *[x for j in (1, 2, 3) for x in (f"draft pass {j} inputs", f"draft pass {j}")],
                        "draft tail", "bookkeep", step_trace.OUTSIDE]
    assert ph["forward"]["gpu_ms"] == pytest.approx(3.5)
    assert ph["forward"]["graph_launches"] == 1 and ph["forward"]["launches"] == 1
    assert ph["preprocess"]["gpu_ms"] == pytest.approx(0.020)  # the copy and the prepare kernel
    assert ph["sample"]["gpu_ms"] == pytest.approx(0.040)
    for j in (1, 2, 3):
        assert ph[f"draft pass {j} inputs"]["gpu_ms"] == pytest.approx(0.005)
        # two graph pieces, eager attention (30, 40, 50 us), lm_head, argmax
        assert ph[f"draft pass {j}"]["gpu_ms"] == pytest.approx((70 + 30 + 10 * (j - 1) + 90 + 60 + 4) / 1000)
        assert ph[f"draft pass {j}"]["graph_launches"] == 2 and ph[f"draft pass {j}"]["launches"] == 5
    assert ph["draft tail"]["gpu_ms"] == pytest.approx(0.005)
    assert ph["bookkeep"]["gpu_ms"] == 0 and ph["bookkeep"]["launches"] == 0
    assert ph[step_trace.OUTSIDE]["gpu_ms"] == pytest.approx(0.001)
    assert got["unmatched_gpu_ms"] == 0
    # Every GPU event of a kept step is in exactly one phase.
    assert sum(p["gpu_ms"] for p in ph.values()) == pytest.approx(3.5 + 0.020 + 0.040 + 3 * 0.005 + 0.792
                                                                  + 0.005 + 0.001)


def test_host_time_per_phase_and_before_its_first_launch():
    ph = _phases(_eagle_trace())["phases"]
    assert ph["preprocess"]["host_ms"] == pytest.approx(0.5)
    assert ph["preprocess"]["host_before_launch_ms"] == pytest.approx(0.29)  # 10 -> 300 us
    assert ph["forward"]["host_ms"] == pytest.approx(0.3)
    assert ph["forward"]["host_before_launch_ms"] == pytest.approx(0.08)
    assert ph["sample"]["host_before_launch_ms"] == pytest.approx(0.15)
    # pass 1 starts with the draft range, passes 2 and 3 at the previous argmax's end
    assert ph["draft pass 1 inputs"]["host_ms"] == pytest.approx(0.1)
    assert ph["draft pass 1 inputs"]["host_before_launch_ms"] == pytest.approx(0.02)
    assert ph["draft pass 2 inputs"]["host_ms"] == pytest.approx(0.15)  # 350 -> 500 us
    assert ph["draft pass 2 inputs"]["host_before_launch_ms"] == pytest.approx(0.07)
    assert ph["draft pass 1"]["host_ms"] == pytest.approx(0.25)  # first graph at 100 us, argmax ends at 350
    assert ph["draft tail"]["host_ms"] == pytest.approx(0.15)
    # a step's period is 2960 us; its runner ranges hold 500 + 300 + 200 + 1300 + 150
    assert ph[step_trace.OUTSIDE]["host_ms"] == pytest.approx((2960 - 2450) / 1000)
    assert "host_before_launch_ms" not in ph[step_trace.OUTSIDE]


def test_phase_times_are_medians_over_the_kept_steps():
    # Steps 0 and 4 are dropped; the kept ones scale the forward by 1.2, 0.8, 2.0.
    ph = _phases(_eagle_trace(scale=(9.0, 1.2, 0.8, 2.0, 9.0)))["phases"]
    assert ph["forward"]["gpu_ms"] == pytest.approx(3.5 * 1.2)


def test_passes_follow_the_argmax_count():
    ph = _phases(_eagle_trace(k=2))["phases"]
    assert "draft pass 2" in ph and "draft pass 3" not in ph and "draft pass 3 inputs" not in ph
    assert ph["draft pass 2"]["gpu_ms"] == pytest.approx((70 + 40 + 90 + 60 + 4) / 1000)


def test_an_eager_drafter_keeps_its_passes_whole():
    """With no graph replay in a pass, its inputs cannot be told from its
    forward: the pass is one phase."""
    ph = _phases(_eagle_trace(graphs=False))["phases"]
    assert "draft pass 1 inputs" not in ph
    assert ph["draft pass 1"]["gpu_ms"] == pytest.approx((5 + 70 + 30 + 90 + 60 + 4) / 1000)


def test_top_kernels_name_their_calls_time_and_shape():
    top = _phases(_eagle_trace())["top_kernels"]
    assert top[0] == {"name": "fused_marlin_moe", "cat": "kernel", "grid": [256, 1, 1], "block": [256, 1, 1],
                      "calls_per_step": 2, "ms_per_step": pytest.approx(3.0), "phase": "forward"}
    assert (top[1]["name"], top[1]["ms_per_step"], top[1]["grid"]) == ("flash_mla_fwd", pytest.approx(0.5),
                                                                       [16, 8, 1])
    attn = next(x for x in top if x["name"] == "flash_attn_fwd")
    assert attn["calls_per_step"] == 3 and attn["ms_per_step"] == pytest.approx(0.12)
    assert attn["phase"] == "draft pass 3"  # 50 us of its 120 launched there
    assert [x["ms_per_step"] for x in top] == sorted((x["ms_per_step"] for x in top), reverse=True)


def test_gpu_work_without_its_launch_is_reported_not_attributed():
    t = _eagle_trace(lag_us=100.0)
    lost = [e for e in t.events if e["name"] == "rejection_greedy_sample_kernel"]
    for i, e in enumerate(lost):
        e["args"]["correlation"] = 999000 + i
    steps = sorted(e["ts"] for e in t.events if e["name"].startswith(step_trace.STEP_RANGE)
                   and e["cat"] == "user_annotation")
    kept = [e["dur"] for e in lost if steps[1] <= e["ts"] < steps[-1]]
    assert kept  # the kept steps ran some of them
    got = _phases(t)
    assert got["unmatched_gpu_ms"] == pytest.approx(sum(kept) / 1000 / 3)
    assert got["phases"]["sample"]["gpu_ms"] == 0 and got["phases"]["sample"]["launches"] == 0


def test_ranges_leave_out_the_profilers_gpu_mirror():
    got = step_trace.step_breakdown(_eagle_trace().doc())["ranges"]
    assert got["forward"]["count"] == 5 and got["forward"]["cpu_ms"] == pytest.approx(1.5)


def test_a_real_trace_splits_the_draft_range_at_each_argmax(tmp_path):
    """torch.profiler's own trace (CPU only): the draft range of each step
    splits into three passes and a tail that tile it exactly, each pass
    ending where the profiler's aten::argmax ends."""
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(5):
            with record_function(f"{step_trace.STEP_RANGE}0(0)_generation_{i}(1)"):
                with record_function("gpu_model_runner: forward"):
                    x = (x @ x).tanh()
            with record_function("gpu_model_runner: draft"):
                for _ in range(3):
                    (x @ x).argmax(dim=-1)
                torch.stack([x, x])
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    ph = step_trace.step_breakdown(trace)["steps"]["phases"]
    assert list(ph) == ["forward", "draft pass 1", "draft pass 2", "draft pass 3", "draft tail", step_trace.OUTSIDE]
    events = trace["traceEvents"]
    drafts = sorted((e for e in events if e.get("name") == "gpu_model_runner: draft"), key=lambda e: e["ts"])[1:4]
    argmax = sorted((e for e in events if e.get("name") == "aten::argmax"), key=lambda e: e["ts"])[3:12]
    # medians over the three kept steps of what the profiler wrote
    first = [(a["ts"] + a["dur"] - d["ts"]) / 1000 for d, a in zip(drafts, argmax[0::3])]
    tail = [(d["ts"] + d["dur"] - a["ts"] - a["dur"]) / 1000 for d, a in zip(drafts, argmax[2::3])]
    assert ph["draft pass 1"]["host_ms"] == pytest.approx(sorted(first)[1], abs=1e-6)
    assert ph["draft tail"]["host_ms"] == pytest.approx(sorted(tail)[1], abs=1e-6)
