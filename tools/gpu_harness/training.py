# SPDX-License-Identifier: Apache-2.0
"""Training, shared by the GPU harness jobs: the tiny target on the
skip-rule language (in a child process: ``python tools/gpu_harness/training.py
train-target``), and the EAGLE-3 drafter on captured aux states (pure torch,
the math of vLLM's LlamaForCausalLMEagle3, k = K unrolled)."""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Imported by its package name (tools.gpu_harness...) from the job scripts, and
# by the GPU tests: the repository root goes last on sys.path, so that the
# installed vllm stays first.
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))

from tools.gpu_harness.data import K, RULE_NOISE, TARGET_SEQ_LEN, dense_view, rule_sequence, skip_rule  # noqa: E402

def optimizer(params, lr: float, steps: int):
    """AdamW with 50 warm-up steps and a cosine decay; ``step(loss)`` clips and steps."""
    import torch

    params = list(params)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))

    def step(loss) -> None:
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()

    return step


def train_target_apart(train_dir: Path, steps: int, work: Path) -> dict:
    """train_target in a child process (``train-target``), so that this one
    starts no CUDA context before vLLM forks its engine; its output goes to
    work/target_training.log and its result to work/target_training.json."""
    r = subprocess.run([sys.executable, __file__, "train-target", "--target", str(train_dir),
                        "--steps", str(steps), "--out", str(work / "target_training.json")],
                       capture_output=True, text=True)
    (work / "target_training.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"target training failed:\n{(r.stdout + r.stderr)[-4000:]}")
    return json.loads((work / "target_training.json").read_text())


def train_target(target_dir: Path, steps: int, device: str = "cuda", batch_size: int = 64) -> dict:
    """Train the tiny target on the skip-rule language, in place."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    f = skip_rule()
    rng = random.Random(11)
    # transformers 4.57 has no DSA model (GLM-5, V3.2): train their dense
    # DeepSeek-V3 view; the indexer weights stay as written.
    view = dense_view(Path(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(view), dtype=torch.float32).to(device)
    model.train()
    opt_step = optimizer(model.parameters(), 1e-3, steps)

    def batch(n):
        return torch.tensor([rule_sequence(rng, f, TARGET_SEQ_LEN) for _ in range(n)], device=device)

    val = batch(64)
    t0 = time.perf_counter()
    log = []
    for step in range(steps):
        x = batch(batch_size)
        loss = model(input_ids=x, labels=x).loss
        opt_step(loss)
        if step % 200 == 0 or step == steps - 1:
            model.eval()
            with torch.no_grad():
                pred = model(input_ids=val).logits.argmax(-1)[:, 1:-1]
            # Share of positions where the argmax is the rule's token.
            rule_next = torch.tensor(f, device=device)[val[:, :-2]]
            acc = (pred == rule_next).float().mean().item()
            model.train()
            log.append({"step": step, "loss": loss.item(), "rule_accuracy": acc})
            print("target", json.dumps(log[-1]), flush=True)
    orig = load_file(str(Path(target_dir) / "model.safetensors"))
    trained = model.state_dict()
    missing = sorted(k for k in set(orig) - set(trained) if ".indexer." not in k)
    if missing:
        raise SystemExit(f"transformers' model lacks checkpoint tensors: {missing[:5]}")
    save_file({k: (trained[k].detach() if k in trained else v).to(v.dtype).cpu().contiguous()
               for k, v in orig.items()},
              str(Path(target_dir) / "model.safetensors"), metadata={"format": "pt"})
    return {"steps": steps, "seconds": time.perf_counter() - t0, "noise": RULE_NOISE,
            "final_rule_accuracy": log[-1]["rule_accuracy"], "log": log}


def _rms(x, w, eps):
    xf = x.float()
    return (xf * (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt()).to(x.dtype) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    import torch

    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    f = pos.float()[..., None] * inv  # [B, L, d/2]
    cos, sin = f.cos()[:, None], f.sin()[:, None]  # [B, 1, L, d/2]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Drafter:
    def __init__(self, cfg, weights, embed, device):
        import torch

        self.cfg = cfg
        self.p = {k: v.to(device).float().clone().requires_grad_(v.is_floating_point())
                  for k, v in weights.items() if k not in ("d2t", "t2d")}
        self.embed = embed.to(device).float()
        self.eps = cfg["rms_norm_eps"]
        self.nh = cfg["num_attention_heads"]
        self.torch = torch
        self.init_attention(cfg, device)

    def init_attention(self, cfg, device) -> None:
        """What ``qkv`` reads from the config: Llama's GQA and rope."""
        self.nkv, self.hd = cfg["num_key_value_heads"], cfg["head_dim"]
        self.theta = cfg.get("rope_theta", 10000.0)

    def params(self):
        return [v for v in self.p.values() if v.requires_grad]

    def layer(self, tok, hidden, pos, first_kv, chain_kv):
        """One drafter step over all slots. hidden: fc output (step 1) or the
        previous step's pre-norm output. first_kv: None for step 1 (causal
        over slots), else the step-1 (k, v); chain_kv: this slot's own (k, v)
        of steps 2..j-1. Returns (prenorm, logits, k, v)."""
        torch, p = self.torch, self.p
        B, L, H = hidden.shape
        e = _rms(self.embed[tok], p["midlayer.input_layernorm.weight"], self.eps)
        x = torch.cat([e, _rms(hidden, p["midlayer.hidden_norm.weight"], self.eps)], dim=-1)
        q, k, v, scale = self.qkv(x, pos)
        if first_kv is None:
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                   scale=scale)
        else:
            k1, v1 = first_kv
            s1 = (q @ k1.transpose(-1, -2)) * scale
            causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
            s1 = s1.masked_fill(~causal, float("-inf"))
            diag = [(q * kc).sum(-1, keepdim=True) * scale for kc, _ in chain_kv]
            diag.append((q * k).sum(-1, keepdim=True) * scale)
            pr = torch.softmax(torch.cat([s1, *diag], dim=-1), dim=-1)
            att = pr[..., :L] @ v1
            for m, (_, vc) in enumerate([*chain_kv, (None, v)]):
                att = att + pr[..., L + m:L + m + 1] * vc
        att = att.transpose(1, 2).reshape(B, L, -1) @ p["midlayer.self_attn.o_proj.weight"].T
        s = att + hidden
        h2 = _rms(s, p["midlayer.post_attention_layernorm.weight"], self.eps)
        mlp = (torch.nn.functional.silu(h2 @ p["midlayer.mlp.gate_proj.weight"].T)
               * (h2 @ p["midlayer.mlp.up_proj.weight"].T)) @ p["midlayer.mlp.down_proj.weight"].T
        pre = mlp + s
        logits = _rms(pre, p["norm.weight"], self.eps) @ p["lm_head.weight"].T
        return pre, logits, k, v

    def qkv(self, x, pos):
        """The attention's q, k, v [B, heads, L, d] (k and v repeated to
        every query head) from x = [embeds, hidden] [B, L, 2H], and its
        softmax scale: Llama's GQA with rope."""
        p = self.p
        B, L, _ = x.shape
        q = (x @ p["midlayer.self_attn.q_proj.weight"].T).view(B, L, self.nh, self.hd).transpose(1, 2)
        k = (x @ p["midlayer.self_attn.k_proj.weight"].T).view(B, L, self.nkv, self.hd).transpose(1, 2)
        v = (x @ p["midlayer.self_attn.v_proj.weight"].T).view(B, L, self.nkv, self.hd).transpose(1, 2)
        q, k = _rope(q, pos, self.theta), _rope(k, pos, self.theta)
        rep = self.nh // self.nkv
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), self.hd ** -0.5

    def unrolled_loss(self, toks, aux, mask):
        """toks [B, L] target tokens, aux [B, L, 3H], mask [B, L] (1 where the
        token is the target's own greedy output). Slot i, step j (1-based):
        input token toks[i+j], label toks[i+j+1], position i+j-1."""
        torch = self.torch
        B, L = toks.shape
        hidden = aux @ self.p["fc.weight"].T
        pos0 = torch.arange(L, device=toks.device)[None].expand(B, L)
        losses, accs, first, chain = [], [], None, []
        for j in range(1, K + 1):
            n = L - j - 1  # slots with a label
            tok_in = toks[:, j:j + n]
            lab = toks[:, j + 1:j + 1 + n]
            m = mask[:, j + 1:j + 1 + n]
            pad = L - n
            tok_full = torch.nn.functional.pad(tok_in, (0, pad))
            pre, logits, kk, vv = self.layer(tok_full, hidden, pos0 + (j - 1), first, chain)
            lg = logits[:, :n]
            ce = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), lab.reshape(-1), reduction="none")
            w = m.reshape(-1).float()
            losses.append((ce * w).sum() / w.sum().clamp(min=1))
            accs.append(((lg.argmax(-1) == lab).float() * m).sum().item() / max(1.0, m.sum().item()))
            if j == 1:
                first = (kk, vv)
            else:
                chain.append((kk, vv))
            hidden = pre
        return losses, accs


