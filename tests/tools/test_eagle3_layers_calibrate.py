# SPDX-License-Identifier: Apache-2.0
"""`python -m tools.eagle3_layers calibrate` on the real CPU engine.

A tiny DeepSeek-V3 target (tools/tiny_checkpoints.py) continues 32 prompts
greedily in vLLM; transformers' own DeepseekV3 gives the input of every layer
for those tokens (the CPU end-to-end tests show vLLM's aux id k captures
exactly that). Two drafters are trained on them whose configs both say
[1, 3, 5]: one on the inputs of layers 1, 3, 5 (vLLM's numbering), one on the
inputs of 2, 4, 6 = the outputs of layers 1, 3, 5 (SpecForge's numbering,
kept nested as SpecForge writes it). The tool must name each, and an
untrained drafter must come out undetermined. The replay's numbers for both
readings equal those of chained drafting computed without vLLM (the GPU
benchmark's unrolled pure-torch drafter on transformers' states). The
drafters are trained and
measured on the same prompts: they memorise the target's continuations,
which is enough to tell the right layers from their neighbours, not a claim
that they generalise.
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tools import eagle3_layers, tiny_checkpoints
from tools._common import REPO_ROOT
from tools.vllm_eagle3._base import CONVERTED
from tools.vllm_eagle3._base import ToolError as StackError
from tools.vllm_eagle3.fit import K, Acceptance, verdict

TOP = "eagle_aux_hidden_state_layer_ids"
HARNESS = "eagle3_e2e_cpu_harness"  # the name its worker class resolves by
MAX_TOKENS = 48


def _harness() -> Any:
    if HARNESS not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            HARNESS, REPO_ROOT / "tests" / "e2e" / "cpu" / "_eagle3_cpu_harness.py")
        sys.modules[HARNESS] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[HARNESS])
    return sys.modules[HARNESS]


def _bench() -> Any:
    """tools/gpu_harness/training.py: its pure-torch drafter (the math of
    vLLM's Llama EAGLE-3 drafter) trains the drafters; the tool never uses it."""
    from tools.gpu_harness import training

    return training


def _texts(n: int, seed: int) -> list[str]:
    rng, chars = random.Random(seed), "abcdefghijklmnopqrstuvwxyz ,.0123456789"
    return ["".join(rng.choice(chars) for _ in range(rng.randint(8, 20))) for _ in range(n)]


def _train(root: Path, name: str, states: list[dict[int, torch.Tensor]], seqs: list[list[int]],
           prompt_lens: list[int], layers: tuple[int, ...], nested: bool,
           steps: int = 150) -> Path:
    """A tiny drafter (config ids [1, 3, 5]) trained on ``layers``' states
    with the GPU benchmark's training loop (k = 3 unrolled, pure torch)."""
    from safetensors.torch import load_file

    bench = _bench()

    d = tiny_checkpoints.write_checkpoint(
        "eagle3-drafter", root / name, seed=3, aux_layer_ids=(1, 3, 5),
        draft_vocab_size=tiny_checkpoints.VOCAB_SIZE).outdir
    cfg = json.loads((d / "config.json").read_text())
    if nested:
        del cfg[TOP]
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = load_file(str(d / "model.safetensors"))
    embed = load_file(str(root / "target" / "model.safetensors"))["model.embed_tokens.weight"]
    drafter = bench.Drafter(cfg, weights, embed, "cpu")
    n = min(len(s) for s in seqs) - 1
    toks = torch.tensor([s[:n] for s in seqs])
    aux = torch.stack([torch.cat([st[k][:n] for k in layers], -1) for st in states])
    mask = torch.zeros_like(toks)
    for row, p in enumerate(prompt_lens):
        mask[row, p:] = 1
    bench.fit(drafter, toks, aux, mask, steps)
    bench.save(drafter.p, weights, d / "model.safetensors")
    return d


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vllm import SamplingParams

    h = _harness()
    root = tmp_path_factory.mktemp("calibrate")
    target = tiny_checkpoints.write_checkpoint("deepseek-v3", root / "target", seed=0).outdir
    prompts = _texts(32, seed=1)
    (root / "prompts.txt").write_text("\n".join(prompts) + "\n")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in h.ENGINE_ENV.items():
            mp.setenv(key, value)
        kwargs = h.engine_kwargs(target, record=False, max_num_batched_tokens=2048,
                                 max_num_seqs=32)
        with h.running_engine(**kwargs) as llm:
            outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                        ignore_eos=True), use_tqdm=False)
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    lens = [len(o.prompt_token_ids) for o in outs]
    hf = h.load_hf_reference(target)
    states = [h.hf_states(hf, s[:-1]).by_id for s in seqs]  # by_id[k]: input of layer k
    del hf
    return {
        "root": root, "target": target, "prompts": root / "prompts.txt",
        "seqs": seqs, "prompt_lens": lens, "states": states,
        "input-of-layer": _train(root, "trained_on_1_3_5", states, seqs, lens, (1, 3, 5), False),
        "output-of-layer": _train(root, "trained_on_2_4_6", states, seqs, lens, (2, 4, 6), True),
        "random": tiny_checkpoints.write_checkpoint(
            "eagle3-drafter", root / "random", seed=5, aux_layer_ids=(1, 3, 5),
            draft_vocab_size=tiny_checkpoints.VOCAB_SIZE).outdir,
    }


