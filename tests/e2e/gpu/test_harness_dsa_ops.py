# SPDX-License-Identifier: Apache-2.0
"""Each stand-in of tools/gpu_harness/dsa_ops.py computes what its kernel computes.

They stand in for the two DSA kernel families that have no registry release at
v0.16.0's pins, so the harness does not build them: FlashMLA's sparse attention
and DeepGEMM's indexer logits; vLLM's own DSA ops are built (kernels.py). Their
tests are not marked ``gpu`` (CPU in CI, CUDA when present). Where a real
``deep_gemm`` is installed (the real wheel's environment), the ``built_deep_gemm``
tests (marked ``gpu``) hold it to the same references through vLLM's wrappers;
without one they are reported skipped.
References: float64 Python loops from the kernels' sources (layouts and formulas quoted
here and in dsa_ops.py), rounded to float32 or bf16 where the kernel does; the fp8 MLA
cache decoded by a literal e4m3 decoder."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

import dsa_ops as dsa
from gpu_e2e_helpers import REPO_ROOT
from gpu_e2e_helpers import gen as _gen
from gpu_e2e_helpers import randn as _randn
from gpu_e2e_helpers import tensor as _t

DSA_PATH = REPO_ROOT / "tools" / "gpu_harness" / "dsa_ops.py"
HELPERS_PATH = REPO_ROOT / "tests" / "e2e" / "gpu" / "gpu_e2e_helpers.py"
dsa.register({"_flashmla_C": "_flashmla_C_dsa_test"})
FMLA = torch.ops._flashmla_C_dsa_test

FP8, BF16, I32 = torch.float8_e4m3fn, torch.bfloat16, torch.int32
NEG_INF = float("-inf")


# --- literal number formats --------------------------------------------------
def f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def e4m3_decode(byte: int) -> float:
    s, e, m = (-1.0 if byte & 0x80 else 1.0), (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return float("nan")
    return s * m * 2.0**-9 if e == 0 else s * (1 + m / 8) * 2.0 ** (e - 7)


def bf16(v: float) -> float:
    return float(torch.tensor([v], dtype=torch.float32).to(BF16).float()[0])


def f32_bytes(v: float) -> list[int]:
    return list(struct.pack("<f", v))


def _fp8_random(shape, device, seed):
    # Random finite e4m3 codes (0x7F / 0xFF are NaN).
    b = torch.randint(0, 256, shape, generator=_gen(seed, "cpu"), dtype=torch.int64)
    return torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8).to(device).view(FP8)


# --- DeepGEMM logits ---------------------------------------------------------
D_IDX = 128  # index_head_dim of DeepSeek-V3.2 and GLM-5
BS = 4


# Tolerance: the kernel (and the stand-in) sum 128 exact fp8 products and up
# to 4 heads in float32; the reference sums in float64. Relative error is
# bounded by ~ (128 + 4) * 2^-24 of the sum of magnitudes, below 1e-5 here.
def _logit_ref(qm, kn, wm, scale):
    return sum(max(sum(a * b for a, b in zip(qm[h], kn)), 0.0) * wm[h] for h in range(len(qm))) * scale


def test_fp8_mqa_logits(device):
    m, n, h = 4, 7, 4
    q = _fp8_random((m, h, D_IDX), device, 4)
    k = _fp8_random((n, D_IDX), device, 5)
    ks_ = torch.rand(n, generator=_gen(6, "cpu")).to(device) + 0.5
    w = _randn((m, h), torch.float32, device, seed=7)
    ks, ke = _t([0, 0, 2, 3], device), _t([1, 3, 5, 7], device)
    out = dsa.fp8_mqa_logits(q, (k, ks_), w, ks, ke, clean_logits=False)
    assert out.shape == (m, n) and out.dtype == torch.float32
    qf, kf = q.float().cpu().tolist(), k.float().cpu().tolist()
    wf, sf = w.cpu().tolist(), ks_.cpu().tolist()
    for i in range(m):
        for j in range(n):
            if int(ks[i]) <= j < int(ke[i]):
                ref = _logit_ref(qf[i], kf[j], wf[i], sf[j])
                assert math.isclose(float(out[i, j]), ref, rel_tol=1e-5, abs_tol=1e-3), (i, j)
            else:
                assert float(out[i, j]) == NEG_INF


def _indexer_cache(nb, bs, scale_step, device):
    """The indexer K cache packed byte by byte as vLLM's built
    indexer_k_quant_and_cache writes it (csrc/cache_kernels.cu:437): per block,
    every token's fp8 K first (token o at o*D_IDX), then every token's fp32
    scale (at bs*D_IDX + o*4). -> (uint8 [nb, bs, 1, D_IDX + 4], keys as
    float lists, scales)."""
    keys = _fp8_random((nb, bs, D_IDX), "cpu", 8)
    scales = [[0.25 + scale_step * (blk * bs + o) for o in range(bs)] for blk in range(nb)]
    raw = [keys[blk].view(torch.uint8).reshape(-1).tolist()
           + [byte for o in range(bs) for byte in f32_bytes(scales[blk][o])] for blk in range(nb)]
    cache = torch.tensor(raw, dtype=torch.uint8).reshape(nb, bs, 1, D_IDX + 4).to(device)
    return cache, keys.float().tolist(), scales


def _paged_cells(ctx, block_table, next_n, max_len, bs):
    """(row, request, draft position, key position, (block, offset) or None
    where the key lies after the query and the logit is -inf)."""
    for bi, n in enumerate(ctx):
        for j in range(next_n):
            qpos = n - next_n + j
            for pos in range(max_len):
                yield (bi * next_n + j, bi, j, pos,
                       (block_table[bi][pos // bs], pos % bs) if pos <= qpos else None)


def test_fp8_paged_mqa_logits(device):
    b, next_n, h, nb, max_len = 2, 2, 4, 6, 12
    ctx, block_table = [5, 7], [[4, 0, 0], [2, 5, 1]]
    cache, kf, scales = _indexer_cache(nb, BS, 0.1, device)
    q = _fp8_random((b, next_n, h, D_IDX), device, 9)
    w = _randn((b * next_n, h), torch.float32, device, seed=10)
    ctx_t = _t(ctx, device)
    meta = dsa.get_paged_mqa_logits_metadata(ctx_t, BS, 8)
    out = dsa.fp8_paged_mqa_logits(q, cache, w, ctx_t, _t(block_table, device), meta, max_len,
                                   clean_logits=False)
    assert out.shape == (b * next_n, max_len)
    qf, wf = q.float().cpu().tolist(), w.cpu().tolist()
    for row, bi, j, pos, at in _paged_cells(ctx, block_table, next_n, max_len, BS):
        if at is None:
            assert float(out[row, pos]) == NEG_INF
        else:
            ref = _logit_ref(qf[bi][j], kf[at[0]][at[1]], wf[row], f32(scales[at[0]][at[1]]))
            assert math.isclose(float(out[row, pos]), ref, rel_tol=1e-5, abs_tol=1e-3)


def test_paged_mqa_logits_metadata_splits_all_blocks():
    # [num_sms + 1, 2] int32: SM i starts at (request, block) = cumulative
    # share i*total/num_sms of the blocks; the last row is the end (B, 0).
    ctx = torch.tensor([5, 7, 1], dtype=I32)  # 2 + 2 + 1 blocks of 4
    meta = dsa.get_paged_mqa_logits_metadata(ctx, 4, 5)
    assert meta.dtype == I32 and meta.shape == (6, 2)
    assert meta.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [3, 0]]


# --- A real DeepGEMM, through vLLM's wrappers ----------------------------------
# The same literal references, now for the kernel itself: what vLLM's
# vllm.utils.deep_gemm wrappers return over an installed deep_gemm, on the
# kernel's own shapes (block_kv 64 for the paged cache, next_n 1 or 2) and
# head counts: index_n_heads 32 (GLM-5) and 64 (DeepSeek-V3.2;
# tests/transformers_utils/data/*/config.json).
# The kernel (sm90_fp8_mqa_logits.cuh): for each (query m, key n), the fp8
# dot product per head, max(., 0), times the head weight, summed over heads,
# times the key's scale. q carries no scale: the indexer folds q's ue8m0
# scale into the weights (deepseek_v2.py:707).
# Tolerance: Hopper's fp8 tensor cores accumulate with fewer bits than
# float32, so the bound is relative to the sum of the terms' magnitudes.
def _built_deep_gemm():
    import importlib

    try:
        real = importlib.import_module("deep_gemm")
    except ImportError as e:
        pytest.skip(f"needs a real deep_gemm ({e}): DeepGEMM as the real wheel's environment "
                    "installs it (v0.16.0's tools/install_deepgemm.sh); kernels.py builds none")
    if getattr(real, "__file__", None) is None:
        pytest.skip("needs a real deep_gemm: the one importable is dsa_ops.py's stand-in "
                    "(EAGLE3_HARNESS_DSA=1), which the tests above check")
    from vllm.utils import deep_gemm as vdg

    return real, vdg


def _logit_ref_and_magnitude(qm, kn, wm, scale):
    ref = mag = 0.0
    for h in range(len(qm)):
        dot = sum(a * b for a, b in zip(qm[h], kn))
        ref += max(dot, 0.0) * wm[h]
        mag += sum(abs(a * b) for a, b in zip(qm[h], kn)) * abs(wm[h])
    return ref * scale, mag * abs(scale)


def _assert_logit(got, qm, kn, wm, scale, where):
    ref, mag = _logit_ref_and_magnitude(qm, kn, wm, scale)
    assert abs(got - ref) <= 1e-3 * mag + 1e-3, (where, got, ref, mag)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [32, 64])
def test_built_deep_gemm_mqa_logits(heads):
    _, vdg = _built_deep_gemm()
    m, n = 4, 300
    q = _fp8_random((m, heads, D_IDX), "cuda", 4)
    k = _fp8_random((n, D_IDX), "cuda", 5)
    ks_ = torch.rand(n, generator=_gen(6, "cpu")).cuda() + 0.5
    w = _randn((m, heads), torch.float32, "cuda", seed=7)
    starts, ends = [0, 0, 100, 250], [1, 129, 300, 300]
    out = vdg.fp8_mqa_logits(q, (k, ks_), w, _t(starts, "cuda"), _t(ends, "cuda"), clean_logits=True)
    assert out.shape == (m, n) and out.dtype == torch.float32
    out, qf, kf = out.cpu().tolist(), q.float().cpu().tolist(), k.float().cpu().tolist()
    wf, sf = w.cpu().tolist(), ks_.cpu().tolist()
    for i in range(m):
        for j in range(n):
            if starts[i] <= j < ends[i]:
                _assert_logit(out[i][j], qf[i], kf[j], wf[i], sf[j], (i, j))
            else:
                assert out[i][j] == NEG_INF, (i, j)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,next_n", [(32, 1), (64, 2)])
def test_built_deep_gemm_paged_mqa_logits(heads, next_n):
    real, vdg = _built_deep_gemm()
    bs, nb, max_len = 64, 5, 192
    ctx, block_table = [70, 130], [[3, 0, 0], [1, 4, 2]]
    cache, kf, scales = _indexer_cache(nb, bs, 0.01, "cuda")  # at the kernel's block size
    b = len(ctx)
    q = _fp8_random((b, next_n, heads, D_IDX), "cuda", 9)
    w = _randn((b * next_n, heads), torch.float32, "cuda", seed=10)
    ctx_t = _t(ctx, "cuda")
    meta = vdg.get_paged_mqa_logits_metadata(ctx_t, bs, real.get_num_sms())
    out = vdg.fp8_paged_mqa_logits(q, cache, w, ctx_t, _t(block_table, "cuda"), meta, max_len, clean_logits=True)
    assert out.shape == (b * next_n, max_len)
    out, qf, wf = out.cpu().tolist(), q.float().cpu().tolist(), w.cpu().tolist()
    for row, bi, j, pos, at in _paged_cells(ctx, block_table, next_n, max_len, bs):
        if at is None:
            assert out[row][pos] == NEG_INF, (row, pos)
        else:
            _assert_logit(out[row][pos], qf[bi][j], kf[at[0]][at[1]], wf[row], f32(scales[at[0]][at[1]]), (row, pos))


# --- FlashMLA sparse ----------------------------------------------------------
def _ds_mla_cache(nb, bs, seed):
    """An fp8_ds_mla cache from literal parts -> (uint8 tensor, dequantized keys [nb][bs][576]).

    Each 656-byte token as vLLM's built concat_and_cache_mla writes it
    (csrc/cache_kernels.cu:334 concat_and_cache_ds_mla_kernel): 512 fp8 NoPE codes, the 4
    per-128 scales as fp32 at byte 512, the 64 RoPE values as bf16 at byte 528. Dequantized
    as FlashMLA's SM90 decode does: NoPE = bf16(float(fp8) * bf16(scale))."""
    g = _gen(seed, "cpu")
    raw, deq = [], []
    for blk in range(nb):
        rb, db = [], []
        for off in range(bs):
            codes = _fp8_random((512,), "cpu", seed * 100 + blk * bs + off).view(torch.uint8).tolist()
            # 0.01 * k is not a bf16 value: rounding the scale to bf16 first shows.
            scales = [0.01 * (1 + (blk * bs + off + i) % 5) for i in range(4)]
            rope = (torch.randn(64, generator=g) * 0.3).to(BF16)
            rb.append(codes + [x for s in scales for x in f32_bytes(s)] + rope.view(torch.uint8).tolist())
            sc = [bf16(f32(x)) for x in scales]
            nope = [bf16(f32(e4m3_decode(c) * sc[i // 128])) for i, c in enumerate(codes)]
            db.append(nope + rope.float().tolist())
        raw.append(rb)
        deq.append(db)
    return torch.tensor(raw, dtype=torch.uint8), deq


# The reference does the softmax in float64 over the selected keys. Tolerance:
# out is bfloat16 (relative rounding 2^-8) of an fp32 computation, so
# |out - ref| <= 2^-8 |ref| + 1e-3; lse and max in fp32: 1e-4 absolute.
def _attend_ref(qv, keys, valid, sm_scale, sink=None):
    """qv [576]; keys list of [576]; valid list of bool -> (out[512], max, lse), natural log."""
    scores = [sum(a * b for a, b in zip(qv, kk)) * sm_scale for kk, ok in zip(keys, valid) if ok]
    vs = [kk for kk, ok in zip(keys, valid) if ok]
    if not scores:
        return [0.0] * 512, NEG_INF, NEG_INF
    mx = max(scores)
    lse = mx + math.log(sum(math.exp(s - mx) for s in scores))
    out = [sum(math.exp(s - lse) * v[d] for s, v in zip(scores, vs)) for d in range(512)]
    f = 1.0 if sink is None else 1.0 / (1.0 + math.exp(sink - lse))
    return [o * f for o in out], mx, lse


def _close_list(got, ref, rel=2**-8, abs_=1e-3):
    return all(abs(g - r) <= rel * abs(r) + abs_ for g, r in zip(got, ref))


@pytest.mark.parametrize("variant", ["plain", "topk_length", "attn_sink"])
def test_sparse_prefill_fwd(device, variant):
    s_q, h_q, s_kv, topk, heads_checked = 3, 64, 10, 4, 6
    q = _randn((s_q, h_q, 576), BF16, device, seed=18, scale=0.3)
    kv = _randn((s_kv, 1, 576), BF16, device, seed=19, scale=0.3)
    idx = [[2, -1, 7, 3], [9, 0, 12, 5], [-1, -1, -1, -1]]  # 12 >= s_kv: skipped
    topk_len = [4, 3, 4] if variant == "topk_length" else None
    sink = _randn((h_q,), torch.float32, device, seed=20) if variant == "attn_sink" else None
    sm_scale = 576**-0.5
    out, mx, lse = FMLA.sparse_prefill_fwd(q, kv, _t(idx, device).view(s_q, 1, topk), sm_scale, 512,
                                           sink, _t(topk_len, device) if topk_len else None)
    assert out.shape == (s_q, h_q, 512) and out.dtype == BF16
    qf, kf = q.float().cpu().tolist(), kv[:, 0].float().cpu().tolist()
    for s in range(s_q):
        valid = [0 <= i < s_kv and (topk_len is None or j < topk_len[s]) for j, i in enumerate(idx[s])]
        keys = [kf[i] if ok else None for i, ok in zip(idx[s], valid)]
        for h in range(heads_checked):
            ro, rmx, rlse = _attend_ref(qf[s][h], keys, valid, sm_scale,
                                        None if sink is None else float(sink[h]))
            assert _close_list(out[s, h].float().cpu().tolist(), ro), (s, h)
            if rlse == NEG_INF:  # no valid key: out 0, max -inf, lse +inf
                assert float(mx[s, h]) == NEG_INF and float(lse[s, h]) == float("inf")
            else:  # natural log, as FlashMLA tests/ref.py defines them
                assert math.isclose(float(mx[s, h]), rmx, abs_tol=1e-4)
                assert math.isclose(float(lse[s, h]), rlse, abs_tol=1e-4)


def test_sparse_prefill_fwd_rejects_head_counts_the_kernel_rejects():
    q, kv = torch.zeros((1, 16, 576), dtype=BF16), torch.zeros((2, 1, 576), dtype=BF16)
    with pytest.raises(RuntimeError, match="h_q"):
        FMLA.sparse_prefill_fwd(q, kv, torch.zeros((1, 1, 1), dtype=I32), 1.0, 512, None, None)


def test_sparse_decode_fwd(device):
    nb, pbs, b, h_q, topk, heads_checked = 3, 2, 3, 64, 3, 5
    cache, deq = _ds_mla_cache(nb, pbs, 21)
    flat = [deq[blk][off] for blk in range(nb) for off in range(pbs)]
    q = _randn((b, 1, h_q, 576), BF16, device, seed=22, scale=0.5)
    idx = [[5, 0, -1], [2, 3, 4], [-1, -1, -1]]
    topk_len = _t([3, 2, 3], device)
    sm_scale = 576**-0.5
    out, lse, meta, splits = FMLA.sparse_decode_fwd(
        q, cache.to(device).view(nb, pbs, 1, 656), _t(idx, device).view(b, 1, topk),
        topk_len, None, None, None, None, None, None, 512, sm_scale)
    assert out.shape == (b, 1, h_q, 512) and lse.shape == (b, h_q, 1)
    qf = q.float().cpu().tolist()
    for bi in range(b):
        valid = [i >= 0 and j < int(topk_len[bi]) for j, i in enumerate(idx[bi])]
        keys = [flat[i] if ok else None for i, ok in zip(idx[bi], valid)]
        for h in range(heads_checked):
            ro, _, rlse = _attend_ref(qf[bi][0][h], keys, valid, sm_scale)
            assert _close_list(out[bi, 0, h].float().cpu().tolist(), ro), (bi, h)
            if rlse == NEG_INF:  # FlashMLA decode: out 0 and lse +inf
                assert float(lse[bi, h, 0]) == float("inf")
            else:
                assert math.isclose(float(lse[bi, h, 0]), rlse, abs_tol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="CUDA-graph capture needs a CUDA GPU (runs on the device harness)")
def test_decode_path_ops_capture_in_a_cuda_graph():
    # The decode-time stand-ins must run under CUDA-graph capture: no host
    # reads of device values, no data-dependent shapes. Capture fails with
    # "operation not permitted when stream is capturing" otherwise.
    dev = "cuda"
    b, next_n, h, nb, max_len, k = 2, 1, 4, 6, 16, 4
    # Indexer K cache in the built indexer_k_quant_and_cache's block layout
    # (csrc/cache_kernels.cu:437): every token's fp8 K, then its fp32 scale.
    keys = _fp8_random((nb, BS * D_IDX), dev, 29).view(torch.uint8)
    scales = torch.full((nb, BS), 0.5, device=dev).view(torch.uint8)
    idx_cache = torch.cat([keys, scales], dim=1).view(nb, BS, D_IDX + 4)
    # bf16 MLA cache (kv_cache_dtype "auto": each slot a row [kv_c | k_pe]).
    mla_cache = _randn((nb, BS, 576), BF16, dev, 30)
    fp8_cache, _ = _ds_mla_cache(nb, BS, 33)
    fp8_cache = fp8_cache.to(dev).view(nb, BS, 1, 656)
    q_fp8 = _fp8_random((b, next_n, h, D_IDX), dev, 31)
    w = _randn((b * next_n, h), torch.float32, dev, 32)
    ctx = _t([5, 9], dev)
    bt = _t([[0, 1, 2, 3], [4, 5, 0, 0]], dev)
    q_mla = _randn((b, 64, 576), BF16, dev, 34)

    def step():
        meta = dsa.get_paged_mqa_logits_metadata(ctx, BS, 8)
        logits = dsa.fp8_paged_mqa_logits(q_fp8, idx_cache.unsqueeze(-2), w, ctx, bt, meta,
                                          max_len, False)
        # torch.topk where vLLM calls the built top_k_per_row_decode.
        top = torch.topk(logits, k, dim=-1).indices.to(I32).view(b, 1, k)
        prefill = FMLA.sparse_prefill_fwd(q_mla, mla_cache.view(-1, 1, 576), top, 0.1, 512,
                                          None, None)[0]
        decode = FMLA.sparse_decode_fwd(q_mla.view(b, 1, 64, 576), fp8_cache, top, None, None,
                                        None, None, None, None, None, 512, 0.1)[0]
        return prefill, decode

    step()  # warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.isfinite(o.float()).all() for o in static_out)


# --- installation under the real names ---------------------------------------
_PRELUDE = """\
import importlib.util, sys, torch
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec); sys.modules[name] = m
    spec.loader.exec_module(m); return m
"""


def _run(code: str, pythonpath: str | None = None) -> str:
    """Runs _PRELUDE + code in a fresh interpreter, without the start-up hook's
    switch (the code installs the stand-ins itself), from an empty directory
    (``-c`` puts the working directory first on sys.path, and the repository
    root's vllm/ tree must not shadow the installed wheel); returns its last
    stdout line."""
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3_HARNESS_DSA"}
    if pythonpath:  # first, ahead of the device's site directory
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(code)],
                              capture_output=True, text=True, timeout=120, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_install_makes_vllm_resolve_the_deep_gemm_stand_in():
    pytest.importorskip("vllm")
    out = _run(f"""
        try:
            import vllm._C  # a real (CPU) build loads first; its ops win
        except Exception:
            pass
        m = load("vllm._gpu_harness_dsa_ops", {str(DSA_PATH)!r})
        before = {{q for q in m.OP_NAMES if m._op_exists(*q.split("::"))}}
        done = m.install()
        assert set(done) | before == set(m.OP_NAMES), (done, before)
        assert importlib.util.find_spec("deep_gemm") is not None
        import vllm._flashmla_C, vllm._flashmla_extension_C
        from vllm.utils import deep_gemm as dg
        q = torch.ones((1, 2, 128)).to(torch.float8_e4m3fn)
        k = torch.ones((3, 128)).to(torch.float8_e4m3fn)
        logits = dg.fp8_mqa_logits(q, (k, torch.full((3,), 0.5)), torch.ones((1, 2)),
                                   torch.zeros(1, dtype=torch.int32),
                                   torch.full((1,), 2, dtype=torch.int32), clean_logits=False)
        assert dg._fp8_mqa_logits_impl is m.fp8_mqa_logits
        assert dg._fp8_paged_mqa_logits_impl is m.fp8_paged_mqa_logits
        assert dg._get_paged_mqa_logits_metadata_impl is m.get_paged_mqa_logits_metadata
        sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 1
        assert dg.get_num_sms() == sms
        # The engines' facts name the stand-ins as such.
        providers = load("gpu_e2e_helpers", {str(HELPERS_PATH)!r}).op_providers()
        assert providers["deep_gemm._C"].startswith("stand-in GPU-harness stand-in for DeepGEMM"), providers
        assert providers["vllm._flashmla_C"].startswith("stand-in GPU-harness stand-in"), providers
        print(logits.tolist())
    """)
    # (128 * 1 * 1 per head, 2 heads of weight 1) * scale 0.5 = 128; key 2 is out of range.
    assert out == "[[128.0, 128.0, -inf]]"


def test_install_leaves_a_real_deep_gemm_alone(tmp_path):
    # A real deep_gemm (here a package on the path, as a wheel installs it)
    # wins: install() neither shadows nor imports it, and vLLM resolves it.
    pytest.importorskip("vllm")
    (tmp_path / "deep_gemm").mkdir()
    (tmp_path / "deep_gemm" / "__init__.py").write_text(
        "def fp8_mqa_logits(*args, **kwargs):\n    return 'the real deep_gemm ran'\n")
    out = _run(f"""
        m = load("vllm._gpu_harness_dsa_ops", {str(DSA_PATH)!r})
        m.install()
        assert "deep_gemm" not in sys.modules
        from vllm.utils import deep_gemm as dg
        got = dg.fp8_mqa_logits(None, (None, None), None, None, None, clean_logits=False)
        print(got, sys.modules["deep_gemm"].__file__)
    """, pythonpath=str(tmp_path))
    assert out == f"the real deep_gemm ran {tmp_path / 'deep_gemm' / '__init__.py'}"


def _flashmla_interface_source() -> str:
    """vllm/third_party/flashmla/flash_mla_interface.py of the pinned CUDA wheel (cached)."""
    import zipfile

    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))
    from tools._common import StackError, load_pin
    from tools.fetch import ensure

    try:
        wheel = ensure(load_pin().artifact("wheel-x86_64"), offline=True)
    except StackError as e:
        pytest.skip(f"the pinned CUDA wheel is not cached ({e}); run python -m tools.fetch wheel-x86_64")
    with zipfile.ZipFile(wheel) as z:
        return z.read("vllm/third_party/flashmla/flash_mla_interface.py").decode()


def test_flashmla_interface_calls_reach_the_stand_ins_with_the_right_arguments(tmp_path):
    # The wheel's own interface calls torch.ops._flashmla_C.* positionally; a
    # schema with two arguments swapped would pass attn_sink as topk_length.
    # Every optional argument gets a non-default value, and the result must
    # equal a direct call that names each argument.
    pytest.importorskip("vllm")
    iface = tmp_path / "flash_mla_interface.py"
    iface.write_text(_flashmla_interface_source())
    out = _run(f"""
        try:
            import vllm._C
        except Exception:
            pass
        dsa = load("vllm._gpu_harness_dsa_ops", {str(DSA_PATH)!r})
        dsa.install()
        fi = load("flash_mla_interface", {str(iface)!r})
        g = torch.Generator().manual_seed(0)
        q = (torch.randn((3, 64, 576), generator=g) * 0.3).to(torch.bfloat16)
        kv = (torch.randn((9, 1, 576), generator=g) * 0.3).to(torch.bfloat16)
        idx = torch.tensor([[[1, 4, 8]], [[0, 2, 7]], [[5, -1, 3]]], dtype=torch.int32)
        sink = torch.randn(64, generator=g)
        tl = torch.tensor([2, 3, 1], dtype=torch.int32)
        via = fi.flash_mla_sparse_fwd(q, kv, idx, 0.05, 512, sink, tl)
        direct = dsa.sparse_prefill_fwd(q=q, kv=kv, indices=idx, sm_scale=0.05, d_v=512,
                                        attn_sink=sink, topk_length=tl)
        assert all(torch.equal(a, b) for a, b in zip(via, direct))
        assert not torch.equal(via[0], fi.flash_mla_sparse_fwd(q, kv, idx, 0.05)[0])

        cache = torch.randint(0, 120, (2, 4, 1, 656), generator=g, dtype=torch.uint8)
        cache[..., 512:528] = torch.full((2, 4, 1, 4), 0.02).view(torch.uint8)
        qd = (torch.randn((2, 1, 64, 576), generator=g) * 0.3).to(torch.bfloat16)
        idx_d = torch.tensor([[[0, 5, 7]], [[3, 1, -1]]], dtype=torch.int32)
        tl_d = torch.tensor([3, 2], dtype=torch.int32)
        meta, _ = fi.get_mla_metadata()
        kw = dict(softmax_scale=0.05, is_fp8_kvcache=True, indices=idx_d, attn_sink=sink,
                  topk_length=tl_d)
        o, lse = fi.flash_mla_with_kvcache(qd, cache, None, None, 512, meta, **kw)
        o2, lse2, _, _ = dsa.sparse_decode_fwd(
            q=qd, kv=cache, indices=idx_d, topk_length=tl_d, attn_sink=sink,
            tile_scheduler_metadata=None, num_splits=None, extra_kv=None, extra_indices=None,
            extra_topk_length=None, d_v=512, sm_scale=0.05)
        assert torch.equal(o, o2) and torch.equal(lse, lse2)
        # the scheduler state the interface keeps is reused on the next call
        assert torch.equal(o, fi.flash_mla_with_kvcache(qd, cache, None, None, 512, meta, **kw)[0])
        print("ok", tuple(o.shape), tuple(lse.shape))
    """)
    assert out == "ok (2, 1, 64, 512) (2, 64, 1)"


# --- dsa_check.py's float64 reference (the GPU test's yardstick) can fail ----
@pytest.fixture(scope="module")
def dsa_target(tmp_path_factory):
    """The tiny GLM-5 target of dsa_check.py, written once."""
    sys.path.insert(0, str(REPO_ROOT / "tools" / "gpu_harness"))
    import dsa_check

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE3_GPU_PROFILE", "eager")
        return dsa_check.write_models("glm5", tmp_path_factory.mktemp("dsa_target"))[0]


@pytest.mark.parametrize("length,run,ok", [
    (100, {"sparse": False}, True),  # the prompt fits in index_topk: dense is sparse
    (200, {"sparse": False}, False),  # the indexer drops keys; dense states must fail
    (256, {"relu": False}, False),  # transformers 5's indexer, without the ReLU
    (256, {}, True),  # the reference's own float64 sparse states
])
def test_dsa_reference_tells_right_states_from_wrong(dsa_target, tmp_path, monkeypatch, length, run, ok):
    # Passes the right sparse states; refuses dense ones once the indexer drops keys, or a wrong indexer.
    monkeypatch.setenv("EAGLE3_GPU_PROFILE", "eager")
    import dsa_check
    import gpu_e2e_helpers as h

    prompt = h.token_prompts([length], seed=0)[0]["prompt_token_ids"]
    states = dsa_check.layer_inputs(dsa_target, prompt, {"run": run})[0]["run"]
    aux = torch.cat([states[k] for k in dsa_check.AUX_IDS], -1).float()
    torch.save({"aux": aux, "layer_ids": list(dsa_check.AUX_IDS), "prompt": prompt}, tmp_path / "aux.pt")
    res = dsa_check.reference(dsa_target, tmp_path / "aux.pt", tmp_path / "ref.json")
    assert res["ok"] is ok, res
    assert res["rows_with_a_choice_per_layer"] == max(0, length - 128)
