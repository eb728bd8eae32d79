#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Float64 CPU reference for the tiny DeepSeek-V3 target (no vLLM involved).

Runs transformers' DeepseekV3ForCausalLM (4.57) in float64 with its router
replaced by one that follows vLLM's noaux_tc semantics exactly (sigmoid
scores + e_score_correction_bias, top-2-sum group scores, -inf outside the
selected groups; transformers 4.57 masks with 0.0 and routes in float32), and
reports for each prompt the greedy continuation and the two margins that
decide whether float32 engines can disagree: the smallest top-1/top-2 logit
gap and the smallest routing gap (k-th vs (k+1)-th biased expert score, and
the same for groups) along the greedy path.

    python tools/gpu_harness/fp64_reference.py CKPT_DIR --lengths 3,17,41 --seed 0 --max-tokens 48
    python tools/gpu_harness/fp64_reference.py CKPT_DIR --check RESULTS.json

``--check`` compares the token lists of a GPU results file
(tests/e2e/gpu/test_eagle3_e2e.py writes them) with the float64 greedy path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e" / "gpu"))

ROUTE_GAPS: list[float] = []
# Per router call, each token's own routing margin (the smaller of its
# expert and group margins), when a caller sets TOKEN_MARGINS to a list.
TOKEN_MARGINS: list | None = None


def _router_forward(self, hidden_states):
    hs = hidden_states.view(-1, self.config.hidden_size).double()
    scores = F.linear(hs, self.weight.double()).sigmoid()
    choice = scores + self.e_score_correction_bias.double().unsqueeze(0)
    per = self.n_routed_experts // self.n_group
    gs = choice.view(-1, self.n_group, per).topk(2, dim=-1)[0].sum(-1)
    gidx = gs.topk(self.topk_group, dim=-1)[1]
    gmask = torch.zeros_like(gs).scatter_(1, gidx, 1)
    smask = gmask.unsqueeze(-1).expand(-1, self.n_group, per).reshape(-1, self.n_routed_experts)
    choice = choice.masked_fill(~smask.bool(), float("-inf"))
    ids = choice.topk(self.top_k, dim=-1)[1]
    w = scores.gather(1, ids)
    if self.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    srt = choice.sort(-1, descending=True).values
    per_token = torch.full((hs.shape[0],), float("inf"), dtype=torch.float64)
    if srt.shape[-1] > self.top_k:
        gap = srt[:, self.top_k - 1] - srt[:, self.top_k]
        ROUTE_GAPS.append(gap.min().item())
        per_token = torch.minimum(per_token, gap)
    if self.n_group > self.topk_group:
        gsrt = gs.sort(-1, descending=True).values
        ggap = gsrt[:, self.topk_group - 1] - gsrt[:, self.topk_group]
        ROUTE_GAPS.append(ggap.min().item())
        per_token = torch.minimum(per_token, ggap)
    if TOKEN_MARGINS is not None:
        TOKEN_MARGINS.append(per_token)
    return ids, w * self.routed_scaling_factor


def load(ckpt: Path):
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as m
    from transformers import AutoModelForCausalLM

    m.DeepseekV3TopkRouter.forward = _router_forward
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float64)
    return model.eval()


@torch.no_grad()
def greedy(model, prompt: list[int], max_tokens: int) -> dict:
    ids = list(prompt)
    gaps = []
    ROUTE_GAPS.clear()
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        top2 = logits.topk(2).values
        gaps.append((top2[0] - top2[1]).item())
        ids.append(int(logits.argmax()))
    return {
        "tokens": ids[len(prompt):],
        "min_logit_gap": min(gaps),
        "min_routing_gap": min(ROUTE_GAPS) if ROUTE_GAPS else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--lengths", default="3,17,41,90,160")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--check", type=Path, help="GPU results JSON to compare")
    args = ap.parse_args(argv)
    import gpu_e2e_helpers as h

    model = load(args.ckpt)
    if args.check:
        d = json.loads(args.check.read_text())
        prompts = h.token_prompts(d["prompt_lengths"], seed=d.get("prompt_seed", 0))
        max_tokens = d["max_tokens"]
    else:
        prompts = h.token_prompts([int(x) for x in args.lengths.split(",")], seed=args.seed)
        max_tokens = args.max_tokens
    out = []
    for i, p in enumerate(prompts):
        r = greedy(model, p["prompt_token_ids"], max_tokens)
        line = {"prompt": i, "len": len(p["prompt_token_ids"]), **{k: r[k] for k in ("min_logit_gap", "min_routing_gap")}}
        if args.check:
            for key in ("plain", "eagle3"):
                line[f"{key}_equals_fp64"] = d[key][i] == r["tokens"]
        out.append(line)
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
