"""Make the drafter example of docs/vllm-eagle3.md: a tiny DeepSeek-V3 target and an
EAGLE-3 drafter trained on the target's own greedy outputs (CPU build).

    python -m tools.eagle3_example DIR [--steps 150]

DIR/tiny-target    tools/tiny_checkpoints.py's seeded DeepSeek-V3 (6 layers)
DIR/tiny-drafter   trained on the states vLLM captures as ids 2, 4, 6 (the
                   inputs of layers 2, 4, 6 = the outputs of layers 1, 3, 5),
                   with a config that says [1, 3, 5] nested in eagle_config,
                   the way SpecForge numbers and writes them
DIR/prompts.txt    the 32 prompts it was trained on (and is measured on)

then, with the vllm-eagle3 command of the same environment:

    vllm-eagle3 check DIR/tiny-drafter --target DIR/tiny-target
    vllm-eagle3 calibrate DIR/tiny-drafter --target DIR/tiny-target \\
        --prompts DIR/prompts.txt --max-tokens 48 --write

The states come from one run of vLLM's CPU engine (calibrate's capture); the
drafter is trained with the GPU harness's pure-torch EAGLE-3 drafter
(tools/gpu_harness/training.py: k = 3 unrolled, 150 steps), on CPU. The
drafter memorises the target's continuations of these prompts: enough to
tell the right layers from their neighbours, not a drafter that generalises.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from tools import tiny_checkpoints
from tools._common import REPO_ROOT, StackError, parser, run_main, say
from tools.vllm_eagle3._base import children_never_shadowed, drop_source_trees_from_path

TOOL = "eagle3_example"
TRAINED_ON = (2, 4, 6)  # vLLM ids: inputs of layers 2, 4, 6
CONFIG_SAYS = (1, 3, 5)  # the same states counted as layer outputs
MAX_TOKENS = 48
TOP = "eagle_aux_hidden_state_layer_ids"


def prompts(n: int = 32, seed: int = 1) -> list[str]:
    rng, chars = random.Random(seed), "abcdefghijklmnopqrstuvwxyz ,.0123456789"
    return ["".join(rng.choice(chars) for _ in range(rng.randint(8, 20))) for _ in range(n)]


def capture(target: Path, texts: list[str], layers: tuple[int, ...]) -> list[dict]:
    """Per prompt: tokens (prompt + greedy output), prompt length, and the
    state vLLM captures at each of ``layers`` for every token fed."""
    from vllm import SamplingParams

    from tools.vllm_eagle3.fit import CPU_ENV, _engine, _env, _rows, _worker_capture

    kwargs = {"model": str(target), "seed": 0, "enforce_eager": True, "max_model_len": 1024,
              "dtype": "float32", "enable_prefix_caching": False, "max_num_seqs": len(texts),
              "compilation_config": {"custom_ops": ["-rotary_embedding"]}}
    with _env(**CPU_ENV), _engine(**kwargs) as llm:
        llm.collective_rpc(_worker_capture, args=(layers,))
        outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True), use_tqdm=False)
        log = llm.collective_rpc(lambda worker: worker.eagle3_calibrate_log)[0]
        return _rows(log, [list(o.prompt_token_ids) for o in outs],
                     [list(o.outputs[0].token_ids) for o in outs])


def train(root: Path, target: Path, seqs: list[dict], steps: int) -> Path:
    import torch
    from safetensors.torch import load_file

    from tools.gpu_harness import training

    d = tiny_checkpoints.write_checkpoint(
        "eagle3-drafter", root / "tiny-drafter", seed=3, aux_layer_ids=CONFIG_SAYS,
        draft_vocab_size=tiny_checkpoints.VOCAB_SIZE).outdir
    cfg = json.loads((d / "config.json").read_text())
    del cfg[TOP]  # SpecForge keeps them in eagle_config only
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    weights = load_file(str(d / "model.safetensors"))
    embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    drafter = training.Drafter(cfg, weights, embed, "cpu")
    n = min(len(s["tokens"]) for s in seqs) - 1
    toks = torch.stack([s["tokens"][:n] for s in seqs])
    aux = torch.stack([torch.cat([a[:n] for a in s["aux"]], -1).float() for s in seqs])
    mask = torch.zeros_like(toks)
    for row, s in enumerate(seqs):
        mask[row, s["prompt_len"]:] = 1
    training.fit(drafter, toks, aux, mask, steps)
    training.save(drafter.p, weights, d / "model.safetensors")
    return d


def make(root: Path, steps: int = 150) -> dict[str, Path]:
    root = Path(root)
    if root.exists() and any(root.iterdir()):
        raise StackError(f"{root} is not empty: name a new directory")
    t0 = time.monotonic()
    target = tiny_checkpoints.write_checkpoint("deepseek-v3", root / "tiny-target", seed=0).outdir
    texts = prompts()
    (root / "prompts.txt").write_text("\n".join(texts) + "\n")
    seqs = capture(target, texts, TRAINED_ON)
    say(TOOL, f"captured ids {list(TRAINED_ON)} over {len(seqs)} prompts "
        f"({time.monotonic() - t0:.0f} s)")
    drafter = train(root, target, seqs, steps)
    say(TOOL, f"trained {drafter} ({steps} steps; {time.monotonic() - t0:.0f} s in all)")
    return {"target": target, "drafter": drafter, "prompts": root / "prompts.txt"}


def main() -> int:
    ap = parser(TOOL, __doc__)
    ap.add_argument("dir", type=Path, metavar="DIR")
    ap.add_argument("--steps", type=int, default=150, help="training steps (default 150)")
    args = ap.parse_args()
    # `python -m` put the repo root, and its unpatched vllm/, first on sys.path.
    drop_source_trees_from_path(REPO_ROOT)
    with children_never_shadowed():
        made = make(args.dir, args.steps)
    print("\n".join(f"{k}: {v}" for k, v in made.items()))
    return 0


if __name__ == "__main__":
    run_main(TOOL, main)
