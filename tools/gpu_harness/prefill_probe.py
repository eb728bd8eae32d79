#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Measure the MLA prefill candidates for a Hopper build without FlashAttention-3.

    python3 tools/gpu_harness/prefill_probe.py --out DIR      (a GPU; PYTHONPATH holds the carried wheels)

vLLM 0.16.0 runs MLA prefill, and with TRITON_MLA every EAGLE-3 verify (k + 1
query tokens a request), on ``vllm_flash_attn`` on Hopper; the registry-only
harness has no FA3 (kernels.py). Each candidate here runs the two calls
vLLM's MLA prefill makes, at one TP-8 rank's head count of DeepSeek-V3 (16)
and Kimi-K2.5 (8), qk head 192 (128 + 64), v head 128, bf16:

* ``new``: the new tokens against themselves, causal, with the log-sum-exp;
* ``context``: the new tokens against a context chunk, not causal, with it.

Shapes: the EAGLE-3 verify of k = 3 (4 tokens a request) at batch 1, 8, 32
and 128 over a 144-token context, and a prompt prefill (8 x 1024 tokens).
Each output and log-sum-exp (natural log, as vLLM's ``merge_attn_states``
reads it) is checked against a float32 torch reference; the time is the
median of CUDA-event timings after warm-up, planning included where vLLM
plans per step. Candidates: FlashInfer 0.6.3's ragged prefill with its sm90
template (``fa3``) and its sm80 one (``fa2``), through fi_prefill.py's
wrapper exactly as the engine would get it. PyPI's flash-attn-4 is not
measured: it needs nvidia-cutlass-dsl-libs-cu13 (92 MB), more than one device
call carries (64 MiB). The result names the fastest that is correct.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))

from tools.gpu_harness import fi_prefill  # noqa: E402

HEADS = {"deepseek-v3": 16, "kimi-k25": 8}
QK, V = 192, 128
CASES = [("verify", b, 4, 144) for b in (1, 8, 32, 128)] + [("prompt", 8, 1024, 0)]
NOT_MEASURED = {"flash-attn-4": "needs nvidia-cutlass-dsl-libs-cu13 (92 MB), over the 64 MiB one device call carries"}


def reference(q, k, v, qo, kv, causal, scale):
    import torch

    outs, lses = [], []
    for i in range(len(qo) - 1):
        qi = q[qo[i]:qo[i + 1]].float().transpose(0, 1)
        ki = k[kv[i]:kv[i + 1]].float().transpose(0, 1)
        vi = v[kv[i]:kv[i + 1]].float().transpose(0, 1)
        s = qi @ ki.transpose(1, 2) * scale
        if causal:  # bottom-right aligned, as FlashInfer and FA do
            nq, nk = s.shape[-2:]
            mask = torch.ones(nq, nk, dtype=torch.bool, device=s.device).tril(nk - nq)
            s = s.masked_fill(~mask, float("-inf"))
        lses.append(torch.logsumexp(s, -1).transpose(0, 1))
        outs.append((s.softmax(-1) @ vi).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def time_ms(fn, reps: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def probe(backend: str, heads: int, case: tuple, ws) -> dict:
    import flashinfer
    import torch

    name, b, n_new, n_ctx = case
    wrapper_cls = fi_prefill.ragged_wrapper(flashinfer.BatchPrefillWithRaggedKVCacheWrapper, backend)
    g = torch.Generator(device="cuda").manual_seed(0)
    scale = QK ** -0.5
    qo = torch.arange(0, (b + 1) * n_new, n_new, dtype=torch.int32, device="cuda")
    q = torch.randn(b * n_new, heads, QK, device="cuda", dtype=torch.bfloat16, generator=g)
    row: dict = {"case": name, "batch": b, "new_tokens": n_new, "context_tokens": n_ctx, "heads": heads}
    calls = [("new", qo, n_new, True)] + ([("context", None, n_ctx, False)] if n_ctx else [])
    for part, _, n_kv, causal in calls:
        kv = torch.arange(0, (b + 1) * n_kv, n_kv, dtype=torch.int32, device="cuda")
        k = torch.randn(b * n_kv, heads, QK, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b * n_kv, heads, V, device="cuda", dtype=torch.bfloat16, generator=g)
        # vLLM's backend name: the wrapper maps it to the Hopper template.
        w = wrapper_cls(ws, "NHD", backend="cutlass")

        def plan():
            w.plan(qo_indptr=qo, kv_indptr=kv, num_qo_heads=heads, num_kv_heads=heads, head_dim_qk=QK,
                   head_dim_vo=V, causal=causal, sm_scale=scale, window_left=-1, logits_soft_cap=0.0,
                   q_data_type=torch.bfloat16)

        t0 = time.perf_counter()
        plan()
        out, lse = w.run(q=q, k=k, v=v, return_lse=True)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0  # the JIT compile, on first use
        ref_o, ref_lse = reference(q, k, v, qo.tolist(), kv.tolist(), causal, scale)
        row[part] = {
            "first_call_s": round(first_s, 2),
            "out_max_abs_err": float((out.float() - ref_o).abs().max()),
            "lse_max_abs_err": float((lse - ref_lse).abs().max()),
            "run_ms": time_ms(lambda: w.run(q=q, k=k, v=v, return_lse=True)),
            "plan_and_run_ms": time_ms(lambda: (plan(), w.run(q=q, k=k, v=v, return_lse=True))),
        }
        row[part]["correct"] = row[part]["out_max_abs_err"] < 2e-2 and row[part]["lse_max_abs_err"] < 2e-3
    return row


def main(argv=None) -> int:
    head, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(prog="prefill_probe.py", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--backends", default=",".join(fi_prefill.BACKENDS))
    args = ap.parse_args(argv)
    import flashinfer
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    res = {"what": head, "command": " ".join(["prefill_probe.py", *(argv or sys.argv[1:])]),
           "flashinfer": flashinfer.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(0), "qk_head": QK, "v_head": V, "not_measured": NOT_MEASURED,
           "candidates": {}}
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    path = args.out / "prefill_probe.json"
    for backend in args.backends.split(","):
        rows = res["candidates"].setdefault(f"flashinfer-{backend}", [])
        for model, heads in HEADS.items():
            for case in CASES:
                try:
                    rows.append({"model": model, **probe(backend, heads, case, ws)})
                except Exception as e:  # noqa: BLE001 - a candidate that fails is a result
                    rows.append({"model": model, "case": case[0], "batch": case[1],
                                 "error": f"{type(e).__name__}: {e}"[:2000]})
                print("PROBE", backend, json.dumps(rows[-1])[:600], flush=True)
                path.write_text(json.dumps(res, indent=1))
    ok = {c: rows for c, rows in res["candidates"].items()
          if rows and all(r.get("new", {}).get("correct") and r.get("context", {"correct": True}).get("correct")
                          for r in rows)}
    verify = {c: sum(r["new"]["plan_and_run_ms"] + r.get("context", {}).get("plan_and_run_ms", 0)
                     for r in rows if r["case"] == "verify") for c, rows in ok.items()}
    res["verify_ms_total"] = verify
    res["chosen"] = min(verify, key=verify.get) if verify else None
    path.write_text(json.dumps(res, indent=1))
    print("CHOSEN", res["chosen"], json.dumps(verify), flush=True)
    return 0 if res["chosen"] else 1


if __name__ == "__main__":
    sys.exit(main())
