#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The trained target/drafter pairs of test_eagle3_serving.py, and its
float64 sampling reference. Runs as a child process (its own CUDA context,
so the test process starts none before vLLM spawns its engines):

    python tests/e2e/gpu/serving_pairs.py prepare --kind deepseek-v3 --work DIR
    python tests/e2e/gpu/serving_pairs.py reference --target VIEW --requests R.json --out REF.npz
    python tests/e2e/gpu/serving_pairs.py pack --work DIR --out PAIR.tgz
    python tests/e2e/gpu/serving_pairs.py unpack --tgz PAIR.tgz --work DIR

``prepare`` (production checkpoints: bf16, MLA with the published latent
geometry):

1. the target (``deepseek-v3``, or ``kimi-k25-int4``: its bf16 text model
   trained, then the routed experts packed W4A16 with the published
   quantization_config) is trained on bench_eagle3.py's skip-rule language
   (bench_eagle3.train_target);
2. its greedy continuations of bench_eagle3's 512 training prompts and the
   inputs of layers (1, 3, 6) along them are computed by transformers (the
   dequantized text view for INT4; fp64_reference.load: vLLM's routing) on
   the GPU in float32, with no vLLM engine (engine starts are what the
   suite's time goes to);
3. a drafter is trained on those states (bench_eagle3.train: k = 3,
   training-time-test unrolling): Llama-architecture for deepseek-v3, the
   MLA layout for kimi-k25-int4.

The drafter learns from transformers' layer inputs and is then served by
vLLM: its acceptance is high only if vLLM hands it the same states. The
Kimi pair's drafter is the published eagle3-mla layout (model type
kimi_k2), trained by bench_eagle3.train's loop with the MLA draft layer in
place of the Llama one (MLADrafter).
Everything lands in DIR with DIR/pair.json last (an existing pair.json is
reused).

``pack`` and ``unpack``: a prepared pair as one archive (the checkpoints
pair.json names, ~11 MB), so that a later device call skips the ~4 minutes
of preparing it; ``unpack`` into the same DIR (pair.json's paths are
absolute) rebuilds the Kimi pair's transformers view from its INT4 target.

``reference``: for each request (prompt + the tokens an engine sampled),
the target's logits at every sampled position in float64 (transformers,
the view), turned into the bins of serving_helpers.sampling_test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpu_e2e_helpers as h  # noqa: E402 - puts tools/ and tools/gpu_harness on sys.path

AUX_IDS = (1, 3, 6)
N_TRAIN = 512
GEN_TOKENS = 128
KINDS = ("deepseek-v3", "kimi-k25-int4")
# The drafters' context: the targets' YaRN length (4096 * 40), so 8k-token
# prompts are inside every model's positions.
DRAFTER_MAX_POSITIONS = 163840


def _greedy_and_aux(view: Path, prompts: list[list[int]], device: str = "cuda"):
    """transformers' greedy continuations (GEN_TOKENS) and, along prompt +
    continuation, the inputs of AUX_IDS (the output of the last layer for
    id n), concatenated: one [len, 3 * hidden] float32 tensor a sequence."""
    import torch

    import fp64_reference

    model = fp64_reference.load(view).to(device=device, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    n = model.config.num_hidden_layers
    states: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        if i in AUX_IDS:
            layer.register_forward_pre_hook(
                lambda m, a, kw, i=i: states.__setitem__(i, a[0] if a else kw["hidden_states"]),
                with_kwargs=True)
        if i + 1 == n and n in AUX_IDS:
            layer.register_forward_hook(
                lambda m, a, o: states.__setitem__(n, o[0] if isinstance(o, tuple) else o))
    by_len: dict[int, list[int]] = {}
    for j, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(j)
    seqs: list[list[int] | None] = [None] * len(prompts)
    aux: list = [None] * len(prompts)
    # torch.device: fp64_reference's router makes a tensor without a device.
    with torch.no_grad(), torch.device(device):
        for _, idx in sorted(by_len.items()):
            ids = torch.tensor([prompts[j] for j in idx], device=device)
            for _ in range(GEN_TOKENS):
                nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], dim=1)
            states.clear()
            fp64_reference.ROUTE_GAPS.clear()
            model(input_ids=ids)
            cat = torch.cat([states[k] for k in AUX_IDS], dim=-1).float().cpu()
            for r, j in enumerate(idx):
                seqs[j] = ids[r].tolist()
                aux[j] = cat[r].clone()
    return seqs, aux


