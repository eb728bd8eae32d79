# SPDX-License-Identifier: Apache-2.0
"""EAGLE-3 aux capture under tensor and pipeline parallelism, on the real vLLM
v0.16.0 CPU engine (the CPU part of issue 6; the 2-GPU part needs GPUs).

The engines are started through ``vllm.LLM`` with the harness worker (see
_eagle3_cpu_harness.py: it runs the GPU runner's load-time EAGLE-3 block on
the CPU runner and records the aux states the runner keeps for the drafter).
With world size 2 the engine core stays in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and vLLM's ``MultiprocExecutor`` (the
only backend the CPU platform allows for world size > 1) spawns one worker
process per rank, bound to one CPU each; they talk over gloo and vLLM's
shared-memory all-reduce, as ``vllm serve --tensor-parallel-size 2`` on CPU
does. ``llm.collective_rpc`` brings back every rank's recording.

Tensor parallel (TP = 2 against TP = 1, tiny DeepSeek-V3 target, ids 0..6 of
a 6-layer model, i.e. embedding, every layer input and the final layer's
output before the norm):

* both ranks turn capture on from the draft config and record, at every
  step, one state per id of shape [tokens scheduled in the step, hidden]:
  the full hidden size and every token, not a TP or token shard;
* the two ranks' states are bitwise identical;
* per request, they equal the TP = 1 capture of the same prompts within the
  DeepSeek-V3 suite's tolerance (2e-4; measured ~1e-5, the all-reduce sums
  in a different order), which is asserted to be far below the gap between
  neighbouring layers;
* greedy tokens are identical to TP = 1, over chunked prefill and decode.

Sequence-parallel MoE (deepseek_v2.py ~335: the MoE block chunks tokens over
the TP ranks and all-gathers them back inside the block) is only switched on
in v0.16.0 with expert parallel, TP > 1 *and* data parallel > 1
(``ParallelConfig.use_sequence_parallel_moe``), which takes 4 ranks: not on
2 cores. The test records that it is off in these engines; either way the
chunks are gathered inside the block, so the states between layers that
capture reads are full, as the shape checks show.

Pipeline parallel (PP = 2). The CPU engine runs PP = 2 (two stages, one
process each; a regression test checks it generates the reference model's
greedy tokens without EAGLE-3), but EAGLE-3 with PP > 1 is stopped at two
levels:

1. vLLM itself, while building ``SpeculativeConfig``: it checks the *drafter*
   against the parallel config, and no EAGLE-3 drafter in v0.16.0
   (``Eagle3LlamaForCausalLM`` serves every EAGLE-3 architecture name) is
   ``SupportsPP``, so ``LLM(..., speculative_config=eagle3,
   pipeline_parallel_size=2)`` fails before any worker starts with vLLM's
   generic "Pipeline parallelism is not supported for this model". That is
   what a user of this release sees, on stock and patched alike (a
   regression test).
2. The series' own refusal in ``set_aux_hidden_state_layers`` (the model, at
   load, on a PP > 1 process group), for whatever reaches the model past 1.
   To exercise it on the real PP = 2 engine the harness loads the draft
   config as for PP = 1 (``DRAFT_PP_KEY``; this skips only the drafter's
   SupportsPP check above); both stages then load their layers and the
   model refuses aux capture with the patched error naming
   ``pipeline_parallel_size=2``, failing ``LLM(...)``. Worker exceptions do
   not cross the process boundary (the parent only gets "WorkerProc
   initialization failed"), so each worker writes its own to a file.
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

# Byte-level tokenizer: 3, 38 and 66 tokens against a 16-token step budget,
# so prefill is chunked and decode steps share batches with prefill chunks.
PROMPTS = [
    "Hi",
    "EAGLE-3 drafts tokens; the target v3.",
    "DeepSeek-V3 routes each token to experts chosen by a biased gate.",
]
MAX_TOKENS = 8
STEP_TOKEN_BUDGET = 16
# The tolerance of test_eagle3_cpu_deepseek_v3.py (vLLM CPU vs HF, float32).
ATOL = 2e-4
MIN_MARGIN = 100.0  # neighbouring-layer gap / ATOL, on every token


@pytest.fixture(scope="module")
def worker_processes(
    harness: ModuleType, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    """Lets spawned worker processes import the harness worker class, and
    gives each of 2 ranks its own CPU (see harness.parallel_engine_env)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(
            str(harness.worker_import_dir(tmp_path_factory.mktemp("worker_import")))
        )
        for key, value in harness.parallel_engine_env(2).items():
            mp.setenv(key, value)
        yield


