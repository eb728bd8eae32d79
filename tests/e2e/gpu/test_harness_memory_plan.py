# SPDX-License-Identifier: Apache-2.0
"""tools/gpu_harness/memory_plan.py: a 61-layer rank share's memory, counted
from its config before anything loads, against what vLLM measured loading
it; and the plan fulldepth.py sizes its engine with, or refuses."""

from __future__ import annotations

import json

import pytest

from tools.gpu_harness import memory_plan as mp
from tools.gpu_harness import project as pj

GIB = 1 << 30
H100 = (int(79.19 * GIB), int(78.6 * GIB))  # total, free as nvidia-smi reports an idle H100 80GB HBM3
H200 = (int(139.8 * GIB), int(139.3 * GIB))


def test_kimi_int4_weights_as_vllm_loaded_them():
    # vLLM 0.16.0 on an H100, registry build, 2026-12-07: "Model loading took
    # 71.13 GiB memory" for one TP-8 rank's share of Kimi-K2.5 INT4 at 61 layers
    got = mp.weight_bytes(pj.target_geometry("kimi-k25-int4", 61)) / GIB
    assert got == pytest.approx(71.13, rel=0.01)


def test_weights_follow_the_quantization():
    bf16 = mp.weight_bytes(pj.target_geometry("deepseek-v3", 61))
    fp8 = mp.weight_bytes(pj.target_geometry("deepseek-v3-fp8", 61))
    int4 = mp.weight_bytes(pj.target_geometry("kimi-k25-int4", 61))
    assert 1.9 < bf16 / fp8 < 2.0  # fp8 halves all but norms, router, embedding and scales
    assert int4 < fp8 < bf16
    assert mp.weight_bytes(pj.target_geometry("kimi-k25-int4", 4)) < int4 / 10


def test_kv_tokens_in_whole_blocks_for_the_largest_cell():
    # (8192 + 64 + 3 + 1) -> 130 blocks of 64 a request
    assert mp.kv_tokens([8192], [1], 64, 3) == 130 * 64
    assert mp.kv_tokens([128, 8192], [1, 8], 64, 3) == 8 * 130 * 64
    assert mp.kv_bytes_per_token(pj.target_geometry("kimi-k25-int4", 61)) == 61 * 576 * 2


def _plan(card, contexts, batches, drafter=True):
    return mp.plan(pj.target_geometry("kimi-k25-int4", 61), contexts, batches, 64, 3, *card, drafter=drafter)


def test_the_h100_holds_short_contexts_and_8k_at_batch_1():
    for contexts, batches in (([128], [1, 8, 32]), ([8192], [1])):
        p = _plan(H100, contexts, batches)
        assert p["fits"] and p["need_gib"] <= 0.95 * 79.19
        assert p["kv_cache_memory_bytes"] >= mp.kv_tokens(contexts, batches, 64, 3) * 61 * 576 * 2
        assert p["gpu_memory_utilization"] <= 0.95


def test_a_context_the_card_cannot_hold_is_refused_naming_the_shortfall():
    p = _plan(H100, [32768], [8])
    assert not p["fits"] and p["shortfall_gib"] > 10
    assert p["reason"].endswith(f"{p['shortfall_gib']:.1f} GiB short")
    assert "KV 18." in p["reason"]  # 8 x 32,896 tokens x 70,272 bytes
    assert _plan(H200, [32768], [8])["fits"]


def test_free_memory_bounds_the_plan():
    taken = (H100[0], int(40 * GIB))  # another process holds half the card
    assert not _plan(taken, [128], [1])["fits"]


def test_cells_that_do_not_fit_are_skipped_one_by_one():
    plan, cells, skipped = mp.plan_cells(pj.target_geometry("kimi-k25-int4", 61), [128, 8192, 32768],
                                         [1, 8, 32], 64, 3, *H100, drafter=True)
    assert cells == [(128, 1), (128, 8), (128, 32), (8192, 1)]
    assert set(skipped) == {"8192x8", "8192x32", "32768x1", "32768x8", "32768x32"}
    assert all(w.endswith("GiB short") for w in skipped.values())
    # sized for the largest cell that runs: 8192 at batch 1 (130 blocks) over 128 at 32 (32 x 4 blocks)
    assert plan["kv_tokens"] == 130 * 64


@pytest.mark.parametrize("engine", ["llama", "mla"])
def test_an_eagle3_engine_gets_the_kv_vllm_asks_for_one_longest_request(tmp_path, engine):
    """vLLM refuses to start unless the KV cache holds one request of
    max_model_len in every cache group: the target's latent layers and the
    drafter's own. On an H100 on 2026-12-07 the plan counted the target only
    and the Llama drafter's engine refused to start ("0.58 GiB KV cache is
    needed ... larger than the available KV cache memory (0.57 GiB)"). The
    bytes a token are vLLM's own KV specs, not the plan's arithmetic."""
    torch = pytest.importorskip("torch")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    from tools.gpu_harness import fulldepth as fd

    drafters = fd.configs("kimi-k25-int4", [engine], 61, tmp_path)
    target = json.loads((tmp_path / "target" / "config.json").read_text())
    drafter = json.loads((drafters[engine] / "config.json").read_text())
    block = 64
    latent = target["kv_lora_rank"] + target["qk_rope_head_dim"]
    per_token = target["num_hidden_layers"] * MLAAttentionSpec(
        block_size=block, num_kv_heads=1, head_size=latent, dtype=torch.bfloat16).page_size_bytes // block
    if "kv_lora_rank" in drafter:
        spec = MLAAttentionSpec(block_size=block, num_kv_heads=1,
                                head_size=drafter["kv_lora_rank"] + drafter["qk_rope_head_dim"],
                                dtype=torch.bfloat16)
    else:
        heads = drafter["num_attention_heads"]
        spec = FullAttentionSpec(block_size=block, num_kv_heads=drafter["num_key_value_heads"],
                                 head_size=drafter.get("head_dim") or drafter["hidden_size"] // heads,
                                 dtype=torch.bfloat16)
    per_token += drafter.get("num_hidden_layers", 1) * spec.page_size_bytes // block
    max_model_len = 8192 + 64 + 64  # fulldepth.py: context + generated tokens + 64
    plan, cells, _ = mp.plan_cells(target, [8192], [1], 64, 3, *H100, drafter=True,
                                   drafter_kv_per_token=mp.drafter_kv_bytes_per_token(drafter))
    assert cells == [(8192, 1)]
    assert plan["kv_cache_memory_bytes"] >= max_model_len * per_token
    if engine == "llama":  # counting the target alone falls short, as it did on the H100
        alone, _, _ = mp.plan_cells(target, [8192], [1], 64, 3, *H100, drafter=True)
        assert alone["kv_cache_memory_bytes"] < max_model_len * per_token
