# SPDX-License-Identifier: Apache-2.0
"""The speculative config every harness engine serves (gpu_e2e_helpers.
spec_config): where vllm_flash_attn is not built (the registry build), a
Llama-architecture drafter gets TRITON_ATTN, since v0.16.0 picks FLASH_ATTN
for it from the capability alone and its first forward then fails
("FlashAttention version not detected", an H100, 2026-12-07); an MLA
drafter picks its own MLA backend; EAGLE3_GPU_DRAFTER_BACKEND overrides."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest

import gpu_e2e_helpers as h


@pytest.fixture
def drafters(tmp_path):
    out = {}
    for name, model_type in (("llama", "llama"), ("mla", "deepseek_v3")):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": model_type}))
        out[name] = d
    return out


@pytest.fixture
def vllm_tree(tmp_path, monkeypatch):
    """A vllm package directory the check finds instead of the installed one;
    ``built(True)`` lays vllm_flash_attn's library into it."""
    root = tmp_path / "site" / "vllm"
    (root / "vllm_flash_attn").mkdir(parents=True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: SimpleNamespace(submodule_search_locations=[str(root)])
                        if name == "vllm" else real(name, *a))

    def built(yes: bool):
        lib = root / "vllm_flash_attn" / "_vllm_fa2_C.abi3.so"
        lib.write_bytes(b"") if yes else lib.unlink(missing_ok=True)

    return built


def test_llama_drafter_gets_triton_attn_without_flash_attention(drafters, vllm_tree, monkeypatch):
    monkeypatch.delenv("EAGLE3_GPU_DRAFTER_BACKEND", raising=False)
    vllm_tree(False)
    assert not h.flash_attn_built()
    assert h.spec_config(drafters["llama"], 3) == {"method": "eagle3", "model": str(drafters["llama"]),
                                                   "num_speculative_tokens": 3, "attention_backend": "TRITON_ATTN"}
    assert "attention_backend" not in h.spec_config(drafters["mla"])
    kw = h.engine_kwargs("target", drafters["llama"])
    assert kw["speculative_config"]["attention_backend"] == "TRITON_ATTN"


def test_vllms_choice_where_flash_attention_is_built(drafters, vllm_tree, monkeypatch):
    monkeypatch.delenv("EAGLE3_GPU_DRAFTER_BACKEND", raising=False)
    vllm_tree(True)
    assert h.flash_attn_built()
    assert "attention_backend" not in h.spec_config(drafters["llama"])


def test_the_environment_overrides(drafters, vllm_tree, monkeypatch):
    vllm_tree(False)
    monkeypatch.setenv("EAGLE3_GPU_DRAFTER_BACKEND", "FLASHINFER")
    assert h.spec_config(drafters["mla"])["attention_backend"] == "FLASHINFER"
    monkeypatch.setenv("EAGLE3_GPU_DRAFTER_BACKEND", "auto")
    assert "attention_backend" not in h.spec_config(drafters["llama"])


def test_the_server_and_the_serving_suite_use_it(drafters, vllm_tree, monkeypatch):
    monkeypatch.delenv("EAGLE3_GPU_DRAFTER_BACKEND", raising=False)
    vllm_tree(False)
    import test_eagle3_serving as ts

    pair = SimpleNamespace(target="t", drafter=drafters["llama"], extra=[])
    args = ts.server_args(pair, None)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["attention_backend"] == "TRITON_ATTN"
