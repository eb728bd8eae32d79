# SPDX-License-Identifier: Apache-2.0
"""Shared pieces of the GPU e2e tests and the harness benchmark.

The engine settings are the same on the lent device (harness) and on a GPU box
with the real wheel, so the tests run unchanged on both. Three profiles
(``EAGLE3_GPU_PROFILE``, table in docs/gpu.md): ``smoke`` (default; float32
with IEEE Triton dots, eager, native CustomOps, MLA off) makes "EAGLE-3 output
== plain output" a property of the model, since in bf16 or TF32 the different
token counts per step of spec and plain decoding can flip a near-tied pick
(fp64_reference.py measures the margins); ``production`` is what deployments
run (bf16, MLA with the published latent geometry, torch.compile and CUDA
graphs, vLLM's own backends); ``eager`` is production without compilation.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]

NUM_SPEC_TOKENS = 3
GPU_MEMORY_UTILIZATION = float(os.environ.get("EAGLE3_GPU_MEM_UTIL", "0.12"))

PROFILES = ("smoke", "production", "eager")
SMOKE_ONLY = (
    "smoke test: asserts token-for-token greedy equality, which needs the float32 "
    "smoke profile; production settings are proven by test_eagle3_acceptance.py"
)


def profile() -> str:
    p = os.environ.get("EAGLE3_GPU_PROFILE", "smoke")
    if p not in PROFILES:
        raise ValueError(f"EAGLE3_GPU_PROFILE={p!r}: choose one of {', '.join(PROFILES)}")
    return p


def mla_on() -> bool:
    return profile() != "smoke" or os.environ.get("EAGLE3_GPU_MLA") == "1"


# DeepSeek-V3's and Kimi-K2.5's published attention geometry (config.json of
# deepseek-ai/DeepSeek-V3 and moonshotai/Kimi-K2.5): the MLA kernels only take
# a 576-wide latent cache (512 + 64) in a 16-bit dtype.
MLA_GEOMETRY = {
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}


def checkpoint_kwargs() -> dict[str, Any]:
    """write_checkpoint() arguments of the active profile's targets and MLA drafters."""
    if profile() == "smoke":
        return {}
    return {"dtype": "bfloat16", **MLA_GEOMETRY}


# tiny_checkpoints and the harness tools are scripts, not an installed
# package: their folders go last on sys.path (the installed vllm stays first)
# and they are imported by name; the repository root too, for the harness's
# shared modules (tools.gpu_harness.engine, ...).
for _d in (REPO_ROOT / "tools", REPO_ROOT / "tools" / "gpu_harness", REPO_ROOT):
    if str(_d) not in sys.path:
        sys.path.append(str(_d))


# Inputs of the DSA kernels' op tests (test_harness_dsa_ops.py).
def gen(seed: int, device: str):
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def randn(shape, dtype, device, seed, scale=1.0):
    import torch

    return (torch.randn(shape, generator=gen(seed, device), device=device) * scale).to(dtype)


def tensor(values, device, dtype=None):
    import torch

    return torch.tensor(values, dtype=dtype or torch.int32, device=device)


def _tiny():
    import tiny_checkpoints

    return tiny_checkpoints


def drafter_shape() -> dict[str, int]:
    """The tiny Llama drafter's attention under the active profile.

    smoke: MLA is off, and the drafter's attention must give the same KV-cache
    page as the target's own (4 KV heads x 64), so both share one KV-cache
    group. production, eager: heads 128 wide, as SpecForge's and TorchSpec's
    published DeepSeek / Kimi drafters have (7168 / 56), which is the Llama
    head dim the kernel build compiles for FA3 (tools/gpu_harness/kernels.py).
    """
    return {"num_key_value_heads": 4, "head_dim": 64 if profile() == "smoke" else 128}


@dataclass
class Checkpoints:
    root: Path
    deepseek_v3: Path
    kimi_k25: Path
    drafter: Path  # EAGLE-3 drafter (draft vocab 256 via d2t), aux ids (1, 3, 6)
    drafter_full_vocab: Path  # same shape, draft vocab = target vocab
    info: dict[str, Any] = field(default_factory=dict)


