# SPDX-License-Identifier: Apache-2.0
"""A harness switch: MLA prefill on Hopper through FlashInfer, for a build without FlashAttention-3.

vLLM 0.16.0 runs MLA prefill (and so every EAGLE-3 verify on TRITON_MLA,
whose decode takes one token a request) on ``vllm_flash_attn`` alone on
Hopper: ``mla_attention.py`` raises "MLA attention requires FlashAttention"
without it. Its FlashInfer prefill path (``use_flashinfer_prefill``, the
``_run_prefill_*_fi`` methods) is gated to compute capability family 100,
where it builds ``BatchPrefillWithRaggedKVCacheWrapper(..., backend="cutlass")``.
vLLM's flash-attention fork has no registry release, so the registry-only
harness opens that gate on capability 9.x, for the DeepSeek-R1 MLA shape the
gate already requires (qk 128 + 64, v 128), and maps the wrapper's backend to
FlashInfer's sm80 template (``fa2``; ``EAGLE3_HARNESS_FI_PREFILL_BACKEND=fa3``
picks its sm90 one): prefill_probe.py's choice, both being correct at these
shapes and fa2 the faster to plan and run the EAGLE-3 verify shapes
(results/2026-12-05_h100_prefill_probe.json). FlashInfer's fa2/fa3
templates return the log-sum-exp in base 2
(``row_max * sm_scale * log2(e) + log2(sum)``), where vLLM's
``merge_attn_states`` and the ``cutlass`` backend use the natural log, so
the wrapper returns it times ln 2.

Installed by device_setup.sh as ``_eagle3_fi_prefill.py`` beside vLLM and
activated at interpreter start-up by the harness's sitecustomize when
``EAGLE3_HARNESS_FI_PREFILL=1``: an import hook changes
``vllm.model_executor.layers.attention.mla_attention`` right after it is
loaded, so every process vLLM starts gets it. vLLM's own files stay as the
series left them. Standard library at import time; imports no other harness
module.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import math
import os
import sys

MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"
LN2 = math.log(2.0)
BACKENDS = ("fa2", "fa3")
DEFAULT_BACKEND = "fa2"  # prefill_probe.py's choice


def backend() -> str:
    name = os.environ.get("EAGLE3_HARNESS_FI_PREFILL_BACKEND", DEFAULT_BACKEND)
    if name not in BACKENDS:
        raise ValueError(f"EAGLE3_HARNESS_FI_PREFILL_BACKEND={name!r}: use one of {BACKENDS}")
    return name


def ragged_wrapper(base, backend_name: str):
    """``base`` (FlashInfer's BatchPrefillWithRaggedKVCacheWrapper) with the
    ``cutlass`` backend vLLM asks for replaced by ``backend_name``, and the
    log-sum-exp it returns converted from base 2 to the natural log."""

    class HopperRaggedPrefill(base):
        def __init__(self, *args, **kwargs):
            if kwargs.get("backend") == "cutlass":
                kwargs["backend"] = backend_name
            super().__init__(*args, **kwargs)

        def run(self, *args, **kwargs):
            out = super().run(*args, **kwargs)
            if isinstance(out, tuple):
                o, lse = out
                return o, lse * LN2
            return out

    HopperRaggedPrefill.__name__ = HopperRaggedPrefill.__qualname__ = f"HopperRaggedPrefill[{backend_name}]"
    return HopperRaggedPrefill


def patch_mla_module(mla) -> None:
    """Open ``use_flashinfer_prefill`` on capability 9.x and point FlashInfer's
    ragged wrapper at the Hopper template."""
    import flashinfer
    from vllm.platforms import current_platform

    original = mla.use_flashinfer_prefill
    if getattr(original, "eagle3_harness", False):
        return
    name = backend()

    def use_flashinfer_prefill() -> bool:
        if original():
            return True
        from vllm.config import get_current_vllm_config
        from vllm.utils.flashinfer import has_flashinfer

        cfg = get_current_vllm_config()
        return (not cfg.attention_config.disable_flashinfer_prefill and has_flashinfer()
                and not cfg.attention_config.use_cudnn_prefill
                and current_platform.is_device_capability_family(90)
                and mla.is_deepseek_r1_mla_compatible(cfg))

    use_flashinfer_prefill.eagle3_harness = True
    mla.use_flashinfer_prefill = use_flashinfer_prefill
    mla.EAGLE3_HARNESS_FI_PREFILL = name
    if not getattr(flashinfer.BatchPrefillWithRaggedKVCacheWrapper, "eagle3_harness", False):
        wrapper = ragged_wrapper(flashinfer.BatchPrefillWithRaggedKVCacheWrapper, name)
        wrapper.eagle3_harness = True
        flashinfer.BatchPrefillWithRaggedKVCacheWrapper = wrapper


class _Finder(importlib.abc.MetaPathFinder):
    """Runs ``patch_mla_module`` on the MLA module as soon as it is loaded."""

    def find_spec(self, fullname, path, target=None):
        if fullname != MLA_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                exec_module(module)
                patch_mla_module(module)

        spec.loader = _Loader()
        return spec


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    if MLA_MODULE in sys.modules:  # already loaded: change it in place
        patch_mla_module(sys.modules[MLA_MODULE])
