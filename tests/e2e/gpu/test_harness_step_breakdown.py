# SPDX-License-Identifier: Apache-2.0
"""bench_eagle3.step_breakdown reads a real torch-profiler trace: the CPU
time and call count of each of vLLM's runner ranges agree with the
profiler's own aggregation (key_averages). Not marked ``gpu``: on CPU the
trace has no CUDA launches, which the GPU run (``bench_eagle3.py profile``)
adds."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import bench_eagle3


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
    got = bench_eagle3.step_breakdown(json.loads(path.read_text()))["ranges"]
    want = {e.key[len(bench_eagle3.RUNNER_RANGES):]: e for e in prof.key_averages()
            if e.key.startswith(bench_eagle3.RUNNER_RANGES)}
    assert set(got) == set(want) == {"forward", "sample", "draft"}
    for name, e in want.items():
        assert got[name]["count"] == e.count
        assert got[name]["cpu_ms"] == pytest.approx(e.cpu_time_total / 1000, rel=0.02)
        assert got[name]["graph_launches"] == got[name]["kernel_launches"] == 0