# ---------------------------------------------------------------------------
# the MLA drafter, trained by bench_eagle3.train's loop
# ---------------------------------------------------------------------------


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _inv_freq(rope_dim: int, theta: float, yarn: dict | None, device):
    """DeepSeek's rotary frequencies, YaRN-interpolated as vLLM's
    DeepseekScalingRotaryEmbedding does (written out as in
    tests/models/test_deepseek_eagle3_drafter.py, whose reference step is
    checked against vLLM's drafter)."""
    import torch

    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, device=device).float() / rope_dim))
    if not yarn:
        return inv
    orig, factor = yarn["original_max_position_embeddings"], yarn["factor"]

    def dim_of(rotations: float) -> float:
        return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(yarn["beta_fast"])), 0)
    high = min(math.ceil(dim_of(yarn["beta_slow"])), rope_dim - 1)
    ramp = ((torch.arange(rope_dim // 2, device=device).float() - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def _rope_interleaved(x, pos, inv, m: float):
    """x [B, heads, L, d] (or [B, 1, L, d]), pos [B, L]: pairs (2i, 2i + 1)."""
    import torch

    ang = pos.float()[:, None, :, None] * inv  # [B, 1, L, d/2]
    cos, sin = ang.cos() * m, ang.sin() * m
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)


def mla_drafter_class():
    """training.Drafter with vLLM's Eagle3DeepseekV2 draft layer: MLA
    attention (q_a/q_b, kv_a_proj_with_mqa/kv_b, interleaved YaRN rope on
    the rope part, YaRN's softmax temperature) over [embeds, hidden], in
    place of ``qkv``; the rest (norms, chained attention, residual from the
    fused state, MLP, unrolled loss) is the Llama drafter's."""
    import torch

    from tools.gpu_harness.training import Drafter, _rms

    class MLADrafter(Drafter):
        def init_attention(self, cfg, device):
            self.nope, self.rope, self.vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
            self.kv_lora = cfg["kv_lora_rank"]
            yarn = cfg.get("rope_scaling")
            self.inv = _inv_freq(self.rope, cfg.get("rope_theta", 10000.0), yarn, device)
            self.rope_m = 1.0 if not yarn else (_yarn_mscale(yarn["factor"], yarn["mscale"])
                                                / _yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]))
            self.scale = (self.nope + self.rope) ** -0.5
            if yarn:
                self.scale *= _yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2

        def qkv(self, x, pos):
            p, a = self.p, "midlayer.self_attn."
            B, L, _ = x.shape
            q = _rms(x @ p[a + "q_a_proj.weight"].T, p[a + "q_a_layernorm.weight"], self.eps) \
                @ p[a + "q_b_proj.weight"].T
            q = q.view(B, L, self.nh, self.nope + self.rope).transpose(1, 2)
            kv_c, k_pe = (x @ p[a + "kv_a_proj_with_mqa.weight"].T).split([self.kv_lora, self.rope], dim=-1)
            kv = (_rms(kv_c, p[a + "kv_a_layernorm.weight"], self.eps) @ p[a + "kv_b_proj.weight"].T)
            k_nope, v = kv.view(B, L, self.nh, self.nope + self.vd).transpose(1, 2).split([self.nope, self.vd], -1)
            q = torch.cat([q[..., :self.nope], _rope_interleaved(q[..., self.nope:], pos, self.inv, self.rope_m)], -1)
            k_pe = _rope_interleaved(k_pe[:, None], pos, self.inv, self.rope_m).expand(B, self.nh, L, self.rope)
            return q, torch.cat([k_nope, k_pe], -1), v, self.scale

    return MLADrafter


def write_mla_drafter(path: Path, ckw: dict) -> Path:
    """The Kimi pair's MLA drafter before training: the published eagle3-mla
    layout, model type kimi_k2; its draft vocabulary is the target's (as the
    Llama drafter's: bench_eagle3.train labels with target ids)."""
    tiny = h._tiny()
    tiny.write_checkpoint("eagle3-mla-drafter", path, seed=4, model_type="kimi_k2", aux_layer_ids=AUX_IDS,
                          draft_vocab_size=tiny.VOCAB_SIZE, **ckw)
    return path


