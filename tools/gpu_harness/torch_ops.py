# SPDX-License-Identifier: Apache-2.0
"""Torch implementations of the compiled vLLM v0.16.0 ops that the harness reaches.

The official v0.16.0 CUDA wheel's ``_C.abi3.so`` / ``_moe_C.abi3.so`` are built
against torch 2.9.1 / CUDA 12 and do not load on the lent device (torch 2.11,
CUDA 13). With ``custom_ops=["none"]``, ``enforce_eager=True`` and the Triton
attention backend, a tiny DeepSeek-V3 / Kimi-K2.5 target with an EAGLE-3
drafter still calls a handful of compiled ops. This module gives each of them a
torch implementation with the kernel's own semantics (read from the v0.16.0
``csrc/``) and registers it with ``torch.library`` under the exact name and
schema that vLLM calls (``torch.ops._C.*``, ``torch.ops._moe_C.*``).

It is installed on the device as ``vllm/_gpu_harness_ops.py`` and imported by
the ``vllm/_C.py`` stand-in (see ``standin_C.py``), so every process vLLM starts
(engine core, model-inspection subprocess) gets the ops when
``vllm.platforms.cuda`` does ``import vllm._C``. Nothing here is a stub: each op
computes the full result; ``tests/e2e/gpu/test_harness_ops.py`` checks each one
against an independent reference, on CPU (CI) and on CUDA when present.

Kept free of vLLM imports so it can be imported before ``vllm`` is complete.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# ---------------------------------------------------------------------------
# Capability queries (csrc/quantization/.../*_entry.cu)
# ---------------------------------------------------------------------------
# The real queries answer "does this build contain CUTLASS kernels for that
# compute capability". The harness build contains none, so the truthful answer
# is False for every capability: vLLM then never selects a CUTLASS path, and
# nothing in the tiny unquantized models needs one. (w8a8_utils evaluates
# cutlass_scaled_mm_supports_fp8 at import time, which is why these are reached.)


def cutlass_scaled_mm_supports_fp8(cuda_device_capability: int) -> bool:
    return False


def cutlass_scaled_mm_supports_block_fp8(cuda_device_capability: int) -> bool:
    return False


def cutlass_scaled_mm_supports_fp4(cuda_device_capability: int) -> bool:
    return False


def cutlass_group_gemm_supported(cuda_device_capability: int) -> bool:
    return False


def cutlass_sparse_scaled_mm_supported(cuda_device_capability: int) -> bool:
    return False


# ---------------------------------------------------------------------------
# Gated activations (csrc/activation_kernels.cu, act_and_mul_kernel)
# ---------------------------------------------------------------------------
# out = ACT(x) * y with x = input[..., :d], y = input[..., d:]. The kernel
# computes ACT in float32, rounds it to the tensor dtype, then multiplies in the
# tensor dtype (c10 half/bfloat16 arithmetic: float op, then round). Torch's
# elementwise ops on half/bfloat16 do the same.


def _split_gate(out: torch.Tensor, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = input.shape[-1] // 2
    if input.shape[-1] != 2 * d or out.shape[-1] != d:
        raise RuntimeError(
            f"act_and_mul: input last dim {input.shape[-1]} must be 2x output "
            f"last dim {out.shape[-1]}"
        )
    return input[..., :d], input[..., d:]


def _act_float(x: torch.Tensor, kind: str) -> torch.Tensor:
    f = x.float()
    if kind == "silu":
        r = f / (1.0 + torch.exp(-f))
    elif kind == "gelu":
        r = f * 0.5 * (1.0 + torch.erf(f * 0.7071067811865476))
    elif kind == "gelu_tanh":
        inner = 0.7978845608028654 * (f + 0.044715 * f * f * f)
        r = 0.5 * f * (1.0 + torch.tanh(inner))
    else:  # pragma: no cover
        raise ValueError(kind)
    return r.to(x.dtype)


def silu_and_mul(result: torch.Tensor, input: torch.Tensor) -> None:
    x, y = _split_gate(result, input)
    result.copy_(_act_float(x, "silu") * y)


def gelu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    x, y = _split_gate(out, input)
    out.copy_(_act_float(x, "gelu") * y)


def gelu_tanh_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    x, y = _split_gate(out, input)
    out.copy_(_act_float(x, "gelu_tanh") * y)


# ---------------------------------------------------------------------------
# MoE routing (csrc/moe/topk_softmax_kernels.cu)
# ---------------------------------------------------------------------------


def _stable_topk_desc(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values per row; ties go to the lower index
    (cub::ArgMax and the warp-select kernels keep the first candidate)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def _topk_gating(
    probs: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_indices: torch.Tensor,
    token_expert_indices: torch.Tensor,
    renormalize: bool,
    bias: torch.Tensor | None,
) -> None:
    num_tokens, num_experts = probs.shape
    k = topk_weights.shape[-1]
    choice = probs + bias.float() if bias is not None else probs
    idx = _stable_topk_desc(choice, k)
    weights = probs.gather(1, idx)  # the unbiased scores are the weights
    if renormalize:
        denom = weights.sum(dim=-1, keepdim=True)
        denom = torch.where(denom > 0, denom, torch.ones_like(denom))
        weights = weights / denom
    topk_weights.copy_(weights)
    topk_indices.copy_(idx.to(topk_indices.dtype))
    rows = torch.arange(num_tokens, device=probs.device, dtype=torch.int64)
    kk = torch.arange(k, device=probs.device, dtype=torch.int64)
    token_expert_indices.copy_(
        (kk[None, :] * num_tokens + rows[:, None]).to(token_expert_indices.dtype)
    )


def topk_softmax(
    topk_weights: torch.Tensor,
    topk_indices: torch.Tensor,
    token_expert_indices: torch.Tensor,
    gating_output: torch.Tensor,
    renormalize: bool,
    bias: torch.Tensor | None,
) -> None:
    g = gating_output.float()
    probs = torch.exp(g - g.amax(dim=-1, keepdim=True))
    probs = probs * (1.0 / probs.sum(dim=-1, keepdim=True))
    _topk_gating(probs, topk_weights, topk_indices, token_expert_indices, renormalize, bias)


def topk_sigmoid(
    topk_weights: torch.Tensor,
    topk_indices: torch.Tensor,
    token_expert_indices: torch.Tensor,
    gating_output: torch.Tensor,
    renormalize: bool,
    bias: torch.Tensor | None,
) -> None:
    probs = 1.0 / (1.0 + torch.exp(-gating_output.float()))
    _topk_gating(probs, topk_weights, topk_indices, token_expert_indices, renormalize, bias)


# ---------------------------------------------------------------------------
# Grouped top-k, "noaux_tc" (csrc/moe/grouped_topk_kernels.cu,
# grouped_topk_fused_kernel). Used by DeepSeek-V3 / Kimi-K2.5 routing.
# ---------------------------------------------------------------------------


def grouped_topk(
    scores: torch.Tensor,
    n_group: int,
    topk_group: int,
    topk: int,
    renormalize: bool,
    routed_scaling_factor: float,
    bias: torch.Tensor,
    scoring_func: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel semantics, step by step (T = scores.dtype):

    1. s = scoring(scores) in T (sigmoid as 0.5*tanh(x/2)+0.5 in float32,
       rounded to T; scoring_func 0 leaves the scores as they are);
       biased = s + bias.to(T), computed in T.
    2. group score = sum of the two largest biased scores of the group (in T);
       a group of one expert scores -inf.
    3. the topk_group groups with the highest score are selected (stable:
       equal scores go to the lower group id). If the last selected group scores
       -inf, every token gets experts 0..topk-1 with weight 1/topk.
    4. candidates are the experts of the selected groups with a finite raw
       score, visited group by group in selection order; the topk largest
       biased scores win (stable in that visiting order). Output order is by
       biased score, descending.
    5. weight = float(s) of the winner (unbiased); with renormalize,
       scale = routed_scaling_factor / (1e-20 + sum of the weights), else
       scale = routed_scaling_factor; weight *= scale.
    Returns (float32 weights [n, topk], int32 ids [n, topk]).
    """
    if scores.dim() != 2:
        raise RuntimeError("scores must be a 2D Tensor")
    num_tokens, num_experts = scores.shape
    if not (0 < topk_group <= n_group <= 32 and 0 < topk <= 32):
        raise RuntimeError("grouped_topk: invalid n_group/topk_group/topk")
    if num_experts % n_group != 0:
        raise RuntimeError("num_experts should be divisible by n_group")
    per_group = num_experts // n_group
    if topk > topk_group * per_group:
        raise RuntimeError("topk must be <= topk_group * (num_experts / n_group)")
    if scoring_func not in (0, 1):
        raise RuntimeError("scoring_func must be SCORING_NONE (0) or SCORING_SIGMOID (1)")

    dtype = scores.dtype
    device = scores.device
    if scoring_func == 1:
        f = scores.float()
        s = (0.5 * torch.tanh(0.5 * f) + 0.5).to(dtype)
    else:
        s = scores
    biased = s + bias.to(dtype)

    grouped = biased.view(num_tokens, n_group, per_group)
    if per_group >= 2:
        top2 = torch.topk(grouped, 2, dim=-1).values
        group_scores = top2[..., 0] + top2[..., 1]
    else:
        group_scores = torch.full(
            (num_tokens, n_group), float("-inf"), dtype=dtype, device=device
        )

    group_order = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices
    sel_groups = group_order[:, :topk_group]  # [n, topk_group], selection order
    kth = group_scores.gather(1, sel_groups[:, -1:]).squeeze(1)
    proceed = kth != float("-inf")

    local = torch.arange(per_group, device=device)
    cand_idx = (sel_groups[:, :, None] * per_group + local[None, None, :]).reshape(
        num_tokens, topk_group * per_group
    )
    cand_val = biased.gather(1, cand_idx)
    finite = torch.isfinite(scores.gather(1, cand_idx))
    cand_val = torch.where(finite, cand_val, torch.full_like(cand_val, float("-inf")))
    win = torch.sort(cand_val, dim=-1, descending=True, stable=True).indices[:, :topk]
    ids = cand_idx.gather(1, win)

    weights = s.gather(1, ids).float()
    scale = torch.full(
        (num_tokens, 1), float(routed_scaling_factor), dtype=torch.float32, device=device
    )
    if renormalize:
        topk_sum = weights.sum(dim=-1, keepdim=True) + 1e-20
        scale = scale / topk_sum
    weights = weights * scale

    # Applied unconditionally (no ``if proceed.all()``): reading a device
    # value on the host is forbidden while a CUDA graph is being captured.
    fallback_ids = torch.arange(topk, device=device).expand(num_tokens, topk)
    fallback_w = torch.full((num_tokens, topk), 1.0 / topk, device=device)
    ids = torch.where(proceed[:, None], ids, fallback_ids)
    weights = torch.where(proceed[:, None], weights, fallback_w)
    return weights.to(torch.float32).contiguous(), ids.to(torch.int32).contiguous()