def unrolled_acceptance(s: dict[str, Any], drafter: Path, layers: tuple[int, ...]
                        ) -> tuple[int, float]:
    """(drafts, mean acceptance length) of greedy k = 3 drafting computed
    without vLLM: the GPU benchmark's pure-torch drafter, unrolled as in
    training (step j of slot i attends to step 1 of slots <= i and to its own
    earlier steps, the KV cache chained drafting builds), on transformers'
    states. Given steps < j accepted, step j's input tokens are the target's,
    so its prediction is the draft; the engine's path then follows."""
    from safetensors.torch import load_file

    bench = _bench()
    cfg = json.loads((drafter / "config.json").read_text())
    embed = load_file(str(s["target"] / "model.safetensors"))["model.embed_tokens.weight"]
    d = bench.Drafter(cfg, load_file(str(drafter / "model.safetensors")), embed, "cpu")
    drafts = accepted = 0
    for seq, p, st in zip(s["seqs"], s["prompt_lens"], s["states"]):
        n = len(seq) - 1
        toks = torch.tensor([seq[:n]])
        hidden = torch.cat([st[k][:n] for k in layers], -1)[None] @ d.p["fc.weight"].T
        pos = torch.arange(n)[None]
        hits, first, chain = [], None, []
        with torch.no_grad():
            for j in range(1, K + 1):  # slot i, step j: token i + j at position i + j - 1
                tok = torch.nn.functional.pad(toks[:, j:], (0, j))
                pre, logits, kk, vv = d.layer(tok, hidden, pos + j - 1, first, chain)
                label = torch.tensor(seq[j + 1:] + [-1] * j)[:n]
                hits.append((logits[0].argmax(-1) == label).tolist())
                if j == 1:
                    first = (kk, vv)
                else:
                    chain.append((kk, vv))
                hidden = pre
        t = p - 1
        while t + 1 + K < len(seq):
            a = next((j for j in range(K) if not hits[j][t]), K)
            drafts, accepted, t = drafts + 1, accepted + a, t + a + 1
    return drafts, 1 + accepted / drafts


def calibrate(capfd: pytest.CaptureFixture[str], s: dict[str, Path], drafter: Path,
              *extra: str, status: int = 0) -> str:
    code = eagle3_layers.main(["calibrate", str(drafter), "--target", str(s["target"]),
                               "--prompts", str(s["prompts"]), "--max-tokens", str(MAX_TOKENS),
                               *extra])
    out = capfd.readouterr()
    assert code == status, out.out
    # tqdm's bar on stderr: progress during the minutes a real target takes.
    assert "calibrate: replaying drafts" in out.err
    return out.out