def train_mla(target, drafter_dir, seqs, prompt_lens, aux_path, out_dir, steps, device):
    """bench_eagle3.train with its Drafter replaced by the MLA draft layer."""
    from unittest import mock

    from tools.gpu_harness import training

    with mock.patch.object(training, "Drafter", mla_drafter_class()):
        return training.train(target, drafter_dir, seqs, prompt_lens, aux_path, out_dir, steps, device=device)


def prepare(kind: str, work: Path, target_steps: int, drafter_steps: int, device: str = "cuda") -> dict:
    os.environ["EAGLE3_GPU_PROFILE"] = "production"
    done = work / "pair.json"
    if done.is_file():
        return json.loads(done.read_text())
    import torch

    from tools.gpu_harness.data import rule_prompts as _prompts
    from tools.gpu_harness.training import predicted_acceptance_length, train, train_target

    work.mkdir(parents=True, exist_ok=True)
    tiny = h._tiny()
    ckw = h.checkpoint_kwargs()
    t0 = time.perf_counter()
    rec: dict = {"kind": kind, "aux_layer_ids": list(AUX_IDS)}
    if kind == "deepseek-v3":
        target = work / "deepseek_v3"
        tiny.write_checkpoint("deepseek-v3", target, seed=0, **ckw)
        rec["target_training"] = train_target(target, target_steps, device=device)
        view = target
    else:
        from tools.gpu_harness.data import published_quantization_config

        bf16, target = work / "kimi_k25_bf16", work / "kimi_k25_int4"
        tiny.write_checkpoint("kimi-k25", bf16, seed=0, **ckw)
        text = tiny.kimi_text_view(bf16, work / "kimi_k25_text")
        rec["target_training"] = train_target(text, target_steps, device=device)
        tiny.write_kimi_k25_int4(bf16, target, published_quantization_config(), text_weights=text)
        view = tiny.kimi_text_view(target, work / "kimi_k25_int4_view")
        mla_rnd = write_mla_drafter(work / "drafter_mla_random", ckw)
    rec["target_training"].pop("log", None)
    rnd, trained = work / "drafter_random", work / "drafter_trained"
    tiny.write_checkpoint("eagle3-drafter", rnd, seed=2, dtype=ckw["dtype"], aux_layer_ids=AUX_IDS,
                          draft_vocab_size=tiny.VOCAB_SIZE, max_position_embeddings=DRAFTER_MAX_POSITIONS,
                          **h.drafter_shape())
    prompts = [p["prompt_token_ids"] for p in _prompts(N_TRAIN, seed=1)]
    t1 = time.perf_counter()
    seqs, aux = _greedy_and_aux(view, prompts, device)
    torch.save({"aux": aux, "missing": [], "layer_ids": list(AUX_IDS)}, work / "aux.pt")
    rec["data_seconds"] = time.perf_counter() - t1
    if kind == "deepseek-v3":
        tr = train(target, rnd, seqs, [len(p) for p in prompts], work / "aux.pt", trained, drafter_steps,
                   device=device)
        rec["drafter_training"] = tr
        rec["drafter_trained"] = str(trained)
    else:  # the Kimi pair serves the MLA drafter only
        mla = work / "drafter_mla_trained"
        tr = train_mla(target, mla_rnd, seqs, [len(p) for p in prompts], work / "aux.pt", mla,
                       drafter_steps, device)
        rec["mla_drafter_training"] = tr
        rec["mla_drafter"] = str(mla)
    tr.pop("log", None)
    tr["predicted_acceptance_length"] = predicted_acceptance_length(tr["kept_val_acc"])
    rec.update(target=str(target), view=str(view), drafter_random=str(rnd), seconds=time.perf_counter() - t0)
    done.write_text(json.dumps(rec, indent=1))
    return rec


