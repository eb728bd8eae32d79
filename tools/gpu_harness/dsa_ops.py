# SPDX-License-Identifier: Apache-2.0
"""Torch stand-ins for the two DSA kernel families the harness does not build.

GLM-5 and DeepSeek-V3.2 run DeepSeek Sparse Attention (DSA) through
FLASHMLA_SPARSE. Two of the kernels on that path have no registry release at
the versions vLLM v0.16.0 pins, so kernels.py does not build them: FlashMLA's
sparse kernels (``_flashmla_C``; FlashMLA c2afa9cb) and DeepGEMM's indexer
logits (``deep_gemm``; the ref of v0.16.0's tools/install_deepgemm.sh).
This module stands in for those two, and for nothing else: every vLLM ``_C``
/ ``_C_cache_ops`` op the DSA path calls (the indexer's fp8 quantization, its
K cache, top-k per row, the MLA cache write and gather) is built from the
pinned sdist by tools/gpu_harness/kernels.py, and install() leaves a real,
importable ``deep_gemm`` alone. docs/gpu-dsa.md lists the kernels with their
v0.16.0 call sites.

What each stand-in computes is written next to it, read from the kernel's
interface and its reference (FlashMLA ``csrc/api/sparse_fwd.h``,
``sparse_decode.h`` and ``tests/ref.py``, DeepGEMM
``sm90_fp8_mqa_logits.cuh``); where a kernel leaves a choice open (logits
outside a row when ``clean_logits`` is False) the stand-in picks one result
the kernel can produce and says which. ``tests/e2e/gpu/test_harness_dsa_ops.py``
checks each op against a literal reference.

Kept free of vLLM imports (it is imported while ``vllm`` itself is importing).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------
# DeepGEMM (a stand-in for the ``deep_gemm`` module)
# ---------------------------------------------------------------------------
# The paged logits read the indexer K cache that vLLM's built
# indexer_k_quant_and_cache writes (csrc/cache_kernels.cu:437): uint8
# [num_blocks, block_size, head_dim + head_dim/128*4], but inside one block
# the rows are NOT head_dim+4 bytes each: the block's first
# block_size*head_dim bytes hold every token's fp8 K (token t at t*head_dim),
# the next block_size*(head_dim/128)*4 bytes the fp32 scales (token t, group
# g at block_size*head_dim + (t*head_dim/128+g)*4).


def _indexer_block_views(kv_cache: torch.Tensor, head_dim: int, quant_block_size: int):
    nb, bs, stride = kv_cache.shape
    groups = head_dim // quant_block_size
    # view, not reshape: never a silent copy of the whole cache on each call.
    flat = kv_cache.view(torch.uint8).view(nb, bs * stride)
    k_part = flat[:, : bs * head_dim].reshape(nb, bs, head_dim)
    s_part = flat[:, bs * head_dim: bs * head_dim + bs * groups * 4].reshape(nb, bs, groups * 4)
    return k_part, s_part


# sm90_fp8_mqa_logits.cuh: for each (query m, key n) the kernel takes the fp8
# WGMMA dot product per head in fp32, applies max(., 0), multiplies by the
# head weight, sums over heads in fp32 and multiplies the sum by the key's
# scale: logits[m, n] = (sum_h relu(q[m,h]·k[n]) * w[m,h]) * k_scale[n].
# (q carries no scale: the indexer folds q's ue8m0 scale into the weights,
# deepseek_v2.py:707.)


def _mqa_logits_core(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q [..., M, H, D] fp8, k [..., N, D] fp8, w [..., M, H] -> [..., M, N]
    fp32 (before the key scale)."""
    scores = torch.einsum("...mhd,...nd->...mhn", q.float(), k.float())
    return (scores.clamp_min(0) * w.float()[..., None]).sum(dim=-2)


