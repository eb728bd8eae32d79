#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""EAGLE-3 on MLA targets in production settings, offline and through the server.

    python tools/gpu_harness/prod_check.py offline --out DIR
    python tools/gpu_harness/prod_check.py server --out DIR

Production settings (tests/e2e/gpu/gpu_e2e_helpers.py, profile
``production``): bfloat16, MLA on with the real latent geometry, vLLM's
default compilation (torch.compile + piecewise CUDA graphs), the attention
backends vLLM selects.

``offline`` serves, with ``vllm.LLM``: DeepSeek-V3 plain and with a
Llama-architecture EAGLE-3 drafter, Kimi-K2.5 plain and with the Llama
drafter, and Kimi-K2.5 with the MLA drafter (model type kimi_k2). Each run
records its tokens, the spec-decode counters and the greedy agreement with
plain decoding (bf16: reported, not asserted). One failing run does not stop
the others; its traceback goes into the JSON.

``backends`` forces the target's attention to each MLA backend in turn,
plain and with each drafter, and records which serve, which are refused at
engine start (and with what message) and which fail after starting.

``server`` starts ``python -m vllm.entrypoints.openai.api_server`` with the
DeepSeek-V3 target and the Llama drafter (``--kimi``: Kimi-K2.5 and the MLA
drafter; ``--kimi llama``: Kimi-K2.5 and the Llama drafter) on a free port,
sends concurrent completions with
the ``openai`` client, and reads ``/metrics``.

The random tiny weights make acceptance low here; acceptance as proof is
bench_eagle3.py's job.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Run as a script: the repository root goes last on sys.path (so
# `tools.gpu_harness` resolves and the installed vllm stays first).
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e" / "gpu"))

os.environ.setdefault("EAGLE3_GPU_PROFILE", "production")
import gpu_e2e_helpers as h  # noqa: E402
from tools.gpu_harness import data  # noqa: E402

KIMI_EXTRA = {"limit_mm_per_prompt": {"vision_chunk": 0}}
KIMI_PROMPTS = ["Kimi, tell me a short story about a very small random model.", "2 + 2 ="]


def write_models(work: Path) -> dict[str, Path]:
    tiny = h._tiny()
    kw = h.checkpoint_kwargs()
    paths = {
        "deepseek_v3": work / "deepseek_v3",
        "kimi_k25": work / "kimi_k25",
        "llama_drafter": work / "llama_drafter",
        "mla_drafter_kimi_k2": work / "mla_drafter_kimi_k2",
    }
    tiny.write_checkpoint("deepseek-v3", paths["deepseek_v3"], seed=0, **kw)
    tiny.write_checkpoint("kimi-k25", paths["kimi_k25"], seed=1, **kw)
    tiny.write_checkpoint("eagle3-drafter", paths["llama_drafter"], seed=2,
                          dtype=kw["dtype"], **h.drafter_shape())
    tiny.write_checkpoint("eagle3-mla-drafter", paths["mla_drafter_kimi_k2"], seed=4,
                          model_type="kimi_k2", **kw)
    return paths


def _run(name, model, prompts, drafter=None, **extra):
    from vllm import LLM

    t0 = time.perf_counter()
    rec = {"name": name, "model": str(model), "drafter": None if drafter is None else str(drafter)}
    try:
        llm = LLM(**h.engine_kwargs(model, drafter, **extra))
        rec["engine_start_s"] = time.perf_counter() - t0
        try:
            cc = llm.llm_engine.vllm_config.compilation_config
            rec["compilation"] = {"mode": str(cc.mode), "cudagraph_mode": str(cc.cudagraph_mode),
                                  "cudagraph_capture_sizes": cc.cudagraph_capture_sizes}
            rec["engine"] = h.engine_facts(llm)
            rec["enforce_eager"] = llm.llm_engine.vllm_config.model_config.enforce_eager
            rec["dtype"] = str(llm.llm_engine.vllm_config.model_config.dtype)
            rec["use_mla"] = llm.llm_engine.vllm_config.model_config.use_mla
            if drafter is not None:
                rec["drafter_architecture"] = (
                    llm.llm_engine.vllm_config.speculative_config.draft_model_config.architecture)
            tokens, metrics = h.generate_tokens(llm, prompts, 32)
            rec.update(tokens=tokens, spec_decode_metrics=metrics, ok=True)
        finally:
            h.shutdown(llm)
    except Exception as e:  # recorded, the next run still goes
        rec.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-6000:])
    rec["seconds"] = time.perf_counter() - t0
    print("RUN", json.dumps({k: v for k, v in rec.items() if k not in ("tokens", "traceback")}), flush=True)
    return rec