def _mean(out: str, reading: str) -> float:
    line = next(x for x in out.splitlines() if x.strip().startswith(f"{reading} [")
                and "mean acceptance length" in x)
    return float(line.split("mean acceptance length ")[1].split()[0])


def test_calibrate_names_the_input_of_layer_drafter(setup: dict[str, Path],
                                                    capfd: pytest.CaptureFixture[str]) -> None:
    d = setup["input-of-layer"]
    before = (d / "config.json").read_bytes()
    out = calibrate(capfd, setup, d)
    print(out)
    assert "aux ids [1, 3, 5] from top-level eagle_aux_hidden_state_layer_ids" in out
    assert " input-of-layer [1, 3, 5]: mean acceptance length " in out
    assert "output-of-layer [2, 4, 6]: mean acceptance length " in out
    assert "accepted at position 1..3: " in out
    assert _mean(out, "input-of-layer") > _mean(out, "output-of-layer")
    assert out.rstrip().endswith("verdict: input-of-layer")
    # The replay is EAGLE's chained drafting: an implementation without vLLM,
    # on transformers' states, gets the same drafts.
    for label, layers in ((" input-of-layer [1, 3, 5]", (1, 3, 5)),
                          ("output-of-layer [2, 4, 6]", (2, 4, 6))):
        drafts, mean = unrolled_acceptance(setup, d, layers)
        line = next(x for x in out.splitlines() if x.startswith(f"{label}: mean"))
        assert f"length {mean:.2f} over {drafts} drafts" in line, (line, drafts, mean)
    assert (d / "config.json").read_bytes() == before  # nothing written without --write


def test_calibrate_names_the_output_of_layer_drafter_and_writes(
        setup: dict[str, Path], capfd: pytest.CaptureFixture[str]) -> None:
    d = setup["root"] / "out_copy"
    shutil.copytree(setup["output-of-layer"], d)
    before = (d / "config.json").read_bytes()
    out = calibrate(capfd, setup, d, "--write")
    print(out)
    assert "from nested eagle_config.eagle_aux_hidden_state_layer_ids" in out
    assert _mean(out, "output-of-layer") > _mean(out, "input-of-layer")
    assert "verdict: output-of-layer" in out
    new = json.loads((d / "config.json").read_text())
    assert new[TOP] == new["eagle_config"][TOP] == [2, 4, 6]
    assert (d / "config.json.orig").read_bytes() == before
    assert f"{d / 'config.json'}: {TOP} = [2, 4, 6]" in out


def test_random_drafter_is_undetermined(setup: dict[str, Path],
                                        capfd: pytest.CaptureFixture[str]) -> None:
    d = setup["random"]
    before = (d / "config.json").read_bytes()
    out = calibrate(capfd, setup, d, "--json", status=1)  # 1: undetermined
    # In this process vLLM logged to stdout before the command could send its
    # logs to stderr (the command's own process does: test_vllm_eagle3_wheel).
    data = json.loads(out[out.index("{\n  \"drafter\""):])
    print(data)
    assert data["verdict"] == "undetermined"
    means = {r["reading"]: r["mean_acceptance_length"] for r in data["readings"]}
    assert means["input-of-layer"] < 1.2 and means["output-of-layer"] < 1.2
    assert abs(data["margin"]) < data["needed"]
    assert (d / "config.json").read_bytes() == before


def test_undetermined_write_refuses(setup: dict[str, Path],
                                    capfd: pytest.CaptureFixture[str]) -> None:
    """An undetermined verdict with --write prints its lines and "nothing
    written", writes nothing, and exits 1, as `calibrate` documents for
    undetermined."""
    d = setup["random"]
    before = (d / "config.json").read_bytes()
    msg = calibrate(capfd, setup, d, "--write", status=1)
    assert "verdict: undetermined" in msg and "nothing written" in msg
    assert (d / "config.json").read_bytes() == before
    assert not (d / "config.json.orig").exists()


