# SPDX-License-Identifier: Apache-2.0
"""Shared data of the GPU harness jobs: the skip-rule language the tiny
targets are trained on, the published Kimi-K2.5 quantization config, and
checkpoint views (a DSA target as transformers' DeepSeek-V3, a drafter with
other aux ids). Imports no other harness module."""

from __future__ import annotations

import json
import random
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
K = 3  # draft tokens per step (num_speculative_tokens)
RULE_SEED = 7
RULE_NOISE = 0.15
TARGET_SEQ_LEN = 96
PUBLISHED_KIMI = (REPO_ROOT / "tests" / "v1" / "spec_decode" / "published_configs"
                  / "moonshotai-kimi-k25-target" / "config.json")


def skip_rule(seed: int = RULE_SEED) -> list[int]:
    f = list(range(256))
    random.Random(seed).shuffle(f)
    return f


def rule_sequence(rng: random.Random, f: list[int], n: int, noise: float = RULE_NOISE) -> list[int]:
    s = [rng.randrange(256), rng.randrange(256)]
    while len(s) < n:
        s.append(rng.randrange(256) if rng.random() < noise else f[s[-2]])
    return s


def rule_prompts(n, seed, lo=8, hi=24):
    """``n`` prompts of the skip-rule language, 8-24 tokens, as vLLM takes token ids."""
    rng, f = random.Random(seed), skip_rule()
    return [{"prompt_token_ids": rule_sequence(rng, f, rng.randint(lo, hi))} for _ in range(n)]


def published_quantization_config() -> dict:
    """Kimi-K2.5's quantization_config as published (it sits in text_config)."""
    return json.loads(PUBLISHED_KIMI.read_text())["text_config"]["quantization_config"]


def dense_view(target: Path) -> Path:
    """The checkpoint as transformers' DeepseekV3ForCausalLM reads it: a
    directory with the config's model type changed and the other files linked."""
    import tempfile

    cfg = json.loads((target / "config.json").read_text())
    if cfg["model_type"] == "deepseek_v3":
        return target
    view = Path(tempfile.mkdtemp(prefix="dense_view_"))
    (view / "config.json").write_text(json.dumps(
        dict(cfg, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])))
    for f in target.iterdir():
        if f.name != "config.json":
            (view / f.name).symlink_to(f.resolve())
    return view


def with_aux_ids(trained: Path, out: Path, ids) -> Path:
    """The trained drafter with its aux layer ids replaced (same weights)."""
    import shutil

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(trained, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = list(ids)
    cfg.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = list(ids)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
