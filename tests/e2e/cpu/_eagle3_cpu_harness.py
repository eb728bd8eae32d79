# SPDX-License-Identifier: Apache-2.0
"""Shared machinery for the CPU end-to-end EAGLE-3 tests (not a test module);
conftest.py loads it as ``HARNESS_MODULE``, the name ``worker_cls`` gives.

The CPU runner refuses speculative decoding and its ``load_model`` lacks the
GPU runner's load-time EAGLE-3 block (gpu_model_runner.py ~4189-4207), so
``Eagle3AuxCPUWorker.load_model`` runs that block, the same calls in the same
order, on the real runner: vLLM's own ``SpeculativeConfig`` (allow-list
included), the runner's ``_set_eagle3_aux_layers()``, the model's methods. No
drafter is built; ``check_gpu_runner_block_unchanged`` stops the mirror
drifting. The aux states are read from ``execute_model_state`` after each
step: the tensors the runner would hand the drafter.

Engine settings: ``VLLM_MLA_DISABLE=1`` (the CPU platform refuses MLA);
``-rotary_embedding`` because v0.16.0's CPU rotary kernel mis-rotates every
head but the first of DeepSeek's strided 3-D q_pe (a stock CPU bug, aux off
too); eager float32, no prefix caching (every prompt row is captured), and a
small token budget so prefill is chunked and mixed with decode.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
import inspect
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

HARNESS_MODULE = "eagle3_e2e_cpu_harness"
DRAFT_KEY = "eagle3_e2e_cpu_draft_model"
# Parallel tests only. Worker exceptions do not cross the process boundary
# (LLM(...) only says "WorkerProc initialization failed"): each worker writes
# its own to <ERROR_DIR>/rank<N>.json. DRAFT_PP_KEY: enable_aux_like_gpu_runner.
ERROR_DIR_KEY = "eagle3_e2e_cpu_error_dir"
DRAFT_PP_KEY = "eagle3_e2e_cpu_draft_config_pp"
REPO_ROOT = Path(__file__).resolve().parents[3]

ENGINE_ENV: dict[str, str] = {
    "VLLM_MLA_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
CPU_COMPILATION_CONFIG: dict[str, Any] = {"custom_ops": ["-rotary_embedding"]}


def load_tiny_checkpoints() -> ModuleType:
    """tools/tiny_checkpoints.py, imported by path (no package import)."""
    name = "eagle3_e2e_tiny_checkpoints"
    if name not in sys.modules:
        path = REPO_ROOT / "tools" / "tiny_checkpoints.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec and spec.loader, path
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


# --- The GPU runner's aux-layer block, run against the CPU runner ---

GPU_RUNNER_BLOCK = (
    "if self.use_aux_hidden_state_outputs:",
    "if not supports_eagle3(self.get_model()):",
    "self._set_eagle3_aux_layers()",
)


def check_gpu_runner_block_unchanged() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    src = inspect.getsource(GPUModelRunner.load_model)
    pos = -1
    for needle in GPU_RUNNER_BLOCK:
        pos = src.find(needle, pos + 1)
        assert pos >= 0, (
            f"GPUModelRunner.load_model no longer contains {needle!r} (in this "
            "order): update Eagle3AuxCPUWorker, which mirrors it"
        )


@dataclass
class AuxSetup:
    aux_layers: tuple[int, ...]
    source: str  # "draft config" or "model default"
    draft_architectures: list[str]


def enable_aux_like_gpu_runner(
    runner: Any, draft_model: str, draft_config_pp: int | None = None
) -> AuxSetup:
    """GPUModelRunner's load-time EAGLE-3 block, on a (CPU) model runner.

    ``draft_config_pp`` loads the draft config as if pipeline_parallel_size
    were that value: v0.16.0 refuses every EAGLE-3 drafter for PP > 1 (none
    is SupportsPP) while building SpeculativeConfig, and 1 steps past only
    that check to reach the model's own refusal on real PP > 1 groups.
    """
    from vllm.config import SpeculativeConfig
    from vllm.config.speculative import get_eagle3_aux_layer_ids
    from vllm.model_executor.models.interfaces import supports_eagle3

    check_gpu_runner_block_unchanged()
    parallel_config = runner.parallel_config
    if draft_config_pp is not None:
        parallel_config = copy.copy(parallel_config)
        parallel_config.pipeline_parallel_size = draft_config_pp
    spec_config = SpeculativeConfig(
        method="eagle3", model=draft_model, num_speculative_tokens=3,
        target_model_config=runner.model_config, target_parallel_config=parallel_config,
    )
    hf_config = spec_config.draft_model_config.hf_config
    eagle_config = getattr(hf_config, "eagle_config", None) or {}
    # What GPUModelRunner.__init__ takes from the EAGLE-3 drafter.
    if not eagle_config.get("use_aux_hidden_state", True):
        return AuxSetup((), "disabled by draft config", list(hf_config.architectures))

    # ---- mirror of GPUModelRunner.load_model (v0.16.0 ~4189-4207) ----
    if not supports_eagle3(runner.get_model()):
        raise RuntimeError(
            "Model does not support EAGLE3 interface but "
            "aux_hidden_state_outputs was requested"
        )
    assert runner.speculative_config is None
    runner.speculative_config = spec_config
    try:
        runner._set_eagle3_aux_layers()
    finally:
        runner.speculative_config = None
    # ---- end of mirror ----
    runner.use_aux_hidden_state_outputs = True
    # Read back from the DeepseekV2Model that captures (Kimi-K2.5 wraps one).
    lm = getattr(runner.model, "language_model", runner.model)
    source = "draft config" if get_eagle3_aux_layer_ids(hf_config) else "model default"
    return AuxSetup(
        tuple(lm.model.aux_hidden_state_layers), source, list(hf_config.architectures)
    )


def install_aux_recorder(runner: Any, log: list[dict[str, Any]]) -> None:
    """After every execute_model step, record the aux states the runner keeps
    for the drafter, with the step's request ids, token counts and input ids."""
    original = runner.execute_model

    def execute_model(sched: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(sched, *args, **kwargs)
        state, n = runner.execute_model_state, sched.total_num_scheduled_tokens
        if state is not None and n:
            req_ids = list(runner.input_batch.req_ids)
            aux = state.aux_hidden_states
            log.append({
                "req_ids": req_ids,
                "num_scheduled": [sched.num_scheduled_tokens[r] for r in req_ids],
                "input_ids": runner.input_ids.cpu[:n].clone().to(torch.int64),
                "aux": None if aux is None else [a[:n].clone() for a in aux],
            })
        return out

    runner.execute_model = execute_model


def _make_worker_class() -> type:
    from vllm.v1.worker.cpu_worker import CPUWorker

    class Eagle3AuxCPUWorker(CPUWorker):
        def load_model(self) -> None:
            super().load_model()
            self.eagle3_e2e_setup: AuxSetup | None = None
            self.eagle3_e2e_log: list[dict[str, Any]] = []
            extra = self.vllm_config.additional_config or {}
            draft = extra.get(DRAFT_KEY) if isinstance(extra, dict) else None
            if draft:
                try:
                    self.eagle3_e2e_setup = enable_aux_like_gpu_runner(
                        self.model_runner, draft, extra.get(DRAFT_PP_KEY)
                    )
                except Exception as exc:
                    if error_dir := extra.get(ERROR_DIR_KEY):
                        Path(error_dir).mkdir(parents=True, exist_ok=True)
                        frames = traceback.extract_tb(exc.__traceback__)
                        (Path(error_dir) / f"rank{self.rank}.json").write_text(
                            json.dumps({
                                "rank": self.rank, "type": type(exc).__name__,
                                "message": str(exc), "frames": [f.name for f in frames],
                            })
                        )
                    raise
            install_aux_recorder(self.model_runner, self.eagle3_e2e_log)

        def eagle3_e2e_report(self) -> dict[str, Any]:
            """Return (and clear) what was recorded; called via collective_rpc."""
            log = list(self.eagle3_e2e_log)  # the recorder keeps appending to it
            self.eagle3_e2e_log.clear()
            model = self.model_runner.get_model()
            return {
                "setup": self.eagle3_e2e_setup, "steps": log,
                "use_aux_hidden_state_outputs": (
                    self.model_runner.use_aux_hidden_state_outputs
                ),
                "model_class": type(model).__name__,
                "children": {n: type(m).__name__ for n, m in model.named_children()},
            }

        def eagle3_e2e_parallel_info(self) -> dict[str, Any]:
            """This worker's place in the parallel layout, and whether each MoE
            block chunks tokens (sequence-parallel MoE)."""
            from vllm.distributed import get_pp_group, get_tp_group

            tp, pp = get_tp_group(), get_pp_group()
            return {
                "rank": self.rank, "pid": os.getpid(),
                "tp_rank": tp.rank_in_group, "tp_size": tp.world_size,
                "pp_rank": pp.rank_in_group, "pp_size": pp.world_size,
                "moe_sequence_parallel": [
                    bool(m.is_sequence_parallel)
                    for m in self.model_runner.get_model().modules()
                    if type(m).__name__ == "DeepseekV2MoE"
                ],
            }

    Eagle3AuxCPUWorker.__module__ = HARNESS_MODULE
    Eagle3AuxCPUWorker.__qualname__ = "Eagle3AuxCPUWorker"
    return Eagle3AuxCPUWorker


def __getattr__(name: str) -> Any:
    # Built on first use: importing this module must not import vLLM's
    # worker stack before the engine environment is set.
    if name == "Eagle3AuxCPUWorker":
        globals()[name] = _make_worker_class()
        return globals()[name]
    raise AttributeError(name)


# --- Engines ---


def engine_kwargs(
    model: str | Path, *, draft: str | Path | None = None, record: bool = True,
    **overrides: Any,
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": str(model), "dtype": "float32", "seed": 0, "enforce_eager": True,
        "max_model_len": 256, "max_num_batched_tokens": 16,
        "max_num_seqs": 4, "enable_prefix_caching": False,
        "compilation_config": dict(CPU_COMPILATION_CONFIG), "disable_log_stats": True,
    }
    if draft is not None or record:
        kwargs["worker_cls"] = f"{HARNESS_MODULE}.Eagle3AuxCPUWorker"
    if draft is not None:
        kwargs["additional_config"] = {DRAFT_KEY: str(draft)}
    return {**kwargs, **overrides}


@contextlib.contextmanager
def running_engine(**kwargs: Any) -> Iterator[Any]:
    """An LLM, torn down afterwards so the next engine can start."""
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm = None
    try:
        llm = LLM(**kwargs)
        yield llm
    finally:
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def run_prompts(
    model: str | Path, draft: str | Path | None, prompts: Sequence[Any], *,
    max_tokens: int, step_budget: int, **overrides: Any,
) -> dict[str, Any]:
    """Start an engine, generate greedily for ``prompts`` as one batch, stop it.

    Returns prompt and output token ids, each worker's report (``report`` is
    rank 0's) and parallel info in rank order, and start and total seconds."""
    from vllm import SamplingParams

    kwargs = engine_kwargs(
        model, draft=draft, max_num_batched_tokens=step_budget, **overrides
    )
    start = time.monotonic()
    with running_engine(**kwargs) as llm:
        started = time.monotonic() - start
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(list(prompts), params, use_tqdm=False)
        reports = llm.collective_rpc("eagle3_e2e_report")
        info = llm.collective_rpc("eagle3_e2e_parallel_info")
    return {
        "prompt_ids": [list(o.prompt_token_ids) for o in outs],
        "output_ids": [list(o.outputs[0].token_ids) for o in outs],
        "report": reports[0], "reports": list(reports), "parallel_info": list(info),
        "start_s": started, "total_s": time.monotonic() - start,
    }


# --- Recorded steps -> per-request rows ---


@dataclass
class RequestRows:
    input_ids: torch.Tensor  # every token the engine fed for this request
    aux: list[torch.Tensor]  # per aux id: [num_fed_tokens, hidden]
    chunks: list[int]  # tokens per step


def run_rows(run: dict[str, Any]) -> list[RequestRows]:
    """Rank 0's recorded rows of ``run``, one per prompt, in prompt order (the
    engine's internal request ids are matched to prompts by their tokens)."""
    parts: dict[str, list[tuple[torch.Tensor, list[torch.Tensor] | None]]] = {}
    for step in run["report"]["steps"]:
        start = 0
        for req_id, count in zip(step["req_ids"], step["num_scheduled"]):
            end = start + count
            aux = None if step["aux"] is None else [a[start:end] for a in step["aux"]]
            parts.setdefault(req_id, []).append((step["input_ids"][start:end], aux))
            start = end
        assert start == step["input_ids"].shape[0], "rows do not add up"
    rows = []
    for pieces in parts.values():
        ids, auxes = zip(*pieces)
        aux = [] if auxes[0] is None else [torch.cat(a) for a in zip(*auxes)]
        rows.append(RequestRows(torch.cat(ids), aux, [len(i) for i in ids]))
    matched = []
    for prompt in run["prompt_ids"]:
        hits = [r for r in rows if r.input_ids[: len(prompt)].tolist() == list(prompt)]
        assert len(hits) == 1, f"{len(hits)} engine requests match a prompt"
        matched.append(hits[0])
    return matched


def assert_chunked_prefill_and_decode(
    run: dict[str, Any], step_budget: int, max_tokens: int
) -> None:
    """Both regimes really happened: prompts longer than the budget were
    prefilled over several steps, every request ended with single-token
    decode steps, and some step mixed a decode with a prefill chunk."""
    steps = run["report"]["steps"]
    assert max(s["input_ids"].shape[0] for s in steps) <= step_budget
    rows = run_rows(run)
    long_rows = [r for r, p in zip(rows, run["prompt_ids"]) if len(p) > step_budget]
    assert long_rows and all(
        len(r.chunks) >= 2 + max_tokens - 1 for r in long_rows
    ), "long prompts were not prefilled in chunks"
    assert all(r.chunks[-(max_tokens - 1) :] == [1] * (max_tokens - 1) for r in rows)
    counts = [s["num_scheduled"] for s in steps]
    assert any(1 in c and max(c) > 1 for c in counts), "no decode mixed with prefill"


# --- Hugging Face reference ---


def load_hf_reference(checkpoint: Path, prefix: str = "", text_key: str | None = None):
    """transformers' own DeepseekV3ForCausalLM, float32, eager, on the
    checkpoint's weights (those under ``prefix``, config under ``text_key``)."""
    from safetensors.torch import load_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    cfg = dict(config[text_key] if text_key else config)
    cfg.pop("architectures", None)
    cfg.pop("model_type", None)
    hf_config = DeepseekV3Config(**cfg)
    hf_config._attn_implementation = "eager"
    weights = {
        k[len(prefix) :]: v.to(torch.float32)
        for k, v in load_file(str(Path(checkpoint) / "model.safetensors")).items()
        if k.startswith(prefix)
    }
    with torch.device("cpu"):
        model = DeepseekV3ForCausalLM(hf_config).to(torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # e_score_correction_bias is a buffer in HF; everything must load.
    assert not missing and not unexpected, (missing, unexpected)
    return model.eval()


@dataclass
class HFStates:
    by_id: dict[int, torch.Tensor]  # id k -> input of layer k; N -> pre-norm out
    post_norm: torch.Tensor  # HF's last output_hidden_states entry (after norm)
    logits: torch.Tensor


@torch.inference_mode()
def hf_states(model: Any, token_ids: Sequence[int]) -> HFStates:
    n_layers = model.config.num_hidden_layers
    captured: list[torch.Tensor] = []
    # output_hidden_states' last entry is AFTER the final norm: hook the last
    # decoder layer for its own output instead.
    handle = model.model.layers[n_layers - 1].register_forward_hook(
        lambda mod, args, out: captured.append(
            (out[0] if isinstance(out, tuple) else out).detach().clone()
        )
    )
    try:
        ids = torch.tensor([list(token_ids)])
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    hs = out.hidden_states
    assert len(hs) == n_layers + 1 and len(captured) == 1
    by_id = {k: hs[k][0] for k in range(n_layers)}
    by_id[n_layers] = captured[0][0]
    return HFStates(by_id, hs[n_layers][0], out.logits[0])


def greedy_vs_hf(
    logits: torch.Tensor, output: Sequence[int], tie_gap: float = 1e-3
) -> tuple[int, int]:
    """(checked, mismatches) of ``output`` against the argmax of ``logits``
    (rows from the last prompt token on), skipping near-ties."""
    top2 = logits.topk(2, dim=-1)
    checked = mismatches = 0
    for pos, token in enumerate(output):
        if (top2.values[pos, 0] - top2.values[pos, 1]).item() < tie_gap:
            continue  # near-tie: either token is the model's
        checked += 1
        mismatches += int(top2.indices[pos, 0].item() != token)
    return checked, mismatches


def compare_aux_with_hf(
    hf_model: Any, run: dict[str, Any], expect_ids: tuple[int, ...], atol: float,
    min_margin: float = 100.0, min_tokens_checked: float | None = None,
) -> dict[str, Any]:
    """Every recorded row of every request of ``run`` against HF.

    Asserts |vLLM - HF| <= atol, and that the smallest per-token gap between
    the right HF state and its neighbours (what an off-by-one, or for id
    ``num_hidden_layers`` "after the final norm", would capture) is at least
    ``min_margin`` tolerances. With ``min_tokens_checked``, at least that many
    greedy tokens (near-ties skipped) were checked and all equal HF's argmax,
    so the reference is the same model. Returns the numbers.
    """
    rep = run["report"]
    assert rep["use_aux_hidden_state_outputs"] is True
    assert rep["setup"].aux_layers == expect_ids, rep["setup"]
    n_layers = hf_model.config.num_hidden_layers
    hidden = hf_model.config.hidden_size
    worst_err, worst_scale, min_gap, gap_at = 0.0, 0.0, float("inf"), ""
    checked = mismatches = 0
    for prompt, output, req in zip(run["prompt_ids"], run["output_ids"], run_rows(run)):
        fed = prompt + output[:-1]  # the last sampled token is never fed
        assert req.input_ids.tolist() == fed, "recorded rows are not this request's"
        assert len(req.aux) == len(expect_ids), "one aux state per id"
        ref = hf_states(hf_model, fed)
        for layer_id, got in zip(expect_ids, req.aux):
            want = ref.by_id[layer_id]
            assert got.shape == want.shape == (len(fed), hidden)
            worst_err = max(worst_err, (got - want).abs().max().item())
            worst_scale = max(worst_scale, want.abs().max().item())
            neighbours = {
                f"id {j}": ref.by_id[j] for j in (layer_id - 1, layer_id + 1)
                if 0 <= j <= n_layers
            }
            if layer_id == n_layers:
                neighbours["post-norm output"] = ref.post_norm
            for name, other in neighbours.items():
                gap = (want - other).abs().amax(dim=-1).min().item()
                if gap < min_gap:
                    min_gap, gap_at = gap, f"id {layer_id} vs {name}"
        c, m = greedy_vs_hf(ref.logits[len(prompt) - 1 :], output)
        checked, mismatches = checked + c, mismatches + m
    nums = {
        "max_abs_err": worst_err, "max_abs_state": worst_scale,
        "min_neighbour_gap": min_gap, "min_gap_at": gap_at, "margin": min_gap / atol,
        "tokens_checked": checked, "token_mismatches": mismatches,
    }
    print(f"\naux vs HF (atol={atol}): {nums}")
    assert worst_err <= atol, nums
    assert nums["margin"] >= min_margin, f"atol {atol} is not below the layer gap"
    if min_tokens_checked is not None:
        assert checked >= min_tokens_checked and mismatches == 0, nums
    return nums