def test_candidates_find_a_drafter_trained_on_other_layers(
        setup: dict[str, Path], capfd: pytest.CaptureFixture[str]) -> None:
    """The drafter trained on the inputs of layers 2, 4, 6, with a config that
    names [1, 2, 3]: neither built-in reading ([1, 2, 3], [2, 3, 4]) is right;
    a --candidates reading is, and --write writes it."""
    d = setup["root"] / "wrong_ids"
    shutil.copytree(setup["output-of-layer"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eagle_config"][TOP] = [1, 2, 3]
    (d / "config.json").write_text(json.dumps(cfg))
    out = calibrate(capfd, setup, d, "--candidates", "1,3,5;2,4,6", "--write")
    print(out)
    for label in ("input-of-layer [1, 2, 3]", "output-of-layer [2, 3, 4]",
                  "ids 1,3,5 [1, 3, 5]", "ids 2,4,6 [2, 4, 6]"):
        assert any(x.strip().startswith(label + ": mean") for x in out.splitlines()), label
    best = _mean(out, "ids 2,4,6")
    others = [_mean(out, r) for r in ("input-of-layer", "output-of-layer", "ids 1,3,5")]
    assert best > max(others)
    margin = next(x for x in out.splitlines() if x.startswith("margin rule: "))
    assert margin.startswith("margin rule: ids 2,4,6 beats "), margin
    assert "verdict: ids 2,4,6" in out
    new = json.loads((d / "config.json").read_text())
    assert new[TOP] == new["eagle_config"][TOP] == [2, 4, 6]
    assert new[CONVERTED] == {"from": "calibrate --candidates", "trained_ids": [1, 2, 3]}
    assert json.loads((d / "config.json.orig").read_text()) == cfg


@pytest.mark.parametrize("a, b, want", [
    # (drafts, per-position accepted counts) for input-of-layer, output-of-layer
    ((100, [90, 80, 70]), (100, [50, 30, 10]), "input-of-layer"),
    ((100, [50, 30, 10]), (100, [90, 80, 70]), "output-of-layer"),
    ((100, [50, 30, 10]), (100, [52, 31, 10]), "undetermined"),  # inside the margin
    ((4, [3, 1, 0]), (4, [2, 1, 0]), "undetermined"),  # too few drafts for 3 SE
    ((100, [1, 0, 0]), (100, [0, 0, 0]), "undetermined"),  # both barely accept
    ((100, [90, 80, 70]), None, "input-of-layer"),  # the other reading is not capturable
    ((100, [1, 0, 0]), None, "undetermined"),  # ... and this one does not beat nothing
])
def test_margin_rule(a: tuple, b: tuple | None, want: str) -> None:
    res = {"input-of-layer": Acceptance(*a), "output-of-layer": b and Acceptance(*b)}
    assert len(a[1]) == K
    assert verdict(res)[0] == want


def test_margin_rule_compares_the_best_with_the_runner_up() -> None:
    far, near, best = Acceptance(100, [10, 5, 0]), Acceptance(100, [88, 78, 70]), \
        Acceptance(100, [90, 80, 70])
    # The best of three beats the worst by far, the runner-up by too little.
    assert verdict({"input-of-layer": far, "output-of-layer": near, "ids 1,2,3": best}) == (
        "undetermined", "ids 1,2,3 beats output-of-layer by 0.04 in mean acceptance length, "
        f"needed {max(0.05, 3 * ((near.variance() + best.variance()) / 100) ** 0.5):.2f}")
    assert verdict({"input-of-layer": far, "ids 1,2,3": best})[0] == "ids 1,2,3"


def test_acceptance_statistics() -> None:
    acc = Acceptance(4, [3, 2, 1])  # accepted 0, 1, 2, 3 once each
    assert acc.mean_length() == 2.5
    assert abs(acc.variance() - 5 / 3) < 1e-12


def test_prompts_file_must_hold_prompts(tmp_path: Path) -> None:
    d = tiny_checkpoints.write_checkpoint("eagle3-drafter", tmp_path / "d").outdir
    t = tiny_checkpoints.write_checkpoint("deepseek-v3", tmp_path / "t").outdir
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(StackError, match="holds no prompt"):
        eagle3_layers.main(["calibrate", str(d), "--target", str(t), "--prompts",
                            str(tmp_path / "empty.txt")])