def make_checkpoints(root: Path) -> Checkpoints:
    tiny = _tiny()
    root = Path(root)
    ck = Checkpoints(
        root=root,
        deepseek_v3=root / "deepseek_v3",
        kimi_k25=root / "kimi_k25",
        drafter=root / "eagle3_drafter",
        drafter_full_vocab=root / "eagle3_drafter_full_vocab",
    )
    kw = checkpoint_kwargs()
    dkw = {"dtype": kw["dtype"]} if kw else {}
    tiny.write_checkpoint("deepseek-v3", ck.deepseek_v3, seed=0, **kw)
    tiny.write_checkpoint("kimi-k25", ck.kimi_k25, seed=1, **kw)
    tiny.write_checkpoint("eagle3-drafter", ck.drafter, seed=2, **drafter_shape(), **dkw)
    tiny.write_checkpoint(
        "eagle3-drafter", ck.drafter_full_vocab, seed=2,
        draft_vocab_size=tiny.VOCAB_SIZE, **drafter_shape(), **dkw,
    )
    for name in ("deepseek_v3", "kimi_k25", "drafter"):
        cfg = json.loads((getattr(ck, name) / "config.json").read_text())
        ck.info[name] = cfg
    return ck


def configure_env() -> None:
    """Process-wide settings; engine-core processes inherit them."""
    if not mla_on():
        os.environ["VLLM_MLA_DISABLE"] = "1"
    else:
        os.environ.pop("VLLM_MLA_DISABLE", None)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    # float32 Triton dots (MoE, attention) in IEEE fp32 instead of TF32, so
    # the plain and the speculative run (different token counts per step)
    # differ only by float32 summation order.
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    # Engine-core processes start fresh (no fork after CUDA use in the parent).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # engine_facts() sends a function to the workers (collective_rpc).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # Never let NCCL/torch use NVLink multicast (shared hosts).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def engine_kwargs(
    model: Path | str,
    drafter: Path | str | None = None,
    num_spec_tokens: int = NUM_SPEC_TOKENS,
    **extra: Any,
) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        model=str(model),
        dtype="float32",
        seed=0,
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=16,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        compilation_config={"custom_ops": ["none"]},
        disable_log_stats=False,
    )
    if profile() != "smoke":
        # bf16, MLA on, and (production) vLLM's default compilation: no
        # enforce_eager and no compilation_config override at all.
        kw["dtype"] = "bfloat16"
        del kw["compilation_config"]
        kw["enforce_eager"] = profile() == "eager"
    elif not mla_on():
        kw["attention_backend"] = "TRITON_ATTN"
    if os.environ.get("EAGLE3_GPU_KV_BYTES"):
        # A fixed KV-cache size skips vLLM's memory profile, which counts the
        # memory of other engines started at the same time on the same GPU.
        kw["kv_cache_memory_bytes"] = int(os.environ["EAGLE3_GPU_KV_BYTES"])
    if drafter is not None:
        kw["speculative_config"] = spec_config(drafter, num_spec_tokens)
    kw.update(extra)
    return kw