def reference(view: Path, requests_path: Path, out: Path, temperature: float, top_p: float,
              n_bins: int = 3, device: str = "cuda") -> None:
    """For each run (requests_path: {run: [{prompt, tokens}, ...]}) and each
    sampled position, the float64 reference: the token's bin
    (serving_helpers.rank_bins), the bins' masses, and whether the token lies
    outside the float64 nucleus. Saved as <run>_bins, <run>_masses,
    <run>_outside in one npz."""
    import numpy as np
    import torch

    import fp64_reference
    from serving_helpers import nucleus, rank_bins

    runs = json.loads(Path(requests_path).read_text())
    model = fp64_reference.load(view).to(device=device)  # float64
    model.config._attn_implementation = "eager"
    arrays = {}
    with torch.no_grad(), torch.device(device):
        for run, reqs in runs.items():
            bins, masses, outside = [], [], 0
            for r in reqs:
                seq = r["prompt"] + r["tokens"]
                logits = model(input_ids=torch.tensor([seq], device=device)).logits[0].cpu().numpy()
                fp64_reference.ROUTE_GAPS.clear()
                for t, tok in enumerate(r["tokens"]):
                    q, keep = nucleus(logits[len(r["prompt"]) - 1 + t], temperature, top_p)
                    outside += int(not keep[tok])
                    b, m = rank_bins(q, tok, n_bins)
                    bins.append(b)
                    masses.append(m)
            arrays.update({f"{run}_bins": np.array(bins), f"{run}_masses": np.array(masses),
                           f"{run}_outside": np.array(outside)})
    np.savez(out, **arrays)


PACKED = ("target", "drafter_random", "drafter_trained", "mla_drafter")


def pack(work: Path, out: Path) -> list[str]:
    """pair.json and the checkpoints it names, but the view when it is not
    the target (unpack rebuilds it) and the training data."""
    import tarfile

    info = json.loads((work / "pair.json").read_text())
    dirs = sorted({Path(info[k]).relative_to(work) for k in PACKED if k in info})
    with tarfile.open(out, "w:gz") as t:
        t.add(work / "pair.json", "pair.json")
        for d in dirs:
            t.add(work / d, str(d))
    return [str(d) for d in dirs]


def unpack(tgz: Path, work: Path) -> dict:
    import tarfile

    with tarfile.open(tgz) as t:
        info = json.loads(t.extractfile(next(m for m in t.getmembers()
                                             if os.path.normpath(m.name) == "pair.json")).read())
        if not Path(info["target"]).resolve().is_relative_to(work.resolve()):
            raise SystemExit(f"{tgz}: its pair.json names {info['target']}; unpack it into the directory it "
                             f"was prepared in (EAGLE3_SERVING_WORK/<pair>), not {work}")
        work.mkdir(parents=True, exist_ok=True)
        t.extractall(work, filter="data")
    view = Path(info["view"])
    if not view.exists():
        h._tiny().kimi_text_view(info["target"], view)
    return info


def main(argv=None) -> None:
    global N_TRAIN, GEN_TOKENS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--kind", choices=KINDS, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--target-steps", type=int, default=400)
    p.add_argument("--drafter-steps", type=int, default=1500)
    p.add_argument("--device", default="cuda", help="cpu: a dry run (with few steps and --n-train)")
    p.add_argument("--n-train", type=int, default=N_TRAIN)
    p.add_argument("--gen-tokens", type=int, default=GEN_TOKENS)
    r = sub.add_parser("reference")
    r.add_argument("--target", type=Path, required=True, help="the target's transformers view")
    r.add_argument("--requests", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--temperature", type=float, required=True)
    r.add_argument("--top-p", type=float, required=True)
    r.add_argument("--device", default="cuda")
    k = sub.add_parser("pack")
    k.add_argument("--work", type=Path, required=True)
    k.add_argument("--out", type=Path, required=True)
    u = sub.add_parser("unpack")
    u.add_argument("--tgz", type=Path, required=True)
    u.add_argument("--work", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        print("PACKED", a.out, pack(a.work, a.out), flush=True)
    elif a.cmd == "unpack":
        print("UNPACKED", a.work, unpack(a.tgz, a.work)["kind"], flush=True)
    elif a.cmd == "prepare":
        N_TRAIN, GEN_TOKENS = a.n_train, a.gen_tokens
        rec = prepare(a.kind, a.work, a.target_steps, a.drafter_steps, a.device)
        print("PAIR", json.dumps({k: v for k, v in rec.items() if k != "drafter_training"}), flush=True)
    else:
        reference(a.target, a.requests, a.out, a.temperature, a.top_p, device=a.device)


if __name__ == "__main__":
    main()
