# SPDX-License-Identifier: Apache-2.0
"""How much GPU memory a 61-layer rank share needs, before it loads.

``weight_bytes`` counts the parameter bytes vLLM 0.16 allocates for a
DeepSeek-V3-architecture config at TP = 1 (a rank's share as project.py's
``geometry()`` writes it): MLA attention with kv_b_proj kept beside the
W_UK_T / W_UV copies MLAAttention.process_weights_after_loading() makes,
the dense and MoE MLPs, the embedding and the LM head; routed experts in
bf16, INT4 (compressed-tensors pack-quantized: 4 bits and one bf16 scale
per group) or fp8 (one float32 scale per 128 x 128 block). For Kimi-K2.5
INT4 at 61 layers it gives 71.0 GiB; vLLM logged 71.13 GiB loading it on
an H100 (tests/e2e/gpu/test_harness_memory_plan.py holds the two).

``plan`` adds the KV cache the run needs (every request of the largest
batch at its context plus the generated and drafted tokens, in whole
blocks) and a reserve for activations, which grows with the batched-token
budget, and picks the largest budget that fits the card's free memory. A
run that fits at no budget is refused before loading, with the shortfall
in GiB.
"""

from __future__ import annotations

import math
import subprocess

GIB = 1 << 30
# Activation peak and CUDA graph pool beyond weights and KV: measured on an
# H100 with the 61-layer Kimi-K2.5 INT4 share at a budget of 8192 tokens,
# 0.95 x 79.19 GiB - 71.13 GiB weights - 0.94 GiB KV = 3.16 GiB
# (notes of 2026-12-07). A fixed part and a part per batched token, with a
# margin over that measurement.
RESERVE_FIXED = 1.5 * GIB
RESERVE_PER_TOKEN = 0.3 * (1 << 20)
# The drafter's own weights and KV on top (the Llama drafter's engine loaded
# 0.51 GiB more than plain's on the same H100).
DRAFTER_MARGIN = 1 * GIB
BUDGETS = (8192, 4096, 2048)
BLOCK = 64  # KV block tokens rounded up to, per request (vLLM's MLA blocks are 16 or 64)
MAX_UTIL = 0.95


def _mla_attention_params(c: dict) -> int:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    kv_lora, q_lora = c["kv_lora_rank"], c.get("q_lora_rank")
    qk = nope + rope
    if q_lora:
        q = h * q_lora + q_lora + q_lora * heads * qk  # q_a, its norm, q_b
    else:
        q = h * heads * qk
    kv_a = h * (kv_lora + rope) + kv_lora  # kv_a_proj_with_mqa and its norm
    kv_b = kv_lora * heads * (nope + v)
    # kv_b_proj stays (prefill); W_UK_T and W_UV hold it again for decode
    return q + kv_a + 2 * kv_b + heads * v * h + 2 * h  # o_proj, the two layer norms


def _expert_bytes(params: int, quant: dict | None) -> float:
    method = (quant or {}).get("quant_method")
    if method == "compressed-tensors":
        groups = [g["weights"] for g in quant.get("config_groups", {}).values()]
        bits = groups[0].get("num_bits", 4)
        group = groups[0].get("group_size") or 128
        return params * bits / 8 + params / group * 2
    if method == "fp8":
        block = (quant.get("weight_block_size") or [128, 128])
        return params + params / (block[0] * block[1]) * 4
    return params * 2


def weight_bytes(c: dict) -> int:
    """Parameter bytes of one rank's share (``c``: a per-rank geometry)."""
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    dense = min(c.get("first_k_dense_replace", 0), layers)
    quant = c.get("quantization_config")
    fp8 = (quant or {}).get("quant_method") == "fp8"
    linear = 1 if fp8 else 2  # attention and dense weights: fp8 keeps them fp8
    attn = _mla_attention_params(c)
    total = layers * attn * linear
    total += dense * 3 * h * c["intermediate_size"] * linear
    moe = layers - dense
    experts = c["n_routed_experts"]
    per_expert = 3 * h * c["moe_intermediate_size"]
    routed = _expert_bytes(experts * per_expert, quant if quant else None)
    shared = c.get("n_shared_experts", 0) * per_expert * linear
    gate = experts * h * 2 + experts * 4  # router and its score-correction bias
    total += moe * (routed + shared + gate)
    total += 2 * c["vocab_size"] * h * 2 + h * 2  # embedding, LM head, final norm
    return int(total)


def kv_bytes_per_token(c: dict) -> int:
    """The target's latent KV (bf16) over all its layers."""
    return c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2