def flash_attn_built() -> bool:
    """Whether this vLLM install has vllm_flash_attn's compiled library (the
    official wheel does; the harness's registry-only build does not). Read
    from the files, without importing vLLM."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return any(any((Path(r) / "vllm_flash_attn").glob("_vllm_fa*_C*.so")) for r in roots)


def drafter_attention_backend(drafter: Path | str) -> str | None:
    """The speculative config's ``attention_backend`` for this drafter:
    ``EAGLE3_GPU_DRAFTER_BACKEND`` where set ("auto": vLLM's choice); else
    TRITON_ATTN for a Llama-architecture drafter where vllm_flash_attn is not
    built, since v0.16.0 picks FLASH_ATTN for it from the capability alone
    and its first forward then fails ("FlashAttention version not
    detected"); else None (vLLM's choice). An MLA drafter picks an MLA
    backend itself."""
    forced = os.environ.get("EAGLE3_GPU_DRAFTER_BACKEND")
    if forced:
        return None if forced.lower() == "auto" else forced
    cfg = Path(drafter) / "config.json"
    if not cfg.is_file():
        return None
    if json.loads(cfg.read_text()).get("model_type") != "llama":
        return None
    return None if flash_attn_built() else "TRITON_ATTN"


def spec_config(drafter: Path | str, num_spec_tokens: int = NUM_SPEC_TOKENS) -> dict[str, Any]:
    """The EAGLE-3 speculative config every harness engine serves."""
    spec: dict[str, Any] = {
        "method": "eagle3",
        "model": str(drafter),
        "num_speculative_tokens": num_spec_tokens,
    }
    backend = drafter_attention_backend(drafter)
    if backend is not None:
        spec["attention_backend"] = backend
    return spec


# The DeepSeek-V3 target's prompt set. Seed 2: along the float64 greedy path
# of these prompts (48 tokens) the smallest top-1/top-2 logit gap is 1.1e-3 and
# the smallest expert/group routing gap 1.2e-4 (tools/gpu_harness/
# fp64_reference.py), far above float32 noise. With seed 0 the 160-token prompt
# has a routing near-tie of 7.7e-8: there the plain float32 run left the
# float64 path and the EAGLE-3 run did not (H200, 2026-11-29), which says
# nothing about speculation.
DSV3_PROMPT_LENGTHS = [3, 17, 41, 90, 160]
DSV3_PROMPT_SEED = 2
DSV3_MAX_TOKENS = 48


def token_prompts(lengths, seed: int = 0, low: int = 0, high: int = 256) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(low, high) for _ in range(n)]}
        for n in lengths
    ]


SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


# deep_gemm is a Python package: its compiled library is deep_gemm._C
# (dsa_ops.install()'s stand-in is a plain module, with nothing under it).
OP_MODULES = ("vllm._C", "vllm._moe_C", "vllm.vllm_flash_attn._vllm_fa2_C",
              "vllm.vllm_flash_attn._vllm_fa3_C", "vllm._flashmla_C", "deep_gemm._C")


def moe_layer_facts(name: str, layer) -> dict[str, Any]:
    """The quant method vLLM picked for one FusedMoE layer."""
    qm = layer.quant_method
    # FusedMoEModularMethod (made where an all-to-all prepare/finalize exists:
    # expert parallelism) wraps the method chosen; its class name alone would
    # hide Marlin.
    inner = getattr(qm, "old_quant_method", None)
    fp8 = getattr(inner or qm, "fp8_backend", None)  # Fp8MoEMethod: DEEPGEMM, TRITON, ...
    return {"layer": name, "quant_method": type(qm).__name__,
            "wrapped": None if inner is None else type(inner).__name__,
            # CompressedTensorsWNA16MarlinMoEMethod also runs FlashInfer's
            # MxInt4 kernels (SM100 only): the class alone does not say.
            "kernel_backend": getattr(inner or qm, "kernel_backend", None),
            "fp8_backend": None if fp8 is None else getattr(fp8, "name", str(fp8))}


def fp8_linear_facts(model) -> dict[str, list[str]]:
    """Which GEMM serves each fp8 block-quantized linear shape (N x K), as
    W8A8BlockFp8LinearOp.apply picks it for bf16 activations: DeepGEMM where
    should_use_deepgemm_for_fp8_linear holds, else the op it dispatched at
    init (_run_cutlass, which this harness's kernel build leaves out and so
    fails by name, or _run_triton). The registry build has no DeepGEMM; the
    DSA stand-in (dsa_ops.py) has no fp8 GEMM either."""
    import torch
    from vllm.utils.deep_gemm import should_use_deepgemm_for_fp8_linear

    paths: dict[str, set[str]] = {}
    for _, m in model.named_modules():
        op = getattr(getattr(m, "quant_method", None), "w8a8_block_fp8_linear", None)
        if op is None or not hasattr(m, "weight"):
            continue
        w = m.weight
        if should_use_deepgemm_for_fp8_linear(torch.bfloat16, w, op.is_deep_gemm_supported):
            path = "deep_gemm"
        else:
            path = getattr(op.w8a8_blockscale_op, "__name__", type(op.w8a8_blockscale_op).__name__)
        paths.setdefault(path, set()).add(f"{w.shape[0]}x{w.shape[1]}")
    return {p: sorted(v) for p, v in sorted(paths.items())}


_PREFILL_PATHS = {"_fa": "flash_attn", "_fi": "flashinfer", "_cudnn": "cudnn", "_trtllm_ragged": "trtllm_ragged"}


def mla_prefill_facts(model) -> dict[str, Any]:
    """Which kernel serves MLA prefill (and so a verify on a single-token
    decode backend): the ``_run_prefill_new_tokens_*`` method vLLM bound, and
    FlashInfer's template where the harness switch (fi_prefill.py) chose it."""
    import sys

    paths = set()
    for _, m in model.named_modules():
        fn = getattr(getattr(m, "impl", None), "_run_prefill_new_tokens", None)
        if fn is not None:
            name = getattr(fn, "__name__", str(fn)).removeprefix("_run_prefill_new_tokens")
            paths.add(_PREFILL_PATHS.get(name, name))
    mla = sys.modules.get("vllm.model_executor.layers.attention.mla_attention")
    return {"paths": sorted(paths), "harness_flashinfer_template": getattr(mla, "EAGLE3_HARNESS_FI_PREFILL", None)}


def _worker_facts(worker) -> dict[str, Any]:
    """Runs in each worker (collective_rpc): what the engine actually uses,
    after vLLM's own backend choice and CUDA-graph lowering."""
    mr = worker.model_runner
    drafter = getattr(mr, "drafter", None)
    draft_layers = set(getattr(drafter, "attn_layer_names", None) or [])
    backends: dict[str, set] = {"target": set(), "drafter": set()}
    for groups in mr.attn_groups:
        for g in groups:
            for name in g.layer_names:
                backends["drafter" if name in draft_layers else "target"].add(g.backend.get_name())
    disp = getattr(drafter, "cudagraph_dispatcher", None)
    try:  # which MoE kernels serve the experts (Marlin for an INT4 release)
        from vllm.model_executor.layers.fused_moe import FusedMoE

        layers = [(n, m) for n, m in mr.get_model().named_modules() if isinstance(m, FusedMoE)]
        moe = sorted({type(m.quant_method).__name__ for _, m in layers})
        first_moe = moe_layer_facts(*layers[0]) if layers else {"layer": None}
    except Exception as e:  # noqa: BLE001 - a fact, not a check
        moe = [f"unknown ({type(e).__name__}: {e})"]
        first_moe = {"error": f"{type(e).__name__}: {e}"}
    try:
        mla_prefill = mla_prefill_facts(mr.get_model())
        if drafter is not None and getattr(drafter, "model", None) is not None:
            mla_prefill["drafter_paths"] = mla_prefill_facts(drafter.model)["paths"]
    except Exception as e:  # noqa: BLE001 - a fact, not a check
        mla_prefill = {"error": f"{type(e).__name__}: {e}"}
    try:
        fp8_linear = fp8_linear_facts(mr.get_model())
    except Exception as e:  # noqa: BLE001 - a fact, not a check
        fp8_linear = {"error": [f"{type(e).__name__}: {e}"]}
    return {
        "attention_backends": {k: sorted(v) for k, v in backends.items()},
        "mla_prefill": mla_prefill,
        "moe_quant_methods": moe,
        "moe": first_moe,  # the target's first MoE layer (the drafters have none)
        "fp8_linear": fp8_linear,  # {GEMM: [N x K shapes]}; empty without fp8 block weights
        "cudagraph_mode": str(mr.compilation_config.cudagraph_mode),
        "target_dispatcher_mode": str(getattr(mr.cudagraph_dispatcher, "cudagraph_mode", None)),
        "drafter_dispatcher_mode": None if disp is None else str(disp.cudagraph_mode),
        "compilation_mode": str(mr.compilation_config.mode),
        "op_providers": op_providers(),
    }


def _install_dispatch_tally(worker) -> bool:
    """Runs in each worker: count the CUDA-graph mode the target's
    dispatcher picks for each forward, uniform decode batches (plain decode,
    a verify at k + 1) apart from the others, until read."""
    disp = worker.model_runner.cudagraph_dispatcher
    if getattr(disp, "_eagle3_tally", None) is not None:
        disp._eagle3_tally.clear()
        return True
    tally: dict[str, int] = {}
    inner = disp.dispatch

    def dispatch(num_tokens, uniform_decode=False, *args, **kwargs):
        mode, desc = inner(num_tokens, uniform_decode, *args, **kwargs)
        key = f"{'uniform' if uniform_decode else 'mixed'} {getattr(mode, 'name', mode)}"
        tally[key] = tally.get(key, 0) + 1
        return mode, desc

    disp.dispatch = dispatch
    disp._eagle3_tally = tally
    return True


def _read_dispatch_tally(worker) -> dict[str, int]:
    tally = getattr(worker.model_runner.cudagraph_dispatcher, "_eagle3_tally", None) or {}
    out = dict(tally)
    tally.clear()
    return out


def dispatch_tally(llm, read: bool) -> dict[str, int] | None:
    """Start (read=False) or read and restart (read=True) the first
    worker's count of dispatched graph modes; None where it cannot."""
    try:
        return llm.collective_rpc(_read_dispatch_tally if read else _install_dispatch_tally)[0]
    except Exception:  # noqa: BLE001 - a fact, not a check
        return None


def graph_mode_of(tally: dict[str, int] | None) -> str | None:
    """The mode most uniform decode batches replayed (FULL, PIECEWISE, NONE)."""
    uniform = {k.split()[1]: v for k, v in (tally or {}).items() if k.startswith("uniform ")}
    return max(uniform, key=uniform.get) if uniform else None


def _kv_split_facts(worker, shapes) -> dict[str, Any]:
    """Runs in a worker: the KV splits the Triton MLA decode kernel takes
    for each (requests, tokens a request, max_seq_len), as the backend
    chooses them (a fixed 4 where it has no chooser: v0.16.0)."""
    import torch

    try:
        from vllm.v1.attention.backends.mla import triton_mla as tm
    except Exception as e:  # noqa: BLE001 - a fact, not a check
        return {"error": f"{type(e).__name__}: {e}"}
    heads = worker.model_runner.model_config.get_num_attention_heads(worker.model_runner.parallel_config)
    chooser = getattr(tm, "num_kv_splits_for", None)
    if chooser is None:
        return {"rule": "fixed 4 (v0.16.0)", "splits": {f"{r}x{t}@{s}": 4 for r, t, s in shapes}}
    from vllm.v1.attention.ops.triton_decode_attention import grouped_decode_row_blocks

    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    out = {}
    for reqs, toks, seq in shapes:
        blocks = grouped_decode_row_blocks(heads, heads, toks)[2]
        out[f"{reqs}x{toks}@{seq}"] = chooser(sms, reqs, blocks, seq)
    return {"rule": "num_kv_splits_for", "sms": sms, "min_split_len": getattr(tm, "MIN_KV_SPLIT_LEN", None),
            "splits": out}


def kv_split_facts(llm, shapes) -> dict[str, Any]:
    try:
        return llm.collective_rpc(_kv_split_facts, args=(list(shapes),))[0]
    except Exception as e:  # noqa: BLE001 - a fact, not a check
        return {"error": f"{type(e).__name__}: {e}"}


def _copy_bandwidth(worker) -> float:
    """Runs in a worker: device-to-device copy bandwidth in GB/s (bytes read
    plus bytes written over the time of a 256 MiB copy, best of 6)."""
    import torch

    n = 1 << 28  # far beyond L2; small beside a full card's free memory
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(6):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e))
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / (best / 1000) / 1e9