def _grouped_topk_fake(
    scores, n_group, topk_group, topk, renormalize, routed_scaling_factor, bias,
    scoring_func=0,
):
    n = scores.shape[0]
    return (
        scores.new_empty((n, topk), dtype=torch.float32),
        scores.new_empty((n, topk), dtype=torch.int32),
    )


# ---------------------------------------------------------------------------
# MoE block alignment and sum (csrc/moe/moe_align_sum_kernels.cu)
# ---------------------------------------------------------------------------


def moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    maybe_expert_map: torch.Tensor | None,
) -> None:
    """Kernel semantics:

    * every entry of sorted_token_ids is first set to numel (= padding);
    * the flat index i of each routed (token, k) slot whose expert id is
      < num_experts (and, with an expert map, maps to an id != -1) is written
      into its expert's segment; segment e starts at the exclusive prefix sum
      of the per-expert counts, each rounded up to block_size;
    * experts_ids[b] is the expert owning block b; blocks past the last
      segment get expert 0 (v0.16.0's inactive_expert_id for this op);
    * num_tokens_post_pad[0] is the padded total.

    Inside one expert's segment the CUDA kernel's order depends on atomics;
    here it is ascending flat index, one of the orders the kernel can produce
    (the grouped GEMM treats each row independently, so the order inside a
    segment never changes a result).

    Every intermediate has a shape fixed by the arguments (no nonzero, no
    bincount, no repeat_interleave with tensor counts) and no device value is
    read on the host, so the op can be captured in a CUDA graph.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel = flat.numel()
    valid = (flat < num_experts) & (flat >= 0)
    expert = flat
    if maybe_expert_map is not None:
        safe = torch.where(valid, flat, torch.zeros_like(flat))
        expert = maybe_expert_map.to(torch.int64)[safe]
        valid = valid & (expert != -1)
    # Invalid slots get the key num_experts: they sort after every segment.
    key = torch.where(valid, expert, torch.full_like(expert, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    cums = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    cums[1:] = torch.cumsum(padded, 0)
    raw = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    raw[1:] = torch.cumsum(counts, 0)

    order = torch.sort(key, stable=True).indices
    k_sorted = key[order]
    ok = k_sorted < num_experts
    k_safe = torch.where(ok, k_sorted, torch.zeros_like(k_sorted))
    rank = torch.arange(numel, device=device) - raw[k_safe]
    # Invalid slots are written to one spare element past the end, dropped.
    n_out = sorted_token_ids.numel()
    dest = torch.where(ok, cums[k_safe] + rank, torch.full_like(rank, n_out))
    staged = torch.full((n_out + 1,), numel, dtype=sorted_token_ids.dtype, device=device)
    staged.scatter_(0, dest, order.to(sorted_token_ids.dtype))
    sorted_token_ids.copy_(staged[:n_out].view_as(sorted_token_ids))

    # Block b belongs to the first expert whose inclusive block count exceeds b.
    blocks_incl = torch.cumsum(padded // block_size, 0)
    b = torch.arange(experts_ids.numel(), device=device, dtype=torch.int64)
    owner = torch.searchsorted(blocks_incl, b, right=True)
    owner = torch.where(b < blocks_incl[-1], owner, torch.zeros_like(owner))
    experts_ids.copy_(owner.to(experts_ids.dtype).view_as(experts_ids))
    num_tokens_post_pad.zero_()
    num_tokens_post_pad[:1].copy_(cums[num_experts:].to(num_tokens_post_pad.dtype))


def moe_sum(input: torch.Tensor, output: torch.Tensor) -> None:
    """output[t] = sum_k input[t, k]. For topk 2..4 the kernel accumulates in
    the tensor dtype, left to right, starting from 0; otherwise it calls
    at::sum_out (float accumulation)."""
    topk = input.shape[1]
    if topk in (2, 3, 4):
        acc = input[:, 0].clone()
        for k in range(1, topk):
            acc = acc + input[:, k]
        output.copy_(acc.view_as(output))
    else:
        torch.sum(input, dim=1, out=output)


# ---------------------------------------------------------------------------
# RMSNorm and rotary embedding (csrc/layernorm_kernels.cu,
# csrc/pos_encoding_kernels.cu). With custom_ops=["none"] vLLM runs the
# native torch versions of these layers, but vllm/compilation/passes/* (which
# the EAGLE proposer imports) take the op objects at import time, so they must
# exist; they are implemented for real anyway.
# ---------------------------------------------------------------------------


def _rms_scale(x: torch.Tensor, epsilon: float) -> torch.Tensor:
    xf = x.float()
    return torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + epsilon)


def rms_norm(result: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """out = ((T)(x * rsqrt(mean(x^2) + eps))) * weight, variance in float32."""
    s = _rms_scale(input, epsilon)
    result.copy_((input.float() * s).to(input.dtype) * weight)


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """z = input + residual (in T); residual <- z; input <- rms_norm(z)."""
    z = input + residual
    residual.copy_(z)
    s = _rms_scale(z, epsilon)
    input.copy_((z.float() * s).to(z.dtype) * weight)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """In place on the first rot_dim dims of every head: x' = x*cos - y*sin,
    y' = y*cos + x*sin (arithmetic in the tensor dtype); (x, y) are the two
    halves (neox) or the even/odd pairs (gpt-j) of the rotated part."""
    rot_dim = cos_sin_cache.shape[1]
    cs = cos_sin_cache[positions.reshape(-1).long()]  # [n, rot_dim]
    cos, sin = cs[:, : rot_dim // 2].to(query.dtype), cs[:, rot_dim // 2:].to(query.dtype)
    n = positions.numel()
    for t in (query, key):
        if t is None:
            continue
        v = t.view(n, -1, head_size)
        rot = v[..., :rot_dim]
        if is_neox:
            x, y = rot[..., : rot_dim // 2], rot[..., rot_dim // 2:]
        else:
            x, y = rot[..., 0::2], rot[..., 1::2]
        c, s_ = cos[:, None, :], sin[:, None, :]
        nx = x * c - y * s_
        ny = y * c + x * s_
        if is_neox:
            rot.copy_(torch.cat([nx, ny], dim=-1))
        else:
            rot.copy_(torch.stack([nx, ny], dim=-1).flatten(-2))


# ---------------------------------------------------------------------------
# CUDA-graph output references (csrc/ops.h, weak_ref_tensor)
# ---------------------------------------------------------------------------


def weak_ref_tensor(input: torch.Tensor) -> torch.Tensor:
    """The kernel returns a tensor over the same memory that does not own it,
    so a captured graph's output buffer can go back to the graph pool. Python
    cannot make a non-owning CUDA tensor; this returns an alias that does own
    a reference. Same data, same strides: only the memory is released later
    (when vLLM drops the alias), which costs memory, never a result."""
    return input.as_strided(input.size(), input.stride(), input.storage_offset())


def _weak_ref_tensor_fake(input: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(input.size(), input.stride(), dtype=input.dtype,
                               device=input.device)


# ---------------------------------------------------------------------------
# KV-cache writes and gathers (csrc/cache_kernels.cu)
# ---------------------------------------------------------------------------


def _require_auto_cache(kv_cache_dtype: str, op: str) -> None:
    if kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise NotImplementedError(
            f"{op}: kv_cache_dtype {kv_cache_dtype!r} (quantized cache) has no torch "
            "implementation in the GPU harness; serve with kv_cache_dtype='auto'"
        )


def _scatter_rows(rows_view: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """rows_view[slots[i]] = new[i] for slots[i] >= 0; rows with slot < 0 are
    skipped, as the kernels do (padding tokens). Without host syncs: a
    skipped row is sent to the slot of the first valid row with that row's
    data (or, if there is none, to row 0 with row 0's old data), so every
    destination receives only identical values and the write order cannot
    matter."""
    slots = slots.to(torch.int64)
    valid = slots >= 0
    any_valid = valid.any()
    # index_select, not slots[ref]: indexing with a 0-dim tensor reads it on
    # the host, which CUDA-graph capture forbids.
    ref = torch.argmax(valid.to(torch.int32)).view(1)
    ref_slot = torch.where(any_valid, slots.index_select(0, ref), torch.zeros_like(ref))
    ref_row = torch.where(any_valid, new.index_select(0, ref), rows_view[:1])
    dest = torch.where(valid, slots, ref_slot)
    shape = (-1,) + (1,) * (new.dim() - 1)
    src = torch.where(valid.view(shape), new, ref_row)
    rows_view.index_copy_(0, dest, src)


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor,
) -> None:
    """kv_cache[slot // block_size, slot % block_size] = [kv_c | k_pe] for
    each token with slot >= 0 (slot -1 marks padding). Unquantized caches only
    (a plain copy).

    The kernel walks slot_mapping.size(0) tokens. Either side may be longer:
    kv_c holds CUDA-graph padding rows, and under speculative decoding vLLM
    passes kv_c cut to the actual tokens with a padded slot_mapping, whose
    extra entries are -1 (the kernel reads past the cut into the padding of
    the same buffer and skips them). Here tokens past either length are
    skipped."""
    _require_auto_cache(kv_cache_dtype, "concat_and_cache_mla")
    n = min(slot_mapping.size(0), kv_c.size(0), k_pe.size(0))
    rank, pe = kv_c.size(1), k_pe.size(1)
    if kv_cache.size(2) != rank + pe:
        raise RuntimeError(f"kv_cache.size(2) {kv_cache.size(2)} != kv_lora_rank {rank} + pe_dim {pe}")
    rows = torch.cat([kv_c[:n], k_pe[:n]], dim=-1).to(kv_cache.dtype)
    flat = kv_cache.view(-1, rank + pe) if kv_cache.is_contiguous() else None
    if flat is None:
        raise RuntimeError("concat_and_cache_mla: the harness needs a contiguous kv_cache")
    _scatter_rows(flat, slot_mapping.reshape(-1)[:n], rows)


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """key_cache[slot // bs, slot % bs] = key[i] (and the same for value) for
    i < slot_mapping.size(0), slot -1 skipped; caches are [num_blocks,
    block_size, heads, head_size] views whose block and page strides merge.
    Tokens past key.size(0) are skipped (see concat_and_cache_mla)."""
    _require_auto_cache(kv_cache_dtype, "reshape_and_cache_flash")
    n = min(slot_mapping.size(0), key.size(0), value.size(0))
    bs = key_cache.size(1)
    slots = slot_mapping.reshape(-1)[:n].to(torch.int64)
    for src, cache in ((key, key_cache), (value, value_cache)):
        # [num_blocks * block_size, heads, head] view over the same memory
        rows = cache.flatten(0, 1) if cache.stride(0) == bs * cache.stride(1) else None
        if rows is None:
            raise RuntimeError("reshape_and_cache_flash: block and page strides do not merge")
        _scatter_rows(rows, slots, src[:n].to(cache.dtype))


def gather_and_maybe_dequant_cache(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
    num_tokens: int,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    seq_starts: torch.Tensor | None,
) -> None:
    """For t < num_tokens: b = token_to_seq[t]; if t < cu_seq_lens[b + 1],
    dst[t] = src_cache[block_table[b, o // bs], o % bs] with
    o = t - cu_seq_lens[b] + seq_starts[b] (seq_starts optional, else 0).
    Rows past their sequence are left untouched, as the kernel leaves them."""
    _require_auto_cache(kv_cache_dtype, "gather_and_maybe_dequant_cache")
    if dst.size(-1) != 576:
        raise RuntimeError("gather_and_maybe_dequant_cache only support the head_dim to 576")
    for name, t in (("block_table", block_table), ("cu_seq_lens", cu_seq_lens)):
        if t.dtype != torch.int32:
            raise RuntimeError(f"{name} must be int32")
    if num_tokens <= 0:
        return
    bs = src_cache.size(1)
    t = torch.arange(num_tokens, device=dst.device, dtype=torch.int64)
    b = token_to_seq[:num_tokens].to(torch.int64)
    cu = cu_seq_lens.to(torch.int64)
    inside = t < cu[b + 1]
    off = t - cu[b]
    if seq_starts is not None:
        off = off + seq_starts.to(torch.int64)[b]
    off = torch.where(inside, off, torch.zeros_like(off))
    col = (off // bs).clamp(max=block_table.size(1) - 1)
    blk = block_table.to(torch.int64)[b, col]
    rows = src_cache[blk, off % bs].to(dst.dtype)
    dst[:num_tokens] = torch.where(inside[:, None], rows, dst[:num_tokens])


# ---------------------------------------------------------------------------
# Merging two partial attention results (csrc/attention/merge_attn_states.cu)
# ---------------------------------------------------------------------------


def merge_attn_states(
    output: torch.Tensor,
    output_lse: torch.Tensor | None,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> None:
    """Outputs [tokens, heads, head_size], lse [heads, tokens] (float32).
    An infinite lse counts as -inf; if both are -inf the prefix output and
    -inf are written. Else p = exp(p_lse - m), s = exp(s_lse - m) with
    m = max, out = p_out * (p / (p + s)) + s_out * (s / (p + s)) in float32,
    rounded to the output dtype, lse = log(p + s) + m."""
    ninf = torch.tensor(float("-inf"), device=prefix_lse.device)
    p_lse = torch.where(torch.isinf(prefix_lse), ninf, prefix_lse.float())
    s_lse = torch.where(torch.isinf(suffix_lse), ninf, suffix_lse.float())
    m = torch.maximum(p_lse, s_lse)
    dead = torch.isinf(m)
    m_safe = torch.where(dead, torch.zeros_like(m), m)
    p_se = torch.exp(p_lse - m_safe)
    s_se = torch.exp(s_lse - m_safe)
    out_se = p_se + s_se
    out_se_safe = torch.where(dead, torch.ones_like(out_se), out_se)
    p_scale = (p_se / out_se_safe).t()[..., None]  # [tokens, heads, 1]
    s_scale = (s_se / out_se_safe).t()[..., None]
    merged = prefix_output.float() * p_scale + suffix_output.float() * s_scale
    merged = torch.where(dead.t()[..., None], prefix_output.float(), merged)
    output.copy_(merged.to(output.dtype))
    if output_lse is not None:
        output_lse.copy_(torch.where(dead, m, torch.log(out_se_safe) + m_safe))


# ---------------------------------------------------------------------------
# FlashAttention-2 varlen forward (vllm-project/flash-attention, the
# _vllm_fa2_C extension of the vllm_flash_attn package in the wheel)
# ---------------------------------------------------------------------------


def fa2_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_k: torch.Tensor | None,
    leftpad_k: torch.Tensor | None,
    block_table: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    p_dropout: float,
    softmax_scale: float,
    zero_tensors: bool,
    is_causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    return_softmax: bool,
    num_splits: int,
    gen: torch.Tensor | None,
) -> list[torch.Tensor]:
    """Attention of each request's queries over its keys, softmax in float32.

    * q [total_q, Hq, D]; k, v [total_k, Hk, D(v)] with cu_seqlens_k, or
      paged [num_blocks, page, Hk, D(v)] with block_table [b, max_blocks];
      seqused_k [b], when given, is each request's key count.
    * causal masks are aligned to the bottom right: query i of a request with
      Lq queries and Lk keys sees keys j <= i + Lk - Lq.
    * GQA: query head h reads key head h // (Hq / Hk).
    * returns [out, softmax_lse]; lse is [Hq, total_q], +inf for a query that
      sees no key (its output is 0), as FlashAttention-2 writes it.

    Everything is padded to max_seqlen_q x max_seqlen_k per request (Python
    ints), so shapes never depend on device values and nothing syncs."""
    if alibi_slopes is not None or leftpad_k is not None or p_dropout != 0.0 or softcap != 0.0:
        raise NotImplementedError("fa2_varlen_fwd stand-in: alibi, leftpad, dropout and softcap are not supported")
    if window_size_left != -1 or window_size_right not in (-1, 0):
        raise NotImplementedError("fa2_varlen_fwd stand-in: sliding windows are not supported")
    dev = q.device
    total_q, hq, d = q.shape
    dv = v.shape[-1]
    hk = k.shape[-2]
    nb = cu_seqlens_q.numel() - 1
    mq, mk = int(max_seqlen_q), int(max_seqlen_k)
    cu_q = cu_seqlens_q.to(torch.int64)
    q_len = cu_q[1:] - cu_q[:-1]
    if seqused_k is not None:
        k_len = seqused_k.to(torch.int64)[:nb]
    else:
        cu_k = cu_seqlens_k.to(torch.int64)
        k_len = cu_k[1:] - cu_k[:-1]

    iq = torch.arange(mq, device=dev)
    jk = torch.arange(mk, device=dev)
    q_ok = iq[None, :] < q_len[:, None]                       # [b, mq]
    q_idx = (cu_q[:-1, None] + iq[None, :]).clamp(max=max(total_q - 1, 0))
    k_ok = jk[None, :] < k_len[:, None]                       # [b, mk]
    if block_table is not None:
        page = k.shape[1]
        col = (jk // page).clamp(max=block_table.shape[1] - 1)
        blk = block_table.to(torch.int64)[:nb][:, col]        # [b, mk]
        kk = k[blk, (jk % page)[None, :].expand(nb, mk)]      # [b, mk, Hk, D]
        vv = v[blk, (jk % page)[None, :].expand(nb, mk)]
    else:
        k_idx = (cu_k[:-1, None] + jk[None, :]).clamp(max=max(k.shape[0] - 1, 0))
        kk, vv = k[k_idx], v[k_idx]
    qq = q[q_idx].float()                                      # [b, mq, Hq, D]
    rep = hq // hk
    kk = kk.float().repeat_interleave(rep, dim=2)
    vv = vv.float().repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qq, kk) * softmax_scale
    mask = q_ok[:, :, None] & k_ok[:, None, :]                # [b, mq, mk]
    if is_causal:
        shift = (k_len - q_len)[:, None, None]
        mask = mask & (jk[None, None, :] <= iq[None, :, None] + shift)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                           # [b, Hq, mq]
    none = torch.isinf(lse)
    p = torch.exp(s - torch.where(none, torch.zeros_like(lse), lse)[..., None])
    o = torch.einsum("bhqk,bkhd->bqhd", p, vv)                 # [b, mq, Hq, Dv]
    lse = torch.where(none, torch.full_like(lse, float("inf")), lse)

    # Back to the packed token layout (padding query slots are dropped).
    t = torch.arange(total_q, device=dev)
    req = (torch.searchsorted(cu_q[1:], t, right=True)).clamp(max=max(nb - 1, 0))
    pos = (t - cu_q[req]).clamp(min=0, max=max(mq - 1, 0))
    o_tok = o[req, pos]                                        # [total_q, Hq, Dv]
    lse_tok = lse[req, :, pos].t().contiguous()                # [Hq, total_q]
    if out is None:
        out = torch.empty((total_q, hq, dv), dtype=q.dtype, device=dev)
    out.copy_(o_tok.to(out.dtype))
    return [out, lse_tok]


def _fa2_varlen_fwd_fake(q, k, v, out, cu_seqlens_q, *args):
    total_q, hq, _ = q.shape
    o = out if out is not None else q.new_empty((total_q, hq, v.shape[-1]))
    return [o, q.new_empty((hq, total_q), dtype=torch.float32)]


def _referenced_only(qualname: str) -> Callable:
    def impl(*args, **kwargs):
        raise NotImplementedError(
            f"{qualname} is only referenced (by vllm/compilation fusion-pass "
            "tables, at import time) in the GPU harness; it has no torch "
            "implementation here; the unquantized harness models never call it"
        )

    return impl


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------

# (namespace, name, schema, impl, fake or None for "returns nothing")
_OPS: list[tuple[str, str, str, Callable, Callable | None]] = [
    ("_C", "cutlass_scaled_mm_supports_fp8", "(int cuda_device_capability) -> bool",
     cutlass_scaled_mm_supports_fp8, None),
    ("_C", "cutlass_scaled_mm_supports_block_fp8", "(int cuda_device_capability) -> bool",
     cutlass_scaled_mm_supports_block_fp8, None),
    ("_C", "cutlass_scaled_mm_supports_fp4", "(int cuda_device_capability) -> bool",
     cutlass_scaled_mm_supports_fp4, None),
    ("_C", "cutlass_group_gemm_supported", "(int cuda_device_capability) -> bool",
     cutlass_group_gemm_supported, None),
    ("_C", "cutlass_sparse_scaled_mm_supported", "(int cuda_device_capability) -> bool",
     cutlass_sparse_scaled_mm_supported, None),
    ("_C", "silu_and_mul", "(Tensor! result, Tensor input) -> ()", silu_and_mul, None),
    ("_C", "gelu_and_mul", "(Tensor! out, Tensor input) -> ()", gelu_and_mul, None),
    ("_C", "gelu_tanh_and_mul", "(Tensor! out, Tensor input) -> ()", gelu_tanh_and_mul, None),
    ("_moe_C", "topk_softmax",
     "(Tensor! topk_weights, Tensor! topk_indices, Tensor! token_expert_indices, "
     "Tensor gating_output, bool renormalize, Tensor? bias) -> ()", topk_softmax, None),
    ("_moe_C", "topk_sigmoid",
     "(Tensor! topk_weights, Tensor! topk_indices, Tensor! token_expert_indices, "
     "Tensor gating_output, bool renormalize, Tensor? bias) -> ()", topk_sigmoid, None),
    ("_moe_C", "moe_sum", "(Tensor input, Tensor! output) -> ()", moe_sum, None),
    ("_moe_C", "moe_align_block_size",
     "(Tensor topk_ids, int num_experts, int block_size, Tensor! sorted_token_ids, "
     "Tensor! experts_ids, Tensor! num_tokens_post_pad, Tensor? maybe_expert_map) -> ()",
     moe_align_block_size, None),
    ("_moe_C", "grouped_topk",
     "(Tensor scores, int n_group, int topk_group, int topk, bool renormalize, "
     "float routed_scaling_factor, Tensor bias, int scoring_func) -> (Tensor, Tensor)",
     grouped_topk, _grouped_topk_fake),
    ("_C", "rms_norm", "(Tensor! result, Tensor input, Tensor weight, float epsilon) -> ()",
     rms_norm, None),
    ("_C", "fused_add_rms_norm",
     "(Tensor! input, Tensor! residual, Tensor weight, float epsilon) -> ()",
     fused_add_rms_norm, None),
    ("_C", "rotary_embedding",
     "(Tensor positions, Tensor! query, Tensor!? key, int head_size, Tensor cos_sin_cache, "
     "bool is_neox) -> ()", rotary_embedding, None),
    ("_C", "weak_ref_tensor", "(Tensor input) -> Tensor", weak_ref_tensor,
     _weak_ref_tensor_fake),
    ("_C", "merge_attn_states",
     "(Tensor! output, Tensor!? output_lse, Tensor prefix_output, Tensor prefix_lse, "
     "Tensor suffix_output, Tensor suffix_lse) -> ()", merge_attn_states, None),
    ("_C_cache_ops", "concat_and_cache_mla",
     "(Tensor kv_c, Tensor k_pe, Tensor! kv_cache, Tensor slot_mapping, "
     "str kv_cache_dtype, Tensor scale) -> ()", concat_and_cache_mla, None),
    ("_C_cache_ops", "reshape_and_cache_flash",
     "(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, "
     "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()",
     reshape_and_cache_flash, None),
    ("_C_cache_ops", "gather_and_maybe_dequant_cache",
     "(Tensor src_cache, Tensor! dst, Tensor block_table, Tensor cu_seq_lens, "
     "Tensor token_to_seq, int num_tokens, str kv_cache_dtype, Tensor scale, "
     "Tensor? seq_starts) -> ()", gather_and_maybe_dequant_cache, None),
    ("_vllm_fa2_C", "varlen_fwd",
     "(Tensor! q, Tensor k, Tensor v, Tensor!? out, Tensor cu_seqlens_q, "
     "Tensor cu_seqlens_k, Tensor? seqused_k, Tensor? leftpad_k, Tensor? block_table, "
     "Tensor? alibi_slopes, int max_seqlen_q, int max_seqlen_k, float p_dropout, "
     "float softmax_scale, bool zero_tensors, bool is_causal, int window_size_left, "
     "int window_size_right, float softcap, bool return_softmax, int num_splits, "
     "Tensor? gen) -> Tensor[]", fa2_varlen_fwd, _fa2_varlen_fwd_fake),
]

# Taken as op objects by vllm/compilation/passes/* at import (the EAGLE
# proposer imports vllm.compilation.backends), never called with
# enforce_eager. Defined with their real schemas; calling one raises.
_REFERENCED_ONLY: list[tuple[str, str]] = [
    ("static_scaled_fp8_quant",
     "(Tensor! result, Tensor input, Tensor scale, (int, int)? group_shape=None) -> ()"),
    ("dynamic_scaled_fp8_quant", "(Tensor! result, Tensor input, Tensor! scale) -> ()"),
    ("dynamic_per_token_scaled_fp8_quant",
     "(Tensor! result, Tensor input, Tensor! scale, Tensor? scale_ub) -> ()"),
    ("per_token_group_fp8_quant",
     "(Tensor input, Tensor! output_q, Tensor! output_s, int group_size, float eps, "
     "float fp8_min, float fp8_max, bool scale_ue8m0) -> ()"),
    ("rms_norm_static_fp8_quant",
     "(Tensor! result, Tensor input, Tensor weight, Tensor scale, float epsilon) -> ()"),
    ("fused_add_rms_norm_static_fp8_quant",
     "(Tensor! result, Tensor input, Tensor! residual, Tensor weight, Tensor scale, "
     "float epsilon) -> ()"),
    ("rms_norm_dynamic_per_token_quant",
     "(Tensor! result, Tensor input, Tensor weight, Tensor! scale, float epsilon, "
     "Tensor? scale_ub, Tensor!? residual) -> ()"),
    ("rms_norm_per_block_quant",
     "(Tensor! result, Tensor input, Tensor weight, Tensor! scale, float epsilon, "
     "Tensor? scale_ub, Tensor!? residual, int group_size, bool is_scale_transposed) -> ()"),
    ("silu_and_mul_quant", "(Tensor! result, Tensor input, Tensor scale) -> ()"),
    ("fused_qk_norm_rope",
     "(Tensor! qkv, int num_heads_q, int num_heads_k, int num_heads_v, int head_dim, "
     "float eps, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, bool is_neox, "
     "Tensor position_ids) -> ()"),
]
_OPS += [("_C", name, schema, _referenced_only(f"_C::{name}"), None)
         for name, schema in _REFERENCED_ONLY]

OP_NAMES: tuple[str, ...] = tuple(f"{ns}::{name}" for ns, name, *_ in _OPS)
REFERENCED_ONLY: tuple[str, ...] = tuple(f"_C::{n}" for n, _ in _REFERENCED_ONLY)

_LIBS: dict[str, torch.library.Library] = {}
_REGISTERED: set[str] = set()


def _noop_fake(*args, **kwargs) -> None:
    return None


def register(namespace_map: dict[str, str] | None = None) -> list[str]:
    """Define and implement every op. ``namespace_map`` renames namespaces
    (tests register under e.g. ``_C_harness_test`` so they can sit next to a
    real ``_C``). Returns the qualified names registered by this call;
    registering the same name twice is a no-op."""
    namespace_map = namespace_map or {}
    done = []
    for ns, name, schema, impl, fake in _OPS:
        target = namespace_map.get(ns, ns)
        qualname = f"{target}::{name}"
        if qualname in _REGISTERED:
            continue
        lib = _LIBS.get(target)
        if lib is None:
            lib = torch.library.Library(target, "FRAGMENT")
            _LIBS[target] = lib
        lib.define(name + schema)
        has_tensor_arg = "Tensor" in schema.split("->")[0]
        if has_tensor_arg:
            for key in ("CPU", "CUDA"):
                lib.impl(name, impl, key)
            torch.library.register_fake(qualname, fake or _noop_fake, lib=lib)
        else:
            lib.impl(name, impl, "CompositeImplicitAutograd")
        _REGISTERED.add(qualname)
        done.append(qualname)
    return done
