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