def copy_bandwidth_gbps(llm) -> float | None:
    try:
        return llm.collective_rpc(_copy_bandwidth)[0]
    except Exception:  # noqa: BLE001 - a fact, not a check
        return None


def engine_facts(llm) -> dict[str, Any]:
    """The first worker's facts (see _worker_facts); needs
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 (configure_env) to send the function."""
    try:
        return llm.collective_rpc(_worker_facts)[0]
    except Exception as e:  # a missing fact must not cost the run
        return {"error": f"{type(e).__name__}: {e}"}


def spec_counters(llm) -> dict[str, Any]:
    out: dict[str, Any] = {v: 0 for v in SPEC_METRICS.values()}
    out["accepted_per_position"] = None
    for m in llm.get_metrics():
        key = SPEC_METRICS.get(m.name)
        if key is not None:
            out[key] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = list(m.values)
            prev = out["accepted_per_position"] or [0] * len(vals)
            out["accepted_per_position"] = [a + b for a, b in zip(prev, vals)]
    return out


def counters_delta(before: dict, after: dict) -> dict[str, Any]:
    d = {k: after[k] - before[k] for k in SPEC_METRICS.values()}
    a, b = after["accepted_per_position"], before["accepted_per_position"]
    if a is not None:
        b = b or [0] * len(a)
        d["accepted_per_position"] = [x - y for x, y in zip(a, b)]
    else:
        d["accepted_per_position"] = None
    drafts = d["num_drafts"]
    d["mean_acceptance_length"] = (1 + d["num_accepted_tokens"] / drafts) if drafts else None
    d["draft_acceptance_rate"] = (
        d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None
    )
    return d