@pytest.fixture(scope="module")
def tp1(harness: ModuleType, tiny_ckpts: dict[str, Any]) -> dict[str, Any]:
    return harness.run_prompts(tiny_ckpts["dsv3"], tiny_ckpts["draft_all_ids"], PROMPTS,
                               max_tokens=MAX_TOKENS, step_budget=STEP_TOKEN_BUDGET)


@pytest.fixture(scope="module")
def tp2(
    harness: ModuleType, tiny_ckpts: dict[str, Any], worker_processes: Any
) -> dict[str, Any]:
    return harness.run_prompts(tiny_ckpts["dsv3"], tiny_ckpts["draft_all_ids"], PROMPTS,
                               max_tokens=MAX_TOKENS, step_budget=STEP_TOKEN_BUDGET,
                               tensor_parallel_size=2, distributed_executor_backend="mp")


def _check_capture_setup(rep: dict[str, Any], n_layers: int) -> None:
    assert rep["model_class"] == "DeepseekV3ForCausalLM"
    assert rep["use_aux_hidden_state_outputs"] is True
    assert rep["setup"].source == "draft config"
    # Every boundary, including n_layers: the last layer's output pre-norm.
    assert rep["setup"].aux_layers == tuple(range(n_layers + 1))


def test_tp2_aux_states_full_identical_on_ranks_and_equal_to_tp1(
    harness: ModuleType,
    tiny_ckpts: dict[str, Any],
    tp1: dict[str, Any],
    tp2: dict[str, Any],
    record_property: Any,
) -> None:
    config = json.loads((Path(tiny_ckpts["dsv3"]) / "config.json").read_text())
    n_layers = config["num_hidden_layers"]
    assert n_layers == tiny_ckpts["dsv3_layers"]
    ids = tuple(range(n_layers + 1))
    hidden = config["hidden_size"]
    n_moe = n_layers - config["first_k_dense_replace"]

    # Two real worker processes, TP ranks 0 and 1 of one pipeline stage.
    info = tp2["parallel_info"]
    assert [(i["rank"], i["tp_rank"], i["tp_size"], i["pp_size"]) for i in info] == [
        (0, 0, 2, 1),
        (1, 1, 2, 1),
    ], info
    pids = {i["pid"] for i in info}
    assert len(pids) == 2 and os.getpid() not in pids, info
    # v0.16.0's sequence-parallel MoE needs EP and DP > 1: off in every MoE
    # block here (the first first_k_dense_replace layers are dense).
    assert n_moe > 0
    assert all(i["moe_sequence_parallel"] == [False] * n_moe for i in info), info
    assert tp1["parallel_info"][0]["tp_size"] == 1

    rep0, rep1 = tp2["reports"]
    for rep in (rep0, rep1, tp1["reports"][0]):
        _check_capture_setup(rep, n_layers)

    # Both ranks ran the same steps on the same tokens, and every recorded
    # state is the full [scheduled tokens, hidden] tensor, bitwise equal
    # across ranks.
    assert len(rep0["steps"]) == len(rep1["steps"]) > 0
    for s0, s1 in zip(rep0["steps"], rep1["steps"]):
        assert s0["req_ids"] == s1["req_ids"]
        assert s0["num_scheduled"] == s1["num_scheduled"]
        assert torch.equal(s0["input_ids"], s1["input_ids"])
        n = sum(s0["num_scheduled"])
        for a0, a1 in zip(s0["aux"], s1["aux"], strict=True):
            assert a0.shape == a1.shape == (n, hidden), (a0.shape, n)
            assert torch.equal(a0, a1), "aux states differ between TP ranks"
        assert len(s0["aux"]) == len(ids)

    # Per request against TP = 1 (same tokens fed: greedy outputs agree).
    rows1 = harness.match_requests(
        harness.rows_by_request(tp1["reports"][0]["steps"]), tp1["prompt_ids"]
    )
    rows2 = harness.match_requests(harness.rows_by_request(rep0["steps"]), tp2["prompt_ids"])
    max_diff, min_gap = 0.0, float("inf")
    for r1, r2 in zip(rows1, rows2, strict=True):
        assert torch.equal(r1.input_ids, r2.input_ids)
        for k, (a1, a2) in enumerate(zip(r1.aux, r2.aux, strict=True)):
            assert a1.shape == a2.shape == (r1.input_ids.shape[0], hidden)
            max_diff = max(max_diff, (a1 - a2).abs().max().item())
            # The tolerance must not let an off-by-one layer pass.
            for j in (k - 1, k + 1):
                if 0 <= j < len(ids):
                    gap = (a1 - r1.aux[j]).abs().amax(dim=-1).min().item()
                    min_gap = min(min_gap, gap)
    record_property("max_abs_diff_tp1_tp2", max_diff)
    record_property("min_neighbour_gap", min_gap)
    record_property("tp2_engine_start_s", tp2["start_s"])
    print(
        f"\nTP=2 vs TP=1 aux: max |diff| {max_diff:.3g} (ATOL {ATOL}), "
        f"min neighbour gap {min_gap:.3g}; TP=2 engine start {tp2['start_s']:.1f} s, "
        f"run {tp2['total_s']:.1f} s; TP=1 run {tp1['total_s']:.1f} s"
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
    # Both regimes were hit with TP = 2: chunked prefill and single-token
    # decode steps, some of them mixed in one batch.
    steps = tp2["reports"][0]["steps"]
    rows = harness.match_requests(harness.rows_by_request(steps), tp2["prompt_ids"])
    long_rows = [
        r for r, p in zip(rows, tp2["prompt_ids"]) if len(p) > STEP_TOKEN_BUDGET
    ]
    assert long_rows and all(len(r.chunks) >= 2 + MAX_TOKENS - 1 for r in long_rows)
    assert all(r.chunks[-(MAX_TOKENS - 1) :] == [1] * (MAX_TOKENS - 1) for r in rows)
    assert any(
        1 in s["num_scheduled"] and any(c > 1 for c in s["num_scheduled"]) for s in steps
    ), "no step mixed decode and prefill"


@pytest.fixture(scope="module")
def pp2_plain(
    harness: ModuleType, tiny_ckpts: dict[str, Any], worker_processes: Any
) -> dict[str, Any]:
    """PP = 2 without EAGLE-3 (no draft: the harness worker only records)."""
    return harness.run_prompts(tiny_ckpts["dsv3"], None, PROMPTS,
                               max_tokens=MAX_TOKENS, step_budget=STEP_TOKEN_BUDGET,
                               pipeline_parallel_size=2, distributed_executor_backend="mp")


@pytest.mark.regression
def test_pp2_runs_on_the_cpu_engine_without_eagle3(
    harness: ModuleType, tiny_ckpts: dict[str, Any], pp2_plain: dict[str, Any]
) -> None:
    """The control for the PP refusals below: this CPU engine does run
    PP = 2 (two stages, one process each), and its greedy tokens are the
    reference model's (transformers on the same weights)."""
    info = pp2_plain["parallel_info"]
    assert [(i["rank"], i["pp_rank"], i["pp_size"], i["tp_size"]) for i in info] == [
        (0, 0, 2, 1),
        (1, 1, 2, 1),
    ], info
    for rep in pp2_plain["reports"]:
        assert rep["setup"] is None and rep["use_aux_hidden_state_outputs"] is False
    # Only the last stage produces hidden states for sampling (and would
    # hand aux states to a drafter); the first stage's steps return
    # intermediate tensors and leave nothing for the recorder.
    first, last = pp2_plain["reports"]
    assert not first["steps"] and last["steps"]
    assert all(s["aux"] is None for s in last["steps"])

    hf_model = harness.load_hf_reference(Path(tiny_ckpts["dsv3"]))
    checked = 0
    for prompt, output in zip(pp2_plain["prompt_ids"], pp2_plain["output_ids"]):
        assert len(output) == MAX_TOKENS
        logits = harness.hf_states(hf_model, prompt + output[:-1]).logits
        top2 = logits[len(prompt) - 1 :].topk(2, dim=-1)
        for pos, token in enumerate(output):
            if (top2.values[pos, 0] - top2.values[pos, 1]).item() < 1e-3:
                continue  # near-tie: either token is the model's
            checked += 1
            assert top2.indices[pos, 0].item() == token, (prompt, output, pos)
    assert checked >= 0.9 * len(PROMPTS) * MAX_TOKENS, checked


@pytest.mark.regression
def test_pp2_eagle3_stopped_by_vllm_drafter_pp_check(
    harness: ModuleType, tiny_ckpts: dict[str, Any], worker_processes: Any
) -> None:
    """What a user of v0.16.0 gets for EAGLE-3 with PP = 2 (stock and
    patched): vLLM refuses the drafter while building the config, before
    any worker process or model exists."""
    from vllm import LLM

    kwargs = harness.engine_kwargs(
        tiny_ckpts["dsv3"],
        record=False,
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        speculative_config={
            "method": "eagle3",
            "model": str(tiny_ckpts["draft_all_ids"]),
            "num_speculative_tokens": 3,
        },
    )
    llm = None
    with pytest.raises(NotImplementedError) as excinfo:
        llm = LLM(**kwargs)
    assert llm is None
    msg = str(excinfo.value)
    assert "Pipeline parallelism is not supported for this model" in msg, msg
    frames = [entry.name for entry in excinfo.traceback]
    assert "create_speculative_config" in frames, frames


def test_pp2_aux_capture_refused_at_engine_start(
    harness: ModuleType,
    tiny_ckpts: dict[str, Any],
    worker_processes: Any,
    tmp_path: Path,
) -> None:
    error_dir = tmp_path / "worker_errors"
    kwargs = harness.engine_kwargs(
        tiny_ckpts["dsv3"],
        draft=tiny_ckpts["draft_all_ids"],
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
    )
    kwargs["additional_config"].update(
        {harness.ERROR_DIR_KEY: str(error_dir), harness.DRAFT_PP_KEY: 1}
    )
    started = False
    with pytest.raises(Exception) as excinfo, harness.running_engine(**kwargs):
        started = True
    assert not started, "the engine started; the error came later"
    # In this process: the executor's report that a worker failed to start.
    assert "WorkerProc initialization failed" in str(excinfo.value), excinfo.value

    # In the workers: the model's own refusal. Both stages load their layers
    # and refuse; the executor may stop the slower one before it writes, so
    # at least one rank, and every rank that wrote, must show it.
    errors = harness.read_worker_errors(error_dir)
    assert errors, f"no worker wrote its error to {error_dir}"
    for rank, err in errors.items():
        msg = err["message"]
        assert err["type"] == "ValueError", err
        assert "pipeline_parallel_size=2" in msg, err
        assert "EAGLE-3" in msg, err
        assert "DeepseekV3ForCausalLM" in msg, err
        assert "pipeline_parallel_size=1" in msg, err  # what to change
        assert "set_aux_hidden_state_layers" in err["frames"], err
        assert "enable_aux_like_gpu_runner" in err["frames"], err
        assert rank in (0, 1), err
