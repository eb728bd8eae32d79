# SPDX-License-Identifier: Apache-2.0
"""EAGLE-3 aux capture under tensor and pipeline parallelism on the real vLLM
v0.16.0 CPU engine. With world size 2 or 4 vLLM's MultiprocExecutor spawns
one worker process per rank (gloo and shared-memory all-reduce, as
``vllm serve --tensor-parallel-size N`` on CPU); ``collective_rpc`` brings
back every rank's recording.

TP = 2 and TP = 4 (the tiny target's 4 heads, the largest split it takes;
about 3 minutes on 2 cores): every rank captures, per step and id, the full [tokens, hidden] state
(not a TP or token shard), bitwise equal across ranks and equal to TP = 1
within the DeepSeek-V3 tolerance; greedy tokens equal TP = 1. v0.16.0 turns
sequence-parallel MoE on only with EP and DP > 1 (4 ranks, not on 2 cores):
the test records that it is off.

PP = 2 runs on this engine (a regression control), but EAGLE-3 is refused
twice: first by vLLM while building SpeculativeConfig (no v0.16.0 EAGLE-3
drafter is SupportsPP; what a user sees, stock and patched); past that
(``DRAFT_PP_KEY``), by the series' own refusal in the model's
``set_aux_hidden_state_layers`` on the real PP = 2 process groups.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.e2e

# Byte-level tokenizer: 3, 38 and 66 tokens against a 16-token step budget.
PROMPTS = [
    "Hi",
    "EAGLE-3 drafts tokens; the target v3.",
    "DeepSeek-V3 routes each token to experts chosen by a biased gate.",
]
MAX_TOKENS = 8
STEP_TOKEN_BUDGET = 16
ATOL = 2e-4  # test_eagle3_cpu_targets.py's (vLLM CPU vs HF, float32)
MIN_MARGIN = 100.0  # neighbouring-layer gap / ATOL, on every token
MP = {"distributed_executor_backend": "mp"}


@pytest.fixture(scope="module")
def worker_processes(harness: ModuleType, tmp_path_factory: pytest.TempPathFactory):
    """The CPU platform spawns workers ("mp", "spawn"), which resolve
    worker_cls by name through the parent's sys.path: a directory with the
    harness under its module name goes there. Each rank gets a CPU of its own
    (the default binding wants a NUMA node per rank). TORCHDYNAMO_DISABLE:
    with TP > 1 the embedding masks token ids with a torch.compile'd integer
    function whose inductor build costs 10-30 s per engine on 2 cores."""
    import_dir = tmp_path_factory.mktemp("worker_import")
    (import_dir / f"{harness.HARNESS_MODULE}.py").symlink_to(Path(harness.__file__))
    cpus = sorted(os.sched_getaffinity(0))
    env = {"TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    if len(cpus) >= 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"{cpus[0]}|{cpus[1]}"
    else:
        env["OMP_NUM_THREADS"] = "1"
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(import_dir))
        for key, value in env.items():
            mp.setenv(key, value)
        yield


def _run(harness: ModuleType, tiny_ckpts: dict, draft: Any, **kw: Any) -> dict:
    return harness.run_prompts(
        tiny_ckpts["dsv3"], draft, PROMPTS,
        max_tokens=MAX_TOKENS, step_budget=STEP_TOKEN_BUDGET, **kw,
    )


@pytest.fixture(scope="module")
def tp1(harness: ModuleType, tiny_ckpts: dict[str, Any]) -> dict[str, Any]:
    return _run(harness, tiny_ckpts, tiny_ckpts["draft_all_ids"])


@pytest.fixture(scope="module")
def tp2(harness: ModuleType, tiny_ckpts: dict[str, Any], worker_processes: Any) -> dict:
    draft = tiny_ckpts["draft_all_ids"]
    return _run(harness, tiny_ckpts, draft, tensor_parallel_size=2, **MP)


@pytest.fixture(scope="module")
def tp4(harness: ModuleType, tiny_ckpts: dict[str, Any], worker_processes: Any) -> dict:
    """TP = 4, the largest world the tiny target splits over (4 attention
    heads), on 2 cores: four worker processes, one OpenMP thread each, left
    unbound (the default binding wants a core per rank)."""
    draft = tiny_ckpts["draft_all_ids"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        mp.setenv("OMP_NUM_THREADS", "1")
        return _run(harness, tiny_ckpts, draft, tensor_parallel_size=4, **MP)


def test_tp2_aux_states_full_identical_on_ranks_and_equal_to_tp1(
    harness: ModuleType, tiny_ckpts: dict[str, Any], tp1: dict[str, Any],
    tp2: dict[str, Any], record_property: Any,
) -> None:
    _check_tp_aux(harness, tiny_ckpts, tp1, tp2, 2, record_property)


def test_tp4_aux_states_full_identical_on_ranks_and_equal_to_tp1(
    harness: ModuleType, tiny_ckpts: dict[str, Any], tp1: dict[str, Any],
    tp4: dict[str, Any], record_property: Any,
) -> None:
    _check_tp_aux(harness, tiny_ckpts, tp1, tp4, 4, record_property)


def test_tp4_greedy_equals_tp1(
    harness: ModuleType, tp1: dict[str, Any], tp4: dict[str, Any]
) -> None:
    assert tp4["prompt_ids"] == tp1["prompt_ids"]
    for got, want in zip(tp4["output_ids"], tp1["output_ids"], strict=True):
        assert got == want


def _check_tp_aux(
    harness: ModuleType, tiny_ckpts: dict[str, Any], tp1: dict[str, Any],
    tpn: dict[str, Any], size: int, record_property: Any,
) -> None:
    config = json.loads((Path(tiny_ckpts["dsv3"]) / "config.json").read_text())
    n_layers = config["num_hidden_layers"]
    assert n_layers == tiny_ckpts["dsv3_layers"]
    ids = tuple(range(n_layers + 1))
    hidden = config["hidden_size"]
    n_moe = n_layers - config["first_k_dense_replace"]

    # One real worker process per TP rank, one pipeline stage.
    info = tpn["parallel_info"]
    layout = [(i["rank"], i["tp_rank"], i["tp_size"], i["pp_size"]) for i in info]
    assert layout == [(r, r, size, 1) for r in range(size)], info
    pids = {i["pid"] for i in info}
    assert len(pids) == size and os.getpid() not in pids, info
    # Sequence-parallel MoE off in every MoE block (the first
    # first_k_dense_replace layers are dense).
    assert n_moe > 0
    assert all(i["moe_sequence_parallel"] == [False] * n_moe for i in info), info
    assert tp1["parallel_info"][0]["tp_size"] == 1

    rep0, *others = tpn["reports"]
    assert len(others) == size - 1
    for rep in (rep0, *others, tp1["reports"][0]):
        assert rep["model_class"] == "DeepseekV3ForCausalLM"
        assert rep["use_aux_hidden_state_outputs"] is True
        assert rep["setup"].source == "draft config"
        assert rep["setup"].aux_layers == ids

    # Same steps on the same tokens on every rank; every state is the full
    # [scheduled tokens, hidden] tensor, bitwise equal across ranks.
    steps = [s for rep in others for s in zip(rep0["steps"], rep["steps"], strict=True)]
    assert rep0["steps"] and len(steps) == (size - 1) * len(rep0["steps"])
    for s0, s1 in steps:
        assert s0["req_ids"] == s1["req_ids"]
        assert s0["num_scheduled"] == s1["num_scheduled"]
        assert torch.equal(s0["input_ids"], s1["input_ids"])
        n = sum(s0["num_scheduled"])
        for a0, a1 in zip(s0["aux"], s1["aux"], strict=True):
            assert a0.shape == a1.shape == (n, hidden), (a0.shape, n)
            assert torch.equal(a0, a1), "aux states differ between TP ranks"
        assert len(s0["aux"]) == len(ids)

    # Per request against TP = 1 (same tokens fed: greedy outputs agree).
    max_diff, min_gap = 0.0, float("inf")
    for r1, r2 in zip(harness.run_rows(tp1), harness.run_rows(tpn), strict=True):
        assert torch.equal(r1.input_ids, r2.input_ids)
        for k, (a1, a2) in enumerate(zip(r1.aux, r2.aux, strict=True)):
            assert a1.shape == a2.shape == (r1.input_ids.shape[0], hidden)
            max_diff = max(max_diff, (a1 - a2).abs().max().item())
            # The tolerance must not let an off-by-one layer pass.
            for j in (k - 1, k + 1):
                if 0 <= j < len(ids):
                    gap = (a1 - r1.aux[j]).abs().amax(dim=-1).min().item()
                    min_gap = min(min_gap, gap)
    record_property(f"max_abs_diff_tp1_tp{size}", max_diff)
    record_property(f"min_neighbour_gap_tp{size}", min_gap)
    record_property(f"tp{size}_engine_start_s", tpn["start_s"])
    print(
        f"\nTP={size} vs TP=1 aux: max |diff| {max_diff:.3g} (ATOL {ATOL}), "
        f"min neighbour gap {min_gap:.3g}; TP={size} engine start {tpn['start_s']:.1f} s, "
        f"run {tpn['total_s']:.1f} s; TP=1 run {tp1['total_s']:.1f} s"
    )
    assert max_diff <= ATOL, max_diff
    assert min_gap >= MIN_MARGIN * ATOL, min_gap


def test_tp2_greedy_equals_tp1(
    harness: ModuleType, tp1: dict[str, Any], tp2: dict[str, Any]
) -> None:
    assert tp2["prompt_ids"] == tp1["prompt_ids"]
    for got, want in zip(tp2["output_ids"], tp1["output_ids"], strict=True):
        assert len(got) == MAX_TOKENS
        assert got == want
    harness.assert_chunked_prefill_and_decode(tp2, STEP_TOKEN_BUDGET, MAX_TOKENS)


@pytest.mark.regression
def test_pp2_runs_on_the_cpu_engine_without_eagle3(
    harness: ModuleType, tiny_ckpts: dict[str, Any], worker_processes: Any
) -> None:
    """The control for the PP refusals below: PP = 2 (two stages, one process
    each) generates the reference model's greedy tokens."""
    run = _run(harness, tiny_ckpts, None, pipeline_parallel_size=2, **MP)
    info = run["parallel_info"]
    layout = [(i["rank"], i["pp_rank"], i["pp_size"], i["tp_size"]) for i in info]
    assert layout == [(0, 0, 2, 1), (1, 1, 2, 1)], info
    for rep in run["reports"]:
        assert rep["setup"] is None and rep["use_aux_hidden_state_outputs"] is False
    # Only the last stage produces hidden states for sampling (and would hand
    # aux states to a drafter); the first returns intermediate tensors.
    first, last = run["reports"]
    assert not first["steps"] and last["steps"]
    assert all(s["aux"] is None for s in last["steps"])

    hf_model = harness.load_hf_reference(Path(tiny_ckpts["dsv3"]))
    checked = 0
    for prompt, output in zip(run["prompt_ids"], run["output_ids"]):
        assert len(output) == MAX_TOKENS
        logits = harness.hf_states(hf_model, prompt + output[:-1]).logits
        c, mismatches = harness.greedy_vs_hf(logits[len(prompt) - 1 :], output)
        assert mismatches == 0, (prompt, output)
        checked += c
    assert checked >= 0.9 * len(PROMPTS) * MAX_TOKENS, checked