def generate_tokens(llm, prompts, max_tokens: int, ignore_eos: bool = True):
    """Greedy generation; returns (token id lists, spec-decode counter delta)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    before = spec_counters(llm)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    after = spec_counters(llm)
    return [list(o.outputs[0].token_ids) for o in outs], counters_delta(before, after)


def shutdown(llm) -> None:
    """Stop the engine core process and free its GPU memory."""
    engine = getattr(llm, "llm_engine", None)
    for obj, name in ((engine, "shutdown"), (getattr(engine, "engine_core", None), "shutdown")):
        fn = getattr(obj, name, None) if obj is not None else None
        if fn is not None:
            try:
                fn()
            except Exception:
                pass
    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:
        pass


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_tokens(plain, spec, what: str = "EAGLE-3") -> None:
    assert len(plain) == len(spec)
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert a == b, (
            f"prompt {i}: {what} output diverges from plain greedy at token "
            f"{first_divergence(a, b)}\nplain: {a}\neagle3: {b}"
        )


def assert_drafted(metrics) -> None:
    # Only that speculation ran; the counters' own invariants always hold.
    assert metrics["num_drafts"] > 0, f"no drafts were proposed: {metrics}"


def op_providers() -> dict[str, str]:
    """Who serves each compiled-op module in this process: built (a compiled
    library), stand-in (a .py file, or a module made at run time by
    dsa_ops.install(), or a library under such a module) or absent."""
    import importlib

    providers = {}
    for mod in OP_MODULES:
        try:
            m = importlib.import_module(mod)
            f = getattr(m, "__file__", None)
            providers[mod] = f"built {f}" if f and not f.endswith(".py") else f"stand-in {f or m.__doc__}"
        except ImportError as e:
            parent = sys.modules.get(mod.rpartition(".")[0])
            made = parent is not None and getattr(parent, "__file__", None) is None
            providers[mod] = f"stand-in {parent.__doc__}" if made else f"absent ({e})"
    return providers


def token_agreement(plain, spec) -> dict[str, Any]:
    """How much of two greedy outputs agrees: equal prompts, and the share of
    tokens before each prompt's first divergence (bf16 runs report this
    where the float32 smoke tests assert equality)."""
    same_prefix = 0
    total = 0
    for a, b in zip(plain, spec):
        d = first_divergence(a, b)
        same_prefix += len(a) if d is None else d
        total += len(a)
    return {
        "equal_prompts": sum(a == b for a, b in zip(plain, spec)),
        "prompts": len(plain),
        "tokens_before_first_divergence": same_prefix,
        "tokens": total,
        "first_divergence": [first_divergence(a, b) for a, b in zip(plain, spec)],
    }
