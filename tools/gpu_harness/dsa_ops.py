# SPDX-License-Identifier: Apache-2.0
"""Torch stand-ins for the compiled kernels of DeepSeek Sparse Attention (DSA).

GLM-5 and DeepSeek-V3.2 need MLA on, an fp8 indexer (vLLM ``_C`` ops and
DeepGEMM) and FLASHMLA_SPARSE (FlashMLA ``_flashmla_C``), none of which load on
the lent H200. docs/gpu-dsa.md lists each kernel with its v0.16.0 call site and
the fp8-only paths. What each stand-in computes is written next to it, read
from the kernel source (vLLM ``csrc/``, FlashMLA ``csrc/api/sparse_fwd.h`` and
``sparse_decode.h`` at c2afa9cb, DeepGEMM ``sm90_fp8_mqa_logits.cuh``); where a
kernel leaves a choice open (top-k order, ties at the k-th value, logits
outside a row when ``clean_logits`` is False) the stand-in picks one result the
kernel can produce and says which. ``tests/e2e/gpu/test_harness_dsa_ops.py``
checks each op against a literal reference.

Kept free of vLLM imports (it is imported while ``vllm`` itself is importing).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import math
import sys
import types
from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # csrc/cache_kernels.cu:30 kFp8ScaleDivisor (CUDA e4m3fn)
FLT_MIN = 1.1754943508222875e-38


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e4m3fn as ``__nv_cvt_float_to_fp8(x, __NV_SATFINITE, E4M3)``:
    round to nearest even, saturating at +-448 (torch's cast would give NaN
    above 464, so clamp first; NaN stays NaN as in the hardware cast)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _ue8m0(scale: torch.Tensor) -> torch.Tensor:
    # exp2f(ceilf(log2f(s))): the smallest power of two >= s.
    return torch.exp2(torch.ceil(torch.log2(scale)))


def _div(x: torch.Tensor, d: float) -> torch.Tensor:
    """x / d rounded as the kernels' float division: torch on CUDA multiplies
    by the reciprocal of a Python-number divisor, one ulp off (found on the
    H200), so the divisor is a tensor."""
    return x / torch.full_like(x, d)


def _put_rows(target: torch.Tensor, index: tuple[torch.Tensor, ...], valid: torch.Tensor,
              rows: torch.Tensor) -> None:
    """In place: target[index[0][i], index[1][i], ...] = rows[i] where valid[i].

    The kernels skip padded tokens (slot -1) with a branch. Here every token
    writes (fixed shapes, no host sync, cost O(tokens) rather than a copy of
    the whole cache): an invalid one repeats the write of the first valid
    token, same place and same value, so the duplicate is harmless; with no
    valid token at all, element 0 is rewritten with its own value."""
    if rows.shape[0] == 0:
        return
    any_valid = valid.any()
    # index_select, not [first]: a 0-dim tensor index is read on the host,
    # which CUDA-graph capture refuses (found on the H200).
    first = torch.argmax(valid.to(torch.int32)).reshape(1)
    idx = []
    for ix in index:
        ix = ix.to(torch.int64)
        fb = torch.where(any_valid, ix.index_select(0, first)[0], 0)
        idx.append(torch.where(valid, ix, fb))
    own = target[(0,) * len(index)]
    fb_row = torch.where(any_valid, rows.index_select(0, first)[0], own)
    shape = (-1,) + (1,) * (rows.dim() - 1)
    target.index_put_(tuple(idx), torch.where(valid.view(shape), rows, fb_row))


# ---------------------------------------------------------------------------
# 1. _C::per_token_group_fp8_quant (csrc/quantization/w8a8/fp8/per_token_group_quant.cu)
# ---------------------------------------------------------------------------


def per_token_group_fp8_quant(
    input: torch.Tensor,
    output_q: torch.Tensor,
    output_s: torch.Tensor,
    group_size: int,
    eps: float,
    fp8_min: float,
    fp8_max: float,
    scale_ue8m0: bool,
) -> None:
    """Per group of ``group_size`` consecutive values along the last dim:
    absmax = max(eps, max|x|) (the kernel starts its reduction at eps);
    s = absmax / fp8_max; with ue8m0, s = exp2(ceil(log2(max(|s|, 1e-10))));
    q = fp8(clamp(x / s, fp8_min, fp8_max)). ``output_s`` gets one float per
    group, written through its own strides (row- or column-major)."""
    k = input.shape[-1]
    if k % group_size != 0:
        raise RuntimeError(
            f"per_token_group_fp8_quant: last dim {k} is not a multiple of "
            f"group_size {group_size}"
        )
    x = input.float().reshape(-1, k // group_size, group_size)
    absmax = x.abs().amax(dim=-1).clamp_min(eps)
    s = _div(absmax, fp8_max)
    if scale_ue8m0:
        s = _ue8m0(s.abs().clamp_min(1e-10))
    q = (x / s[..., None]).clamp(fp8_min, fp8_max)
    output_q.copy_(q.to(FP8).reshape(output_q.shape).view(output_q.dtype))
    output_s.copy_(s.reshape(output_s.shape))


# ---------------------------------------------------------------------------
# 2./3. Indexer K cache (csrc/cache_kernels.cu:437, :501, :1270, :1314)
# ---------------------------------------------------------------------------
# Cache tensor: uint8 [num_blocks, block_size, head_dim + head_dim/128*4].
# Inside one block the kernel does NOT store rows of head_dim+4 bytes: the
# block's first block_size*head_dim bytes hold every token's fp8 K
# (token t at t*head_dim), the next block_size*(head_dim/128)*4 bytes hold the
# fp32 scales (token t, group g at block_size*head_dim + (t*head_dim/128+g)*4).
# DeepGEMM's paged logits read the same layout.


def _indexer_block_views(kv_cache: torch.Tensor, head_dim: int, quant_block_size: int):
    nb, bs, stride = kv_cache.shape
    groups = head_dim // quant_block_size
    # view (never reshape): a copy would silently drop the writes. The kernel
    # addresses the block by pointer arithmetic, so it needs this layout too.
    flat = kv_cache.view(torch.uint8).view(nb, bs * stride)
    k_part = flat[:, : bs * head_dim].reshape(nb, bs, head_dim)
    s_part = flat[:, bs * head_dim: bs * head_dim + bs * groups * 4].reshape(nb, bs, groups * 4)
    return k_part, s_part


def indexer_k_quant_and_cache(
    k: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant_block_size: int,
    kv_cache_dtype: str,
) -> None:
    """Per token and per 128 values (one warp of 32 threads x 4 values):
    s = max(amax, 1e-4) / 448, rounded up to a power of two when the format
    string (vLLM passes the indexer's scale_fmt here) is "ue8m0"; the values
    are stored as fp8(x / s) (saturating). Tokens with slot -1 are skipped.
    The kernel's warp always spans 128 values while the scale index divides
    by quant_block_size, so only quant_block_size 128 is self-consistent."""
    if quant_block_size != 128:
        raise RuntimeError(
            "indexer_k_quant_and_cache: the CUDA kernel reduces over 128 values "
            f"per scale; quant_block_size {quant_block_size} is not supported"
        )
    num_tokens, head_dim = k.shape
    if head_dim % quant_block_size != 0:
        raise RuntimeError("head_dim must be divisible by quant_block_size")
    use_ue8m0 = kv_cache_dtype == "ue8m0"
    groups = head_dim // quant_block_size
    x = k.float().reshape(num_tokens, groups, quant_block_size)
    s = _div(x.abs().amax(dim=-1).clamp_min(1e-4), FP8_MAX)
    if use_ue8m0:
        s = _ue8m0(s)
    q = _to_fp8(x / s[..., None]).reshape(num_tokens, head_dim).view(torch.uint8)
    s_bytes = s.contiguous().view(torch.uint8).reshape(num_tokens, groups * 4)

    k_part, s_part = _indexer_block_views(kv_cache, head_dim, quant_block_size)
    bs = kv_cache.shape[1]
    slots = slot_mapping.reshape(-1).to(torch.int64)
    valid = slots >= 0
    _put_rows(k_part, (slots // bs, slots % bs), valid, q)
    _put_rows(s_part, (slots // bs, slots % bs), valid, s_bytes)


def cp_gather_indexer_k_quant_cache(
    kv_cache: torch.Tensor,
    dst_k: torch.Tensor,
    dst_scale: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
) -> None:
    """Copies, for each request b and each of its tokens i (dst row
    cu_seq_lens[b] + i), the fp8 K bytes and scale bytes of logical position i
    (block block_table[b, i // block_size]) into dst_k / dst_scale."""
    num_tokens, head_dim = dst_k.shape
    quant_block_size = head_dim * 4 // dst_scale.shape[1]
    k_part, s_part = _indexer_block_views(kv_cache, head_dim, quant_block_size)
    bs = kv_cache.shape[1]
    cu = cu_seq_lens.to(torch.int64)
    tok = torch.arange(num_tokens, device=dst_k.device, dtype=torch.int64)
    batch = torch.searchsorted(cu[1:], tok, right=True).clamp_max(block_table.shape[0] - 1)
    pos = tok - cu[batch]
    col = (pos // bs).clamp(0, block_table.shape[1] - 1)
    blk = block_table.to(torch.int64)[batch, col].clamp(0, kv_cache.shape[0] - 1)
    off = pos % bs
    dst_k.view(torch.uint8).copy_(k_part[blk, off])
    dst_scale.view(torch.uint8).copy_(s_part[blk, off])


# ---------------------------------------------------------------------------
# 4./6./7. DeepGEMM (a stand-in for the ``deep_gemm`` module)
# ---------------------------------------------------------------------------
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
    [num_blocks, block_size, 1, D + 4] (block layout as the indexer writes it,
    see above), weights [B*next_n, H], context_lens [B], block_tables [B, nb]
    -> logits [B*next_n, max_model_len] f32. Row b*next_n + j is the query at
    position context_lens[b] - next_n + j; columns are logical key positions,
    defined for 0 <= n <= that position (-inf elsewhere, see fp8_mqa_logits).
    Same formula as fp8_mqa_logits. Fixed shapes: every block a row could
    reach is gathered and masked."""
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
# 5./8. Top-k per row (csrc/sampler.cu:328 topKPerRowJob, :541, :565)
# ---------------------------------------------------------------------------
# Output indices are relative to the row start. A row of length <= topK gets
# 0..len-1 in order, then -1. A longer row gets the positions of its topK
# largest logits; the kernel's order among them comes from atomics in its
# histogram passes and is unspecified, and so is which of several equal values
# at the k-th place wins. Here: descending value, ties to the lower position.


def _top_k_rows(vals: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                top_k: int) -> torch.Tensor:
    rows, n = vals.shape
    cols = torch.arange(n, device=vals.device)
    inside = (cols[None, :] >= starts[:, None]) & (cols[None, :] < ends[:, None])
    masked = torch.where(inside, vals.float(), torch.full_like(vals, float("-inf"), dtype=torch.float32))
    kk = min(top_k, n)
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :kk]
    if kk < top_k:
        order = torch.cat([order, order.new_zeros((rows, top_k - kk))], dim=1)
    rel = order - starts[:, None]
    row_len = (ends - starts)[:, None]
    j = torch.arange(top_k, device=vals.device)[None, :]
    short = torch.where(j < row_len, j, torch.full_like(j, -1))
    picked = torch.where(j < row_len, rel, torch.full_like(rel, -1))
    return torch.where(row_len <= top_k, short, picked)


def _row_view(logits: torch.Tensor, num_rows: int, stride0: int, stride1: int) -> torch.Tensor:
    return logits.as_strided((num_rows, logits.shape[-1]), (stride0, stride1),
                             logits.storage_offset())


def top_k_per_row_prefill(
    logits: torch.Tensor,
    rowStarts: torch.Tensor,
    rowEnds: torch.Tensor,
    indices: torch.Tensor,
    numRows: int,
    stride0: int,
    stride1: int,
    topK: int,
) -> None:
    vals = _row_view(logits, numRows, stride0, stride1)
    res = _top_k_rows(vals, rowStarts[:numRows].to(torch.int64),
                      rowEnds[:numRows].to(torch.int64), topK)
    indices[:numRows, :topK].copy_(res.to(indices.dtype))


def top_k_per_row_decode(
    logits: torch.Tensor,
    next_n: int,
    seq_lens: torch.Tensor,
    indices: torch.Tensor,
    numRows: int,
    stride0: int,
    stride1: int,
    topK: int,
) -> None:
    """Row r covers [0, seq_lens[r // next_n] - next_n + r % next_n + 1)."""
    vals = _row_view(logits, numRows, stride0, stride1)
    r = torch.arange(numRows, device=logits.device, dtype=torch.int64)
    ends = seq_lens.to(torch.int64)[r // next_n] - next_n + r % next_n + 1
    res = _top_k_rows(vals, torch.zeros_like(ends), ends, topK)
    indices[:numRows, :topK].copy_(res.to(indices.dtype))


# ---------------------------------------------------------------------------
# 9./12. MLA KV cache (csrc/cache_kernels.cu:290, :334, :698, :996)
# ---------------------------------------------------------------------------
DS_MLA_BYTES = 656  # 512 fp8 + 4 * fp32 + 64 * bf16


def _scatter_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache [num_blocks, block_size, W] (any strides); rows [T, W]; slot -1
    writes nothing."""
    bs = cache.shape[1]
    _put_rows(cache, (slots // bs, slots % bs), slots >= 0, rows)


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor,
) -> None:
    """Writes [kv_c | k_pe] of each token to its slot (slot -1: skipped).
    "auto": copied as they are. "fp8"/"fp8_e4m3": each value fp8(x / scale)
    with the per-tensor scale. "fp8_ds_mla" (kv_lora_rank 512, rope 64, 656
    bytes): per 128 NoPE values s = max(max|x| / 448, FLT_MIN), stored
    fp8(x / s), the 4 scales as fp32 at byte 512, the RoPE part as its 16-bit
    values at byte 528."""
    t, rank = kv_c.shape
    pe_dim = k_pe.shape[-1]
    slots = slot_mapping.reshape(-1).to(torch.int64)
    if kv_cache.dim() != 3:
        raise RuntimeError("concat_and_cache_mla: kv_cache must be [num_blocks, block_size, width]")
    if kv_cache_dtype == "fp8_ds_mla":
        if rank != 512 or pe_dim != 64:
            raise RuntimeError("fp8_ds_mla needs kv_lora_rank 512 and pe_dim 64")
        if kv_cache.shape[-1] != DS_MLA_BYTES or kv_cache.element_size() != 1:
            raise RuntimeError("kv_cache.size(2) must be 656 bytes for fp8_ds_mla")
        if kv_c.element_size() != 2 or k_pe.element_size() != 2:
            raise RuntimeError("kv_c and k_pe must be 16-bit for fp8_ds_mla")
        x = kv_c.float().reshape(t, 4, 128)
        s = _div(x.abs().amax(dim=-1), FP8_MAX).clamp_min(FLT_MIN)
        nope = _to_fp8(x / s[..., None]).reshape(t, 512).view(torch.uint8)
        rows = torch.cat([nope, s.contiguous().view(torch.uint8).reshape(t, 16),
                          k_pe.reshape(t, 64).contiguous().view(torch.uint8)], dim=1)
        _scatter_rows(kv_cache.view(torch.uint8), slots, rows)
    elif kv_cache_dtype == "auto":
        rows = torch.cat([kv_c, k_pe.reshape(t, pe_dim)], dim=1).to(kv_cache.dtype)
        _scatter_rows(kv_cache, slots, rows)
    elif kv_cache_dtype in ("fp8", "fp8_e4m3"):
        rows = torch.cat([kv_c, k_pe.reshape(t, pe_dim)], dim=1).float()
        rows = _to_fp8(rows / scale.float().reshape(())).view(torch.uint8)
        _scatter_rows(kv_cache.view(torch.uint8), slots, rows)
    else:
        raise RuntimeError(
            f"concat_and_cache_mla stand-in: kv_cache_dtype {kv_cache_dtype!r} is "
            "not implemented (auto, fp8, fp8_e4m3, fp8_ds_mla are)"
        )


def _dequant_ds_mla(tokens: torch.Tensor, bf16_scale: bool = False) -> torch.Tensor:
    """uint8 [..., 656] -> bf16 [..., 576], RoPE copied. NoPE:
    bf16(float(fp8) * scale) in vLLM's upconvert kernel
    (scaled_vec_conversion<__nv_bfloat16, uint8_t>); FlashMLA's SM90 sparse
    decode (sm90/decode/sparse_fp8/components/dequant.h cvt_fp8x8_bf16x8)
    first rounds the scale to bf16 (__float2bfloat162_rn) and multiplies in
    bf16: bf16(fp8 * bf16(scale)) - ``bf16_scale=True``."""
    lead = tokens.shape[:-1]
    t = tokens.reshape(-1, DS_MLA_BYTES)
    nope = t[:, :512].contiguous().view(FP8).float().reshape(-1, 4, 128)
    s = t[:, 512:528].contiguous().view(torch.float32).reshape(-1, 4, 1)
    if bf16_scale:
        s = s.to(torch.bfloat16).float()
    rope = t[:, 528:].contiguous().view(torch.bfloat16)
    out = torch.cat([(nope * s).reshape(-1, 512).to(torch.bfloat16), rope], dim=1)
    return out.reshape(*lead, 576)


def cp_gather_and_upconvert_fp8_kv_cache(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    workspace_starts: torch.Tensor,
    batch_size: int,
) -> None:
    """For request b < batch_size and position i < seq_lens[b]:
    dst[workspace_starts[b] + i] = dequant(token i of b). Rows of dst that no
    request covers are left as they are."""
    if dst.shape[1] != 576 or dst.dtype != torch.bfloat16:
        raise RuntimeError("dst must be bfloat16 with head_dim 576")
    nb, bs = src_cache.shape[0], src_cache.shape[1]
    n_dst = dst.shape[0]
    maxlen = block_table.shape[1] * bs
    i = torch.arange(maxlen, device=dst.device, dtype=torch.int64)
    bt = block_table[:batch_size].to(torch.int64)
    blk = bt.gather(1, (i // bs)[None, :].expand(batch_size, -1)).clamp(0, nb - 1)
    toks = src_cache.view(torch.uint8)[blk, (i % bs)[None, :].expand(batch_size, -1)]
    vals = _dequant_ds_mla(toks)  # [batch, maxlen, 576]
    valid = i[None, :] < seq_lens[:batch_size].to(torch.int64)[:, None]
    rows = workspace_starts[:batch_size].to(torch.int64)[:, None] + i[None, :]
    valid = valid & (rows < n_dst)
    _put_rows(dst, (rows.reshape(-1),), valid.reshape(-1), vals.reshape(-1, 576))


# ---------------------------------------------------------------------------
# 10./11. FlashMLA sparse (FlashMLA csrc/api/sparse_fwd.h, sparse_decode.h;
# semantics: FlashMLA tests/ref.py ref_sparse_attn_fwd / ref_sparse_attn_decode.
# The kernels take bf16 q and keys, accumulate in fp32 and round out to bf16;
# they also round the softmax weights to bf16 for the P·V product, which the
# stand-in keeps in fp32, so the two agree to bf16 rounding, not bit for bit.)
# ---------------------------------------------------------------------------
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
    keys = _dequant_ds_mla(tokens[torch.where(valid, idx, torch.zeros_like(idx))],
                           bf16_scale=True)
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

# (namespace, name, schema, impl, fake or None for "returns nothing").
# Schemas: csrc/torch_bindings.cpp:182,188,641,714,761,768,775 for vLLM; for
# FlashMLA (schema inferred from the C++ signature by make_pytorch_shim) the
# argument order of the calls in flash_mla_interface.py:156 and :209.
_OPS: list[tuple[str, str, str, Callable, Callable | None]] = [
    ("_C", "per_token_group_fp8_quant",
     "(Tensor input, Tensor! output_q, Tensor! output_s, int group_size, float eps, "
     "float fp8_min, float fp8_max, bool scale_ue8m0) -> ()", per_token_group_fp8_quant, None),
    ("_C", "top_k_per_row_prefill",
     "(Tensor logits, Tensor rowStarts, Tensor rowEnds, Tensor! indices, int numRows, "
     "int stride0, int stride1, int topK) -> ()", top_k_per_row_prefill, None),
    ("_C", "top_k_per_row_decode",
     "(Tensor logits, int next_n, Tensor seq_lens, Tensor! indices, int numRows, "
     "int stride0, int stride1, int topK) -> ()", top_k_per_row_decode, None),
    ("_C_cache_ops", "concat_and_cache_mla",
     "(Tensor kv_c, Tensor k_pe, Tensor! kv_cache, Tensor slot_mapping, "
     "str kv_cache_dtype, Tensor scale) -> ()", concat_and_cache_mla, None),
    ("_C_cache_ops", "cp_gather_and_upconvert_fp8_kv_cache",
     "(Tensor src_cache, Tensor! dst, Tensor block_table, Tensor seq_lens, "
     "Tensor workspace_starts, int batch_size) -> ()", cp_gather_and_upconvert_fp8_kv_cache, None),
    ("_C_cache_ops", "indexer_k_quant_and_cache",
     "(Tensor k, Tensor! kv_cache, Tensor slot_mapping, int quant_block_size, "
     "str kv_cache_dtype) -> ()", indexer_k_quant_and_cache, None),
    ("_C_cache_ops", "cp_gather_indexer_k_quant_cache",
     "(Tensor kv_cache, Tensor! dst_k, Tensor! dst_scale, Tensor block_table, "
     "Tensor cu_seq_lens) -> ()", cp_gather_indexer_k_quant_cache, None),
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

# torch_ops.py defines this name as "referenced only" (its implementation
# raises). The DSA indexer calls it, so this module's implementation replaces
# that one when torch_ops registered first.
_OVERRIDES_HARNESS = {"_C::per_token_group_fp8_quant"}

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


def _harness_referenced_only() -> set[str]:
    mod = sys.modules.get("vllm._gpu_harness_ops") or sys.modules.get("gpu_harness_torch_ops")
    return set(getattr(mod, "REFERENCED_ONLY", ())) if mod is not None else set()


def _noop_fake(*args, **kwargs) -> None:
    return None


def register(namespace_map: dict[str, str] | None = None) -> list[str]:
    """Define and implement every op (CPU and CUDA kernels). ``namespace_map``
    renames namespaces (the tests use their own). An op that already exists is
    left alone (a real compiled build wins), except a torch_ops "referenced
    only" placeholder, whose implementation is replaced. Returns the qualified
    names this call registered or replaced."""
    namespace_map = namespace_map or {}
    replaceable = _harness_referenced_only() & _OVERRIDES_HARNESS
    done = []
    for ns, name, schema, impl, fake in _OPS:
        target = namespace_map.get(ns, ns)
        qualname = f"{target}::{name}"
        if qualname in _REGISTERED:
            continue
        override = False
        if _op_exists(target, name):
            if f"{ns}::{name}" in replaceable:
                override = True
            else:
                continue
        lib = _LIBS.get(target)
        if lib is None:
            lib = torch.library.Library(target, "FRAGMENT")
            _LIBS[target] = lib
        if not override:
            lib.define(name + schema)
        for key in ("CPU", "CUDA"):
            lib.impl(name, impl, key, allow_override=override)
        if not override:
            torch.library.register_fake(qualname, fake or _noop_fake, lib=lib)
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
      False and no fp8 GEMM is routed to it.
    * ``vllm._flashmla_C`` and ``vllm._flashmla_extension_C`` (when missing):
      empty modules, so ``vllm/v1/attention/ops/flashmla.py`` imports the
      wheel's ``flash_mla_interface`` and its calls reach
      ``torch.ops._flashmla_C.*`` registered here. This also makes the dense
      FlashMLA backend look available, and its kernels (``dense_decode_fwd``,
      ``_flashmla_extension_C``) are NOT stood in: dense MLA models must pick
      TRITON_MLA explicitly.

    Must run in every process vLLM starts, after the harness's own ops
    (torch_ops.register()) and before vLLM imports the attention backends:
    the ``vllm/_C.py`` stand-in is that place."""
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


assert math.isclose(FP8_MAX, torch.finfo(FP8).max)
