# SPDX-License-Identifier: Apache-2.0
"""tools/gpu_harness/fi_prefill.py on CPU: the harness switch that sends MLA
prefill on Hopper to FlashInfer. The wrapper asks FlashInfer for its sm90
template where vLLM asks for ``cutlass`` and returns the log-sum-exp in the
natural log; the gate opens on capability 9.x only for the shapes vLLM's own
gate accepts; the import hook changes vLLM's real MLA module as it loads.
The kernels themselves run on the GPU (prefill_probe.py)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[3] / "tools" / "gpu_harness"
sys.path.insert(0, str(HARNESS))
import fi_prefill  # noqa: E402


class _FakeRagged:
    """FlashInfer's wrapper as vLLM uses it: backend chosen at construction,
    run returns (out, lse) with return_lse."""

    def __init__(self, workspace, layout, backend="auto"):
        self.backend = backend

    def run(self, q, k, v, return_lse=False):
        return (q, [2.0, 1.0]) if return_lse else q


class _Lse(list):
    def __mul__(self, x):
        return _Lse(v * x for v in self)


def test_wrapper_maps_cutlass_to_the_hopper_template_and_converts_lse():
    class Base(_FakeRagged):
        def run(self, q, k, v, return_lse=False):
            return (q, _Lse([2.0, 1.0])) if return_lse else q

    w = fi_prefill.ragged_wrapper(Base, "fa3")(None, "NHD", backend="cutlass")
    assert w.backend == "fa3"
    out, lse = w.run(q="o", k=None, v=None, return_lse=True)
    assert out == "o" and lse == pytest.approx([2 * math.log(2), math.log(2)])
    assert w.run(q="o", k=None, v=None) == "o"
    # A backend other than vLLM's sm100 one is left as asked.
    assert fi_prefill.ragged_wrapper(Base, "fa2")(None, "NHD", backend="auto").backend == "auto"


def test_backend_switch_refuses_an_unknown_template(monkeypatch):
    monkeypatch.delenv("EAGLE3_HARNESS_FI_PREFILL_BACKEND", raising=False)
    assert fi_prefill.backend() == "fa2"  # prefill_probe.py's choice
    monkeypatch.setenv("EAGLE3_HARNESS_FI_PREFILL_BACKEND", "fa3")
    assert fi_prefill.backend() == "fa3"
    monkeypatch.setenv("EAGLE3_HARNESS_FI_PREFILL_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="use one of"):
        fi_prefill.backend()


def _mla(compatible: bool):
    return types.SimpleNamespace(use_flashinfer_prefill=lambda: False,
                                 is_deepseek_r1_mla_compatible=lambda cfg: compatible)


@pytest.mark.parametrize("family,compatible,want", [(90, True, True), (90, False, False), (80, True, False)])
def test_gate_opens_on_hopper_for_the_shapes_vllm_accepts(monkeypatch, family, compatible, want):
    import vllm.utils.flashinfer as vfi
    from vllm.platforms import current_platform

    fake_fi = types.ModuleType("flashinfer")
    fake_fi.BatchPrefillWithRaggedKVCacheWrapper = _FakeRagged
    monkeypatch.setitem(sys.modules, "flashinfer", fake_fi)
    monkeypatch.setattr(current_platform, "is_device_capability_family", lambda f, *a, **k: f == family,
                        raising=False)
    monkeypatch.setattr(vfi, "has_flashinfer", lambda: True)
    from vllm.config import VllmConfig, set_current_vllm_config

    mla = _mla(compatible)
    fi_prefill.patch_mla_module(mla)
    with set_current_vllm_config(VllmConfig()):
        assert mla.use_flashinfer_prefill() is want
    assert fake_fi.BatchPrefillWithRaggedKVCacheWrapper(None, "NHD", backend="cutlass").backend == "fa2"
    # Twice is once.
    fi_prefill.patch_mla_module(mla)
    assert fake_fi.BatchPrefillWithRaggedKVCacheWrapper.__bases__ == (_FakeRagged,)


def test_import_hook_changes_vllms_mla_module_as_it_loads(tmp_path: Path):
    """In a fresh interpreter, as sitecustomize runs it: install() first, then
    vLLM imports its MLA module, which comes out with the switch in place."""
    (tmp_path / "flashinfer.py").write_text("class BatchPrefillWithRaggedKVCacheWrapper:\n"
                                            "    def __init__(self, *a, backend='auto'): self.backend = backend\n")
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(HARNESS)!r}, {str(tmp_path)!r}]
        import fi_prefill
        fi_prefill.install()
        import flashinfer
        from vllm.model_executor.layers.attention import mla_attention as mla
        assert mla.use_flashinfer_prefill.eagle3_harness
        assert mla.EAGLE3_HARNESS_FI_PREFILL == "fa2"
        assert flashinfer.BatchPrefillWithRaggedKVCacheWrapper(None, backend="cutlass").backend == "fa2"
        print("hooked")
    """)
    r = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 0 and "hooked" in r.stdout, r.stdout + r.stderr[-3000:]
