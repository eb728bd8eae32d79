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
