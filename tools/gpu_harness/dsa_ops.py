# SPDX-License-Identifier: Apache-2.0
"""Torch stand-ins for FlashMLA's sparse kernels, the one DSA kernel family
the harness cannot build.

GLM-5 and DeepSeek-V3.2 run DeepSeek Sparse Attention (DSA) through
FLASHMLA_SPARSE. vLLM v0.16.0 pins FlashMLA at c2afa9cb, which is not among
the stored snapshots (vllm-project/FlashMLA stops at 2025-10-22): its sparse
prefill and decode kernels (``_flashmla_C``) have no obtainable source, so
this module stands in for those two ops and for nothing else. Every other op
on the DSA path is built from its pinned source by
tools/gpu_harness/kernels.py: vLLM's ``_C`` / ``_C_cache_ops`` ops (the
indexer's fp8 quantization, its K cache, top-k per row, the MLA cache write
and gather) and DeepGEMM's indexer logits (``deep_gemm`` at 477618cd, the pin
of v0.16.0's tools/install_deepgemm.sh). docs/gpu-dsa.md lists the kernels
with their v0.16.0 call sites.

What each stand-in computes is written next to it, read from the kernel's
interface and its reference (FlashMLA ``csrc/api/sparse_fwd.h``,
``sparse_decode.h`` and ``tests/ref.py`` at c2afa9cb).
``tests/e2e/gpu/test_harness_dsa_ops.py`` checks each op against a literal
reference.

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


def _stub_module(name: str, doc: str) -> types.ModuleType:
    mod = types.ModuleType(name, doc)
    # find_spec() on a name in sys.modules returns its __spec__, and raises
    # if that is None.
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    return mod


def _missing(name: str) -> bool:
    if name in sys.modules:
        return False
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def install() -> list[str]:
    """Register the ops under their real names and make vLLM find them:
    ``vllm._flashmla_C`` and ``vllm._flashmla_extension_C`` (when missing)
    become empty modules, so ``vllm/v1/attention/ops/flashmla.py`` imports the
    wheel's ``flash_mla_interface`` and its calls reach
    ``torch.ops._flashmla_C.*`` registered here. This also makes the dense
    FlashMLA backend look available, and its kernels (``dense_decode_fwd``,
    ``_flashmla_extension_C``) are NOT stood in: on SM90 vLLM ranks the built
    FLASH_ATTN_MLA first, and a dense MLA model that falls past it to
    FLASHMLA must force TRITON_MLA (docs/gpu-dsa.md).

    Nothing here stands in for DeepGEMM: without a built ``deep_gemm``,
    vLLM's ``has_deep_gemm()`` is False and the DSA tests say so.

    Must run in every process vLLM starts, after the built ``vllm._C`` has
    registered its ops and before vLLM imports the attention backends:
    harness_sitecustomize.py runs it at interpreter start-up."""
    names = register()
    for name in ("vllm._flashmla_C", "vllm._flashmla_extension_C"):
        if _missing(name):
            sys.modules[name] = _stub_module(
                name, "GPU-harness stand-in; ops registered by vllm._gpu_harness_dsa_ops")
    return names