# The k = 3 unrolled steps' losses weigh less the later the step.
LOSS_WEIGHTS = (1.0, 0.8, 0.6)


def fit(drafter: Drafter, toks, aux, mask, steps: int, lr: float = 3e-3,
        batch: int = 16, seed: int = 0) -> None:
    """Train ``drafter`` in place on every row of ``toks``/``aux``/``mask``
    (no validation split: for the CPU examples and tests)."""
    import torch

    step = optimizer(drafter.params(), lr, steps)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(toks), (batch,), generator=gen)
        losses, _ = drafter.unrolled_loss(toks[idx], aux[idx], mask[idx])
        step(sum(w * x for w, x in zip(LOSS_WEIGHTS, losses)))


def save(params: dict, weights: dict, path: Path) -> None:
    """``params`` in the dtypes of the checkpoint ``weights`` they came from,
    with its d2t/t2d, as ``path`` (a model.safetensors)."""
    from safetensors.torch import save_file

    new = {k: v.detach().to(weights[k].dtype).cpu().contiguous() for k, v in params.items()}
    new["d2t"], new["t2d"] = weights["d2t"], weights["t2d"]
    save_file(new, str(path), metadata={"format": "pt"})


def train(target_dir, drafter_dir, seqs, prompt_lens, aux_path, out_dir, steps, device="cuda"):
    import shutil

    import torch
    from safetensors.torch import load_file

    data = torch.load(aux_path)
    keep = [i for i, a in enumerate(data["aux"]) if a is not None]
    L = min(len(seqs[i]) for i in keep)
    toks = torch.tensor([seqs[i][:L] for i in keep], device=device)
    aux = torch.stack([data["aux"][i][:L] for i in keep]).to(device)
    mask = torch.zeros_like(toks)
    for r, i in enumerate(keep):
        mask[r, prompt_lens[i]:] = 1
    n_val = max(8, len(keep) // 8)
    cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    weights = load_file(str(Path(drafter_dir) / "model.safetensors"))
    tw = load_file(str(Path(target_dir) / "model.safetensors"))
    # Kimi-K2.5 keeps its text model under language_model.
    embed = tw.get("model.embed_tokens.weight", tw.get("language_model.model.embed_tokens.weight"))
    d = Drafter(cfg, weights, embed, device)
    opt_step = optimizer(d.params(), 2e-3, steps)
    log = []
    best = (-1.0, None)
    t0 = time.perf_counter()
    # Step -1 is the drafter as it came, before any update.
    for step in range(-1, steps):
        loss = None
        if step >= 0:
            idx = torch.randint(n_val, len(keep), (64,), device=device)
            losses, _ = d.unrolled_loss(toks[idx], aux[idx], mask[idx])
            loss = sum(w * x for w, x in zip(LOSS_WEIGHTS, losses))
            opt_step(loss)
        if step % 100 == 0 or step in (-1, steps - 1):
            with torch.no_grad():
                vl, va = d.unrolled_loss(toks[:n_val], aux[:n_val], mask[:n_val])
            log.append({"step": step, "train_loss": None if loss is None else loss.item(),
                        "val_loss": [float(x) for x in vl], "val_acc": va})
            print(json.dumps(log[-1]))
            # Keep the weights of the best validation point (a tiny data set
            # overfits late in the schedule).
            score = predicted_acceptance_length(va)
            if score > best[0]:
                best = (score, {k: v.detach().clone() for k, v in d.p.items()}, len(log) - 1)
    train_seconds = time.perf_counter() - t0
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(drafter_dir).iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    save(best[1], weights, out / "model.safetensors")
    return {"steps": steps, "train_seconds": train_seconds, "sequences": len(keep),
            "seq_len": L, "val_sequences": n_val, "kept_step": log[best[2]]["step"],
            "kept_val_acc": log[best[2]]["val_acc"], "untrained_val_acc": log[0]["val_acc"],
            "log": log}


def predicted_acceptance_length(acc: list[float]) -> float:
    """1 + a1 + a1*a2 + ...: the mean acceptance length of per-step accuracies."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train-target")
    t.add_argument("--target", type=Path, required=True)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.write_text(json.dumps(train_target(args.target, args.steps)))


if __name__ == "__main__":
    main()