def fp8_mqa_logits(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool = True,
) -> torch.Tensor:
    """DeepGEMM ``fp8_mqa_logits(q [M,H,D] e4m3, (k [N,D] e4m3, k_scales [N]
    f32), weights [M,H] f32, ks [M], ke [M], clean_logits)`` -> [M, N] f32.
    Only columns in [ks[m], ke[m]) are defined. The kernel leaves the others
    unwritten when clean_logits is False; here they are always -inf (what
    clean_logits=True gives), which no consumer may depend on either way."""
    k_fp8, k_scales = kv
    m, h = q.shape[0], q.shape[1]
    n = k_fp8.shape[0]
    # Row chunks keep the [rows, H, N] fp32 scores near 256 MiB (shapes only).
    step = max(1, (1 << 26) // max(1, h * n))
    logits = torch.cat([_mqa_logits_core(q[i:i + step], k_fp8, weights[i:i + step])
                        for i in range(0, m, step)] or [q.new_empty((0, n), dtype=torch.float32)])
    logits = logits * k_scales.reshape(1, n).float()
    cols = torch.arange(n, device=q.device)
    inside = (cols[None, :] >= cu_seqlen_ks.to(torch.int64)[:, None]) & (
        cols[None, :] < cu_seqlen_ke.to(torch.int64)[:, None]
    )
    return torch.where(inside, logits, torch.full_like(logits, float("-inf")))


def get_paged_mqa_logits_metadata(
    context_lens: torch.Tensor, block_size: int, num_sms: int
) -> torch.Tensor:
    """DeepGEMM returns int32 [num_sms + 1, 2]: for each SM the (request,
    KV-split) where its share of the paged-logits work starts, the last row the
    end. Only ``fp8_paged_mqa_logits`` reads it, and the stand-in below does
    not need a schedule, so this computes an equal split of the KV blocks over
    the SMs in that shape (split unit = one cache block), on the device."""
    lens = context_lens.reshape(-1).to(torch.int64)
    blocks = (lens + block_size - 1) // block_size
    cum = torch.cumsum(blocks, 0)
    sm = torch.arange(num_sms + 1, device=lens.device, dtype=torch.int64)
    start = sm * cum[-1:] // num_sms
    req = torch.searchsorted(cum, start, right=True)
    prev = torch.where(req > 0, cum[(req - 1).clamp_min(0)], torch.zeros_like(req))
    return torch.stack([req, start - prev], dim=1).to(torch.int32)


def fp8_paged_mqa_logits(
    q_fp8: torch.Tensor,
    kv_cache_fp8: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    schedule_metadata: torch.Tensor,
    max_model_len: int,
    clean_logits: bool = True,
) -> torch.Tensor:
    """DeepGEMM ``fp8_paged_mqa_logits``: q [B, next_n, H, D] e4m3, cache uint8
    [num_blocks, block_size, 1, D + 4] (the block layout above), weights
    [B*next_n, H], context_lens [B], block_tables [B, nb] -> logits
    [B*next_n, max_model_len] f32. Row b*next_n + j is the query at position
    context_lens[b] - next_n + j; columns are logical key positions, defined
    for 0 <= n <= that position (-inf elsewhere, see fp8_mqa_logits). Same
    formula as fp8_mqa_logits. Fixed shapes: every block a row could reach is
    gathered and masked."""
    b, next_n, h, d = q_fp8.shape
    nb_cache, bs = kv_cache_fp8.shape[0], kv_cache_fp8.shape[1]
    cache = kv_cache_fp8.reshape(nb_cache, bs, -1)
    k_part, s_part = _indexer_block_views(cache, d, 128)
    nblk = min(block_tables.shape[1], (max_model_len + bs - 1) // bs)
    tbl = block_tables[:, :nblk].to(torch.int64).clamp(0, nb_cache - 1)
    k = k_part[tbl].reshape(b, nblk * bs, d).view(FP8)
    scale = s_part[tbl].reshape(b, nblk * bs, -1)[..., :4].contiguous().view(torch.float32)
    w = weights[: b * next_n].reshape(b, next_n, h)
    logits = _mqa_logits_core(q_fp8, k, w) * scale.reshape(b, 1, nblk * bs)
    out = torch.full((b, next_n, max_model_len), float("-inf"), dtype=torch.float32,
                     device=q_fp8.device)
    width = min(nblk * bs, max_model_len)
    pos = torch.arange(width, device=q_fp8.device)
    last = context_lens.reshape(b, 1).to(torch.int64) - next_n + torch.arange(
        next_n, device=q_fp8.device)[None, :]
    valid = pos[None, None, :] <= last[..., None]
    out[..., :width] = torch.where(valid, logits[..., :width], out[..., :width])
    return out.reshape(b * next_n, max_model_len)


def get_num_sms() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 1


# ---------------------------------------------------------------------------
# FlashMLA sparse (FlashMLA csrc/api/sparse_fwd.h, sparse_decode.h;
# semantics: FlashMLA tests/ref.py ref_sparse_attn_fwd / ref_sparse_attn_decode.
# The kernels take bf16 q and keys, accumulate in fp32 and round out to bf16;
# they also round the softmax weights to bf16 for the P·V product, which the
# stand-in keeps in fp32, so the two agree to bf16 rounding, not bit for bit.)
# ---------------------------------------------------------------------------
DS_MLA_BYTES = 656  # fp8_ds_mla token: 512 fp8 + 4 * fp32 + 64 * bf16


def _dequant_ds_mla(tokens: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 656] (the layout vLLM's built concat_and_cache_mla writes
    for fp8_ds_mla, csrc/cache_kernels.cu:334: NoPE fp8 at byte 0, 4 fp32
    scales at 512, RoPE bf16 at 528) -> bf16 [..., 576], RoPE copied. NoPE as
    FlashMLA's SM90 sparse decode dequantizes it
    (sm90/decode/sparse_fp8/components/dequant.h cvt_fp8x8_bf16x8): the scale
    rounded to bf16 first (__float2bfloat162_rn), then bf16(fp8 * bf16(scale))."""
    lead = tokens.shape[:-1]
    t = tokens.reshape(-1, DS_MLA_BYTES)
    nope = t[:, :512].contiguous().view(FP8).float().reshape(-1, 4, 128)
    s = t[:, 512:528].contiguous().view(torch.float32).reshape(-1, 4, 1).to(torch.bfloat16).float()
    rope = t[:, 528:].contiguous().view(torch.bfloat16)
    out = torch.cat([(nope * s).reshape(-1, 512).to(torch.bfloat16), rope], dim=1)
    return out.reshape(*lead, 576)


def _sparse_attend(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor,
                   sm_scale: float, d_v: int, attn_sink: torch.Tensor | None):
    """q [T, H, D] bf16, kv [T, K, D] bf16 (gathered), valid [T, K] ->
    out fp32 [T, H, d_v], max and lse of the scaled scores in natural log
    (fp32 [T, H]). Rows with no valid index give out 0 and lse -inf.
    With attn_sink, out is multiplied by exp(lse) / (exp(lse) + exp(sink))."""
    scores = torch.einsum("thd,tkd->thk", q.float(), kv.float()) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    mx = scores.amax(dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    p = torch.exp(scores - safe[..., None])
    out = torch.einsum("thk,tkd->thd", p, kv[..., :d_v].float())
    if attn_sink is not None:
        sink = attn_sink.float()[None, :]
        factor = 1.0 / (1.0 + torch.exp(sink - lse))
        out = out * torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(factor),
                                factor)[..., None]
    return out, mx, lse


def _check_heads(h_q: int, d_qk: int, d_v: int, what: str) -> None:
    if h_q not in (64, 128):
        raise RuntimeError(f"{what}: Unsupported h_q: {h_q} (the kernel takes 64 or 128)")
    if d_qk not in (512, 576):
        raise RuntimeError(f"{what}: Invalid d_qk: {d_qk}")
    if d_v != 512:
        raise RuntimeError(f"{what}: Invalid d_v {d_v}")


def sparse_prefill_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    attn_sink: torch.Tensor | None,
    topk_length: torch.Tensor | None,
) -> list[torch.Tensor]:
    """q [s_q, h_q, d_qk] bf16, kv [s_kv, h_kv=1, d_qk] bf16, indices
    [s_q, 1, topk] int32 (entries < 0 or >= s_kv, and with topk_length those at
    or past topk_length[i], are skipped). Returns [out bf16 [s_q, h_q, d_v],
    max_logits f32 [s_q, h_q], lse f32 [s_q, h_q]] of the scaled scores
    (q·k * sm_scale), natural log, as FlashMLA's tests/ref.py
    ref_sparse_attn_fwd defines them (the interface's docstring points there);
    a query with no valid index gets out 0, max_logits -inf, lse +inf. vLLM
    uses only out (flashmla_sparse.py:964 ``[0]``)."""
    s_q, h_q, d_qk = q.shape
    s_kv = kv.shape[0]
    _check_heads(h_q, d_qk, d_v, "sparse_prefill_fwd")
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise RuntimeError("sparse_prefill_fwd: q and kv must be bfloat16")
    if kv.dim() != 3 or kv.shape[1] != 1 or indices.shape[:2] != (s_q, 1):
        raise RuntimeError("sparse_prefill_fwd: expects kv [s_kv, 1, d_qk], indices [s_q, 1, topk]")
    idx = indices[:, 0, :].to(torch.int64)
    topk = idx.shape[-1]
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid = valid & (torch.arange(topk, device=q.device)[None, :]
                         < topk_length.to(torch.int64)[:, None])
    gathered = kv[:, 0, :][torch.where(valid, idx, torch.zeros_like(idx))]
    out, mx, lse = _sparse_attend(q, gathered, valid, sm_scale, d_v, attn_sink)
    lse = torch.where(torch.isinf(lse) & (lse < 0), torch.full_like(lse, float("inf")), lse)
    return [out.to(torch.bfloat16), mx, lse]


def sparse_decode_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    tile_scheduler_metadata: torch.Tensor | None,
    num_splits: torch.Tensor | None,
    extra_kv: torch.Tensor | None,
    extra_indices: torch.Tensor | None,
    extra_topk_length: torch.Tensor | None,
    d_v: int,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [b, s_q, h_q, 576] bf16, kv uint8 [num_blocks, page_block_size, 1,
    656] (fp8_ds_mla), indices [b, s_q, topk] int32 global slots
    (block * page_block_size + offset; -1 skipped; with topk_length[b] only the
    first topk_length[b] count). Keys are dequantized to bf16 as the SM90
    kernel does (scale rounded to bf16 first), then the same softmax attention. Returns (out bf16 [b, s_q, h_q,
    d_v], lse f32 [b, h_q, s_q] natural log (+inf for a query with no valid
    index, whose out is 0), and the two scheduler tensors, passed through or
    allocated with the kernel's shapes; nothing reads their values here)."""
    b, s_q, h_q, d_qk = q.shape
    _check_heads(h_q, d_qk, d_v, "sparse_decode_fwd")
    if d_qk != 576:
        raise RuntimeError("sparse_decode_fwd stand-in: only the V3.2 layout (d_qk 576) is implemented")
    if extra_kv is not None or extra_indices is not None or extra_topk_length is not None:
        raise RuntimeError("sparse_decode_fwd stand-in: extra_kv is not implemented (vLLM v0.16 never passes it)")
    if kv.shape[-1] != DS_MLA_BYTES or kv.shape[2] != 1:
        raise RuntimeError("sparse_decode_fwd: kv must be [num_blocks, page_block_size, 1, 656]")
    if q.dtype != torch.bfloat16:
        raise RuntimeError("sparse_decode_fwd: q must be bfloat16")
    nb, pbs = kv.shape[0], kv.shape[1]
    n_slots = nb * pbs
    idx = indices.to(torch.int64).reshape(b * s_q, -1)
    topk = idx.shape[-1]
    valid = (idx >= 0) & (idx < n_slots)
    if topk_length is not None:
        lim = topk_length.to(torch.int64).repeat_interleave(s_q)[:, None]
        valid = valid & (torch.arange(topk, device=q.device)[None, :] < lim)
    tokens = kv.view(torch.uint8).reshape(n_slots, DS_MLA_BYTES)
    keys = _dequant_ds_mla(tokens[torch.where(valid, idx, torch.zeros_like(idx))])
    out, _, lse = _sparse_attend(q.reshape(b * s_q, h_q, d_qk), keys, valid, sm_scale,
                                 d_v, attn_sink)
    lse = torch.where(torch.isinf(lse) & (lse < 0), torch.full_like(lse, float("inf")), lse)
    out = out.to(torch.bfloat16).reshape(b, s_q, h_q, d_v)
    lse = lse.reshape(b, s_q, h_q).transpose(1, 2).contiguous()
    if tile_scheduler_metadata is None:
        tile_scheduler_metadata = torch.zeros((1, 8), dtype=torch.int32, device=q.device)
    if num_splits is None:
        num_splits = torch.zeros((b + 1,), dtype=torch.int32, device=q.device)
    return out, lse, tile_scheduler_metadata, num_splits


def _sparse_prefill_fake(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    s_q, h_q = q.shape[0], q.shape[1]
    return [q.new_empty((s_q, h_q, d_v)),
            q.new_empty((s_q, h_q), dtype=torch.float32),
            q.new_empty((s_q, h_q), dtype=torch.float32)]


def _sparse_decode_fake(q, kv, indices, topk_length, attn_sink, tile_scheduler_metadata,
                        num_splits, extra_kv, extra_indices, extra_topk_length, d_v, sm_scale):
    b, s_q, h_q = q.shape[:3]
    return (q.new_empty((b, s_q, h_q, d_v)),
            q.new_empty((b, h_q, s_q), dtype=torch.float32),
            q.new_empty((1, 8), dtype=torch.int32),
            q.new_empty((b + 1,), dtype=torch.int32))


# ---------------------------------------------------------------------------
# Registration and installation
# ---------------------------------------------------------------------------

# (namespace, name, schema, impl, fake). Schemas: FlashMLA's is inferred from
# the C++ signature by make_pytorch_shim, so these follow the argument order
# of the calls in flash_mla_interface.py:156 and :209.
_OPS: list[tuple[str, str, str, Callable, Callable]] = [
    ("_flashmla_C", "sparse_prefill_fwd",
     "(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, Tensor? attn_sink, "
     "Tensor? topk_length) -> Tensor[]", sparse_prefill_fwd, _sparse_prefill_fake),
    ("_flashmla_C", "sparse_decode_fwd",
     "(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
     "Tensor? tile_scheduler_metadata, Tensor? num_splits, Tensor? extra_kv, "
     "Tensor? extra_indices, Tensor? extra_topk_length, int d_v, float sm_scale) "
     "-> (Tensor, Tensor, Tensor, Tensor)", sparse_decode_fwd, _sparse_decode_fake),
]

OP_NAMES: tuple[str, ...] = tuple(f"{ns}::{name}" for ns, name, *_ in _OPS)

DEEP_GEMM_FUNCTIONS: dict[str, Callable] = {
    "fp8_mqa_logits": fp8_mqa_logits,
    "fp8_paged_mqa_logits": fp8_paged_mqa_logits,
    "get_paged_mqa_logits_metadata": get_paged_mqa_logits_metadata,
    "get_num_sms": get_num_sms,
}

_LIBS: dict[str, torch.library.Library] = {}
_REGISTERED: set[str] = set()


def _op_exists(ns: str, name: str) -> bool:
    try:
        return hasattr(getattr(torch.ops, ns), name)
    except Exception:
        return False


def register(namespace_map: dict[str, str] | None = None) -> list[str]:
    """Define and implement every op (CPU and CUDA kernels). ``namespace_map``
    renames namespaces (the tests use their own). An op that already exists is
    left alone: a real compiled build wins. Returns the qualified names this
    call registered."""
    namespace_map = namespace_map or {}
    done = []
    for ns, name, schema, impl, fake in _OPS:
        target = namespace_map.get(ns, ns)
        qualname = f"{target}::{name}"
        if qualname in _REGISTERED or _op_exists(target, name):
            continue
        lib = _LIBS.get(target)
        if lib is None:
            lib = torch.library.Library(target, "FRAGMENT")
            _LIBS[target] = lib
        lib.define(name + schema)
        for key in ("CPU", "CUDA"):
            lib.impl(name, impl, key)
        torch.library.register_fake(qualname, fake, lib=lib)
        _REGISTERED.add(qualname)
        done.append(qualname)
    return done


def _stub_module(name: str, doc: str, attrs: dict | None = None) -> types.ModuleType:
    mod = types.ModuleType(name, doc)
    # find_spec() on a name in sys.modules returns its __spec__ (and raises
    # if that is None): vllm.utils.import_utils.has_deep_gemm relies on it.
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    for k, v in (attrs or {}).items():
        setattr(mod, k, v)
    return mod


def _missing(name: str) -> bool:
    if name in sys.modules:
        return False
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def install(deep_gemm: bool = True, flashmla: bool = True) -> list[str]:
    """Register the ops under their real names and make vLLM find them:

    * ``deep_gemm`` (when no real one is importable): a module whose
      ``fp8_mqa_logits``, ``fp8_paged_mqa_logits``,
      ``get_paged_mqa_logits_metadata`` and ``get_num_sms`` are the stand-ins
      above. It has no ``fp8_gemm_nt``, so ``is_deep_gemm_e8m0_used()`` stays
      False; an fp8 block-quantized linear vLLM sends to DeepGEMM fails by
      name ("DeepGEMM backend is not available"). The DSA targets are bf16
      and have none.
    * ``vllm._flashmla_C`` and ``vllm._flashmla_extension_C`` (when missing):
      empty modules, so ``vllm/v1/attention/ops/flashmla.py`` imports the
      wheel's ``flash_mla_interface`` and its calls reach
      ``torch.ops._flashmla_C.*`` registered here. This also makes the dense
      FlashMLA backend look available, and its kernels (``dense_decode_fwd``,
      ``_flashmla_extension_C``) are NOT stood in: with no FA3 in the build,
      vLLM v0.16.0 on SM90 can pick FLASHMLA for a dense MLA model, which
      then fails there, so a dense MLA model served under the switch must
      force TRITON_MLA (docs/gpu-dsa.md).

    Must run in every process vLLM starts, after the built ``vllm._C`` has
    registered its ops and before vLLM imports the attention backends:
    harness_sitecustomize.py runs it at interpreter start-up."""
    names = register()
    if deep_gemm and _missing("deep_gemm"):
        sys.modules["deep_gemm"] = _stub_module(
            "deep_gemm", "GPU-harness stand-in for DeepGEMM (DSA indexer logits only)",
            dict(DEEP_GEMM_FUNCTIONS))
    if flashmla:
        for name in ("vllm._flashmla_C", "vllm._flashmla_extension_C"):
            if _missing(name):
                sys.modules[name] = _stub_module(
                    name, "GPU-harness stand-in; ops registered by vllm._gpu_harness_dsa_ops")
    return names
