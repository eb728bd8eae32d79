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
import torch.nn.functional as F

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

    if not bool(proceed.all()):
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
    pos = torch.nonzero(valid, as_tuple=False).reshape(-1)
    e_valid = expert[pos]
    counts = torch.bincount(e_valid, minlength=num_experts)[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    cums = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    cums[1:] = torch.cumsum(padded, 0)
    raw = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    raw[1:] = torch.cumsum(counts, 0)

    order = torch.sort(e_valid, stable=True).indices
    e_sorted = e_valid[order]
    rank = torch.arange(e_sorted.numel(), device=device) - raw[e_sorted]
    dest = cums[e_sorted] + rank

    sorted_token_ids.fill_(numel)
    sorted_token_ids[dest] = pos[order].to(sorted_token_ids.dtype)

    blocks_per_expert = padded // block_size
    owner = torch.repeat_interleave(
        torch.arange(num_experts, device=device), blocks_per_expert
    )
    experts_ids.fill_(0)
    experts_ids[: owner.numel()] = owner.to(experts_ids.dtype)
    num_tokens_post_pad.fill_(0)
    num_tokens_post_pad[0] = cums[num_experts].to(num_tokens_post_pad.dtype)


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


def _referenced_only(qualname: str) -> Callable:
    def impl(*args, **kwargs):
        raise NotImplementedError(
            f"{qualname} is only referenced (by vllm/compilation fusion-pass "
            "tables, at import time) in the GPU harness; it has no torch "
            "implementation here, and with enforce_eager it is never called"
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