def offline(out: Path, work: Path, only: str | None = None) -> None:
    h.configure_env()
    m = write_models(work)
    dsv3_prompts = h.token_prompts([3, 17, 41, 90], seed=h.DSV3_PROMPT_SEED)
    runs = []
    pairs = [
        ("deepseek_v3", dsv3_prompts, {}, [("llama_drafter", m["llama_drafter"])]),
        ("kimi_k25", KIMI_PROMPTS, KIMI_EXTRA,
         [("llama_drafter", m["llama_drafter"]), ("mla_drafter_kimi_k2", m["mla_drafter_kimi_k2"])]),
    ]
    for target, prompts, extra, drafters in pairs:
        if only and target != only:
            continue
        plain = _run(f"{target}/plain", m[target], prompts, **extra)
        runs.append(plain)
        for dname, dpath in drafters:
            spec = _run(f"{target}/{dname}", m[target], prompts, drafter=dpath, **extra)
            if plain.get("ok") and spec.get("ok"):
                spec["agreement_with_plain"] = h.token_agreement(plain["tokens"], spec["tokens"])
                print("AGREE", spec["name"], json.dumps(spec["agreement_with_plain"]), flush=True)
            runs.append(spec)
    (out / f"prod_offline{'_' + only if only else ''}.json").write_text(json.dumps(
        {"profile": h.profile(), "op_providers": h.op_providers(), "runs": runs}, indent=1))


MLA_BACKENDS = ("FLASH_ATTN_MLA", "TRITON_MLA", "FLASHMLA", "FLASHINFER_MLA", "CUTLASS_MLA")


def outcome(rec: dict) -> str:
    """served, refused at engine start, or failed after the engine started
    (the one outcome a forced backend must never have)."""
    if rec.get("ok"):
        return "served"
    return "failed mid-run" if "engine_start_s" in rec else "refused at start"


def backends(out: Path, work: Path) -> None:
    """DeepSeek-V3 with the target's attention forced to each MLA backend,
    plain and with each drafter: the matrix of what serves and what is
    refused at engine start (with the error, which must name the fix)."""
    h.configure_env()
    m = write_models(work)
    prompts = h.token_prompts([3, 17, 41, 90], seed=h.DSV3_PROMPT_SEED)
    rows = []
    # EAGLE3_BACKENDS narrows the matrix so that it fits several device calls.
    chosen = [b for b in os.environ.get("EAGLE3_BACKENDS", ",".join(MLA_BACKENDS)).split(",") if b]
    # EAGLE3_BACKEND_DRAFTERS (e.g. "llama_drafter") narrows the drafters;
    # "plain" names the run without one.
    drafters = [None, "llama_drafter", "mla_drafter_kimi_k2"]
    if os.environ.get("EAGLE3_BACKEND_DRAFTERS"):
        names = os.environ["EAGLE3_BACKEND_DRAFTERS"].split(",")
        drafters = [d for d in drafters if (d or "plain") in names]
    for backend in chosen:
        for dname in drafters:
            rec = _run(f"deepseek_v3/{backend}/{dname or 'plain'}", m["deepseek_v3"], prompts,
                       drafter=m[dname] if dname else None, attention_backend=backend)
            rows.append({"backend": backend, "drafter": dname, "outcome": outcome(rec),
                         "error": rec.get("error"), "engine": rec.get("engine"),
                         "traceback": rec.get("traceback")})
            print("MATRIX", backend, dname, rows[-1]["outcome"], (rec.get("error") or "")[:300], flush=True)
    (out / f"prod_backends_{'_'.join(chosen)}.json").write_text(json.dumps({"profile": h.profile(), "rows": rows}, indent=1))