def test_pp2_eagle3_refused_at_config_time_naming_the_fix(
    harness: ModuleType, tiny_ckpts: dict[str, Any], worker_processes: Any
) -> None:
    """EAGLE-3 with PP = 2 is refused while the config is built, before any
    worker, by an EAGLE-3 message that names the fix (v0.16.0 said only
    "Pipeline parallelism is not supported for this model")."""
    from vllm import LLM

    kwargs = harness.engine_kwargs(
        tiny_ckpts["dsv3"], record=False, pipeline_parallel_size=2, **MP,
        speculative_config={
            "method": "eagle3", "model": str(tiny_ckpts["draft_all_ids"]),
            "num_speculative_tokens": 3,
        },
    )
    llm = None
    with pytest.raises(ValueError) as excinfo:
        llm = LLM(**kwargs)
    assert llm is None
    msg = str(excinfo.value)
    assert "EAGLE-3" in msg and "pipeline_parallel_size=2" in msg, msg
    assert "--pipeline-parallel-size 1" in msg, msg
    frames = [entry.name for entry in excinfo.traceback]
    assert "create_speculative_config" in frames, frames


def test_pp2_aux_capture_refused_at_engine_start(
    harness: ModuleType, tiny_ckpts: dict[str, Any], worker_processes: Any,
    tmp_path: Path,
) -> None:
    error_dir = tmp_path / "worker_errors"
    kwargs = harness.engine_kwargs(
        tiny_ckpts["dsv3"], draft=tiny_ckpts["draft_all_ids"],
        pipeline_parallel_size=2, **MP,
    )
    kwargs["additional_config"].update(
        {harness.ERROR_DIR_KEY: str(error_dir), harness.DRAFT_PP_KEY: 1}
    )
    started = False
    with pytest.raises(Exception) as excinfo, harness.running_engine(**kwargs):
        started = True
    assert not started, "the engine started; the error came later"
    assert "WorkerProc initialization failed" in str(excinfo.value), excinfo.value

    # The model's own refusal, in the workers. Both stages refuse; the
    # executor may stop the slower one before it writes, so at least one
    # rank, and every rank that wrote, must show it.
    errors = [json.loads(p.read_text()) for p in error_dir.glob("rank*.json")]
    assert errors, f"no worker wrote its error to {error_dir}"
    for err in errors:
        msg = err["message"]
        assert err["type"] == "ValueError", err
        assert "pipeline_parallel_size=2" in msg, err
        assert "EAGLE-3" in msg, err
        assert "DeepseekV3ForCausalLM" in msg, err
        assert "pipeline_parallel_size=1" in msg, err  # what to change
        assert "set_aux_hidden_state_layers" in err["frames"], err
        assert "enable_aux_like_gpu_runner" in err["frames"], err
        assert err["rank"] in (0, 1), err