def drafter_kv_bytes_per_token(c: dict) -> int:
    """An EAGLE-3 drafter's own KV (bf16) a token: vLLM gives the drafter's
    layers their own cache group beside the target's. The MLA drafter keeps
    a latent, the Llama drafter K and V of its KV heads."""
    layers = c.get("num_hidden_layers", 1)
    if "kv_lora_rank" in c:
        return layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return layers * 2 * c.get("num_key_value_heads", heads) * head_dim * 2


def kv_tokens(contexts, batches, gen_tokens: int, k: int) -> int:
    """KV tokens of the largest (context, batch) of the run, in whole blocks
    per request: prompt, generated tokens and one verify's drafts."""
    per_req = {ctx: math.ceil((ctx + gen_tokens + k + 1) / BLOCK) * BLOCK for ctx in contexts}
    return max(b * per_req[ctx] for ctx in contexts for b in batches)


def reserve_bytes(budget: int) -> float:
    return RESERVE_FIXED + budget * RESERVE_PER_TOKEN


def plan(cfg: dict, contexts, batches, gen_tokens: int, k: int, total_bytes: int,
         free_bytes: int, drafter: bool, drafter_kv_per_token: int = 0) -> dict:
    """{fits, budget, kv_cache_memory_bytes, gpu_memory_utilization, ...};
    without ``fits``, ``shortfall_gib`` and a one-line ``reason``.
    ``drafter_kv_per_token``: drafter_kv_bytes_per_token() of the largest
    drafter the run serves (0 for plain only)."""
    weights = weight_bytes(cfg) + (DRAFTER_MARGIN if drafter else 0)
    tokens = kv_tokens(contexts, batches, gen_tokens, k)
    # 5 %: block slack
    kv = int(tokens * (kv_bytes_per_token(cfg) * 1.05 + drafter_kv_per_token))
    usable = min(free_bytes, MAX_UTIL * total_bytes)
    out = {"weights_gib": round(weights / GIB, 2), "kv_tokens": tokens, "kv_gib": round(kv / GIB, 2),
           "free_gib": round(free_bytes / GIB, 2), "total_gib": round(total_bytes / GIB, 2)}
    for budget in BUDGETS:
        need = weights + kv + reserve_bytes(budget)
        if need <= usable:
            return {**out, "fits": True, "budget": budget, "need_gib": round(need / GIB, 2),
                    "kv_cache_memory_bytes": kv,
                    "gpu_memory_utilization": round(min(MAX_UTIL, free_bytes / total_bytes), 3)}
    need = weights + kv + reserve_bytes(BUDGETS[-1])
    short = (need - usable) / GIB
    return {**out, "fits": False, "need_gib": round(need / GIB, 2), "shortfall_gib": round(short, 2),
            "reason": (f"needs {need / GIB:.1f} GiB (weights {weights / GIB:.1f}, KV {kv / GIB:.1f} "
                       f"for {tokens} tokens, activations {reserve_bytes(BUDGETS[-1]) / GIB:.1f}) "
                       f"of {usable / GIB:.1f} GiB usable: {short:.1f} GiB short")}


def plan_cells(cfg: dict, contexts, batches, gen_tokens: int, k: int, total_bytes: int, free_bytes: int,
               drafter: bool, drafter_kv_per_token: int = 0) -> tuple[dict, list[tuple[int, int]], dict[str, str]]:
    """(plan, cells, skipped): the plan sized for the (context, batch) cells
    that fit the card one by one, those cells, and for each cell that does
    not fit the line why ("CONTEXTxBATCH": reason). With no cell fitting,
    the plan is the smallest cell's refusal."""
    cells, skipped = [], {}
    for ctx in contexts:
        for b in batches:
            p = plan(cfg, [ctx], [b], gen_tokens, k, total_bytes, free_bytes, drafter, drafter_kv_per_token)
            if p["fits"]:
                cells.append((ctx, b))
            else:
                skipped[f"{ctx}x{b}"] = p["reason"]
    if not cells:
        return plan(cfg, [min(contexts)], [min(batches)], gen_tokens, k, total_bytes, free_bytes, drafter, drafter_kv_per_token), [], skipped
    ctxs = sorted({c for c, _ in cells})
    # the KV of the largest fitting cell (plan takes the max over its product)
    worst = max(cells, key=lambda c: kv_tokens([c[0]], [c[1]], gen_tokens, k))
    return plan(cfg, [worst[0]], [worst[1]], gen_tokens, k, total_bytes, free_bytes, drafter, drafter_kv_per_token), \
        [c for c in cells if c[0] in ctxs], skipped


def card_memory() -> tuple[int, int, str]:
    """(total, free, name) of GPU 0 from nvidia-smi: no CUDA context in this
    process (vLLM's engine process must be the first to make one)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,memory.free,name",
                          "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout.strip()
    total, free, name = (x.strip() for x in out.split(",", 2))
    return int(total) << 20, int(free) << 20, name