def _free_port() -> int:
    # Several server stages share one device call (device_parallel.sh).
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server(out: Path, work: Path, port: int | None = None, target: Path | None = None,
           drafter: Path | None = None, kimi: str | None = None) -> None:
    """With --target/--drafter (e.g. bench_eagle3.py's trained pair) the
    prompts are token ids of the bench's skip-rule language, so /metrics
    shows the acceptance the trained drafter reaches through the server."""
    h.configure_env()
    port = port or _free_port()
    rule_prompts = target is not None
    extra_args: list[str] = []
    if target is None:
        m = write_models(work)
        target, drafter = m["deepseek_v3"], m["llama_drafter"]
        if kimi:
            target = m["kimi_k25"]
            drafter = m["llama_drafter" if kimi == "llama" else "mla_drafter_kimi_k2"]
            extra_args = ["--limit-mm-per-prompt", json.dumps(KIMI_EXTRA["limit_mm_per_prompt"])]
    if os.environ.get("EAGLE3_GPU_KV_BYTES"):
        extra_args += ["--kv-cache-memory-bytes", os.environ["EAGLE3_GPU_KV_BYTES"]]
    spec = json.dumps(h.spec_config(drafter))
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(target), "--dtype", "bfloat16", "--max-model-len", "1024",
           "--max-num-seqs", "16", "--gpu-memory-utilization", str(h.GPU_MEMORY_UTILIZATION),
           "--speculative-config", spec, "--port", str(port), "--seed", "0", *extra_args]
    log = open(out / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    rec = {"command": " ".join(cmd)}
    t0 = time.perf_counter()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2).read()
                break
            except Exception:
                if time.perf_counter() - t0 > 240:
                    raise TimeoutError("server not healthy after 240 s")
                time.sleep(2)
        rec["ready_s"] = time.perf_counter() - t0
        import openai

        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        if rule_prompts:
            prompts = [p["prompt_token_ids"] for p in data.rule_prompts(16, seed=2000)]
        else:
            prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog " * (1 + i % 3)
                       for i in range(16)]

        def one(p):
            r = client.completions.create(model=str(target), prompt=p, max_tokens=40,
                                          temperature=0.0)
            return r.choices[0].text, r.usage.completion_tokens

        t1 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=16) as ex:
            res = list(ex.map(one, prompts))
        rec["concurrent_requests"] = len(prompts)
        rec["completion_tokens"] = [n for _, n in res]
        rec["wall_s"] = time.perf_counter() - t1
        metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        rec["metrics"] = [ln for ln in metrics.splitlines()
                          if ln.startswith("vllm:spec_decode") or ln.startswith("vllm:generation_tokens")]
        vals = {}
        for ln in rec["metrics"]:
            name = ln.split("{")[0].split(" ")[0]
            if not ln.startswith("#") and name in ("vllm:spec_decode_num_drafts_total",
                                                   "vllm:spec_decode_num_accepted_tokens_total",
                                                   "vllm:spec_decode_num_draft_tokens_total"):
                vals[name] = vals.get(name, 0.0) + float(ln.split()[-1])
        drafts = vals.get("vllm:spec_decode_num_drafts_total", 0.0)
        if drafts:
            rec["mean_acceptance_length"] = 1 + vals.get("vllm:spec_decode_num_accepted_tokens_total", 0) / drafts
        rec["ok"] = all(n == 40 for _, n in res) and any(
            ln.startswith("vllm:spec_decode_num_drafts") and float(ln.split()[-1]) > 0
            for ln in rec["metrics"])
    except Exception as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    print("SERVER", json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)
    (out / f"prod_server{'_kimi_k25_' + kimi if kimi else ''}.json").write_text(json.dumps(rec, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["offline", "server", "backends"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/eagle3_prod_work"))
    ap.add_argument("--only", choices=["deepseek_v3", "kimi_k25"], help="offline: one target")
    ap.add_argument("--target", type=Path, help="server: target checkpoint (default: tiny random)")
    ap.add_argument("--drafter", type=Path, help="server: EAGLE-3 drafter for --target")
    ap.add_argument("--kimi", nargs="?", const="mla", choices=["mla", "llama"],
                    help="server: Kimi-K2.5 with the MLA drafter (or the Llama one)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.what == "offline":
        offline(args.out, args.work, args.only)
    elif args.what == "backends":
        backends(args.out, args.work)
    else:
        server(args.out, args.work, target=args.target, drafter=args.drafter, kimi=args.kimi)


if __name__ == "__main__":
    main()
