# SPDX-License-Identifier: Apache-2.0
"""Shared machinery for the CPU end-to-end EAGLE-3 tests (not a test module).

Loaded by ``conftest.py`` under the fixed module name ``HARNESS_MODULE`` so
that vLLM can resolve ``worker_cls`` to the worker class defined here (the
engine runs in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Engines
with world size > 1 (test_eagle3_cpu_parallel.py) keep the engine core here
but start one worker process per rank, which import this file by the same
name from ``worker_import_dir`` (see the last section).

Why a worker subclass, and what it does
---------------------------------------
On the GPU the model runner turns EAGLE-3 aux capture on while loading the
model (``GPUModelRunner.load_model``, vLLM v0.16.0 gpu_model_runner.py
~4189-4207): if ``use_aux_hidden_state_outputs`` (set in ``__init__`` from the
EAGLE-3 drafter) it checks ``supports_eagle3(self.get_model())`` and calls
``_set_eagle3_aux_layers()`` (added by the series), which takes the ids from
the draft config (top-level or ``eagle_config``), falls back to
``model.get_eagle3_aux_hidden_state_layers()``, calls
``model.set_aux_hidden_state_layers(aux_layers)`` and logs what is captured
and why. From then on the runner's
``execute_model`` unpacks ``(hidden_states, aux_hidden_states)`` from the model
and keeps the aux states in ``execute_model_state`` for the drafter.

The CPU runner (``CPUModelRunner``, a ``GPUModelRunner`` subclass) cannot take
that route: it asserts ``speculative_config is None`` ("spec decode is not
supported") and overrides ``load_model`` without the block. So
``Eagle3AuxCPUWorker.load_model`` runs the stock CPU load and then that same
block against the real runner, with the same calls in the same order, at the
same moment (before warm-up and KV-cache sizing):

* the draft config is loaded by vLLM's own ``SpeculativeConfig(method="eagle3",
  model=<draft dir>, target_model_config=..., ...)``: the real draft
  ``ModelConfig``/``EAGLEConfig`` path, including the EAGLE-3 target
  allow-list (wall 1 on stock v0.16.0);
* ``runner.speculative_config`` holds it only while the runner's own
  ``_set_eagle3_aux_layers()`` reads it, so no drafter is ever
  built and the CPU runner never sees a speculative config afterwards;
* ``supports_eagle3`` / ``get_eagle3_aux_hidden_state_layers`` /
  ``set_aux_hidden_state_layers`` are the model's real methods, and an error
  there fails ``LLM(...)`` exactly as it would fail engine start on a GPU;
* ``use_aux_hidden_state_outputs = True`` is the value the GPU runner's
  ``__init__`` takes from the EAGLE-3 drafter (``eagle_config.
  use_aux_hidden_state``, default True).

``check_gpu_runner_block_unchanged()`` asserts that ``GPUModelRunner.
load_model`` still contains that block, so the mirror cannot silently drift.

Nothing computes a forward by hand: the aux states are read from the runner's
``execute_model_state`` right after each ``execute_model`` step, i.e. exactly
the tensors the runner would hand to ``propose_draft_token_ids``, together
with the scheduled request ids, their token counts and the input ids.

CPU engine settings and why
---------------------------
* ``VLLM_MLA_DISABLE=1``: the CPU platform raises "MLA is not supported on
  CPU"; DeepSeek layers then use ``DeepseekV2Attention`` (MLA projections,
  materialised K/V, regular paged attention).
* ``compilation_config={"custom_ops": ["-rotary_embedding"]}``: vLLM v0.16.0's
  CPU ``rotary_embedding`` kernel (csrc/cpu/pos_encoding.cpp) derives the head
  count as ``query.size(-1) / head_size`` and the token stride as
  ``query.stride(-2)``, which is wrong for the 3-D, strided ``q_pe`` view that
  ``DeepseekV2Attention`` passes ([tokens, heads, rope_dim]): every head but
  the first is mis-rotated (measured: layer-1 input off by ~0.7 vs HF, and a
  different first greedy token). The CUDA kernel handles that shape. Disabling
  that one CustomOp selects vLLM's own ``forward_native`` rotary; everything
  else stays on the CPU kernels. This is a stock CPU-kernel bug, unrelated to
  EAGLE-3, and applies to the aux-off engine too.
* ``enforce_eager=True``, float32, prefix caching off (every prompt token is
  computed, so every row is captured), small ``max_num_batched_tokens`` so
  prefill is chunked and decode steps share batches with prefill chunks.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import inspect
import json
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

HARNESS_MODULE = "eagle3_e2e_cpu_harness"
DRAFT_KEY = "eagle3_e2e_cpu_draft_model"
# Optional additional_config keys, used by the parallel tests only (absent:
# behaviour unchanged). ERROR_DIR_KEY: each worker whose EAGLE-3 set-up raises
# writes the exception to <dir>/rank<N>.json before re-raising, because with
# worker processes LLM(...) only reports "WorkerProc initialization failed".
# DRAFT_PP_KEY: load the draft config as if pipeline_parallel_size were this
# value (see enable_aux_like_gpu_runner).
ERROR_DIR_KEY = "eagle3_e2e_cpu_error_dir"
DRAFT_PP_KEY = "eagle3_e2e_cpu_draft_config_pp"
REPO_ROOT = Path(__file__).resolve().parents[3]

ENGINE_ENV: dict[str, str] = {
    "VLLM_MLA_DISABLE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
CPU_COMPILATION_CONFIG: dict[str, Any] = {"custom_ops": ["-rotary_embedding"]}


def load_tiny_checkpoints() -> ModuleType:
    """tools/tiny_checkpoints.py, imported by path (no package import)."""
    name = "eagle3_e2e_tiny_checkpoints"
    if name in sys.modules:
        return sys.modules[name]
    path = REPO_ROOT / "tools" / "tiny_checkpoints.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------
# The GPU runner's aux-layer block, run against the CPU runner
# ---------------------------------------------------------------------------

GPU_RUNNER_BLOCK = (
    "if self.use_aux_hidden_state_outputs:",
    "if not supports_eagle3(self.get_model()):",
    "self._set_eagle3_aux_layers()",
)


def check_gpu_runner_block_unchanged() -> None:
    """Fail loudly if GPUModelRunner.load_model no longer has the mirrored block."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    src = inspect.getsource(GPUModelRunner.load_model)
    pos = -1
    for needle in GPU_RUNNER_BLOCK:
        nxt = src.find(needle, pos + 1)
        if nxt < 0:
            raise AssertionError(
                f"GPUModelRunner.load_model no longer contains {needle!r} (in "
                "this order): update Eagle3AuxCPUWorker, which mirrors it"
            )
        pos = nxt


@dataclass
class AuxSetup:
    """What the mirrored load-time block decided."""

    aux_layers: tuple[int, ...]
    source: str  # "draft config" or "model default"
    draft_architectures: list[str]


def enable_aux_like_gpu_runner(
    runner: Any, draft_model: str, draft_config_pp: int | None = None
) -> AuxSetup:
    """GPUModelRunner's load-time EAGLE-3 block, on a (CPU) model runner.

    ``draft_config_pp`` (default None: the runner's own parallel config, as on
    a GPU) loads the draft config against a copy of the parallel config with
    that pipeline_parallel_size. vLLM v0.16.0 checks the *drafter* for
    SupportsPP while building SpeculativeConfig, and no EAGLE-3 drafter it
    ships passes, so with PP > 1 that generic check fires first; 1 here steps
    past it (only it) to reach the model's own set_aux_hidden_state_layers on
    the real PP > 1 process groups. Only test_eagle3_cpu_parallel.py uses it.
    """
    import copy

    from vllm.config import SpeculativeConfig
    from vllm.config.speculative import get_eagle3_aux_layer_ids
    from vllm.model_executor.models.interfaces import supports_eagle3

    check_gpu_runner_block_unchanged()
    target_parallel_config = runner.parallel_config
    if draft_config_pp is not None:
        target_parallel_config = copy.copy(runner.parallel_config)
        target_parallel_config.pipeline_parallel_size = draft_config_pp
    # vLLM's own draft-config loading (EAGLEConfig, allow-list check, ...).
    spec_config = SpeculativeConfig(
        method="eagle3",
        model=draft_model,
        num_speculative_tokens=3,
        target_model_config=runner.model_config,
        target_parallel_config=target_parallel_config,
    )
    hf_config = spec_config.draft_model_config.hf_config
    eagle_config = getattr(hf_config, "eagle_config", None) or {}
    # GPUModelRunner.__init__: use_aux_hidden_state_outputs comes from the
    # drafter's eagle_config.use_aux_hidden_state (EagleProposer, default True).
    use_aux = bool(eagle_config.get("use_aux_hidden_state", True))
    if not use_aux:
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
    # What the model was told, read back from the DeepseekV2Model that
    # captures (Kimi-K2.5 wraps one as language_model).
    lm = getattr(runner.model, "language_model", runner.model)
    aux_layers = lm.model.aux_hidden_state_layers
    source = "draft config" if get_eagle3_aux_layer_ids(hf_config) else "model default"
    return AuxSetup(tuple(aux_layers), source, list(hf_config.architectures))


def install_aux_recorder(runner: Any, log: list[dict[str, Any]]) -> None:
    """Record, after every execute_model step, the aux states the runner keeps
    for the drafter, with the step's request ids, token counts and input ids."""
    original = runner.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(scheduler_output, *args, **kwargs)
        state = runner.execute_model_state
        if state is not None and scheduler_output.total_num_scheduled_tokens:
            n = scheduler_output.total_num_scheduled_tokens
            req_ids = list(runner.input_batch.req_ids)
            counts = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
            aux = state.aux_hidden_states
            log.append(
                {
                    "req_ids": req_ids,
                    "num_scheduled": counts,
                    "input_ids": runner.input_ids.cpu[:n].clone().to(torch.int64),
                    "aux": None if aux is None else [a[:n].clone() for a in aux],
                }
            )
        return out

    runner.execute_model = execute_model


def _write_worker_error(error_dir: Path, rank: int, exc: BaseException) -> None:
    error_dir.mkdir(parents=True, exist_ok=True)
    frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
    (error_dir / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "type": type(exc).__name__,
                "message": str(exc),
                "frames": frames,
            }
        )
    )


def read_worker_errors(error_dir: Path) -> dict[int, dict[str, Any]]:
    """What _write_worker_error left, by global rank."""
    out: dict[int, dict[str, Any]] = {}
    for path in sorted(Path(error_dir).glob("rank*.json")):
        entry = json.loads(path.read_text())
        out[int(entry["rank"])] = entry
    return out


def _make_worker_class() -> type:
    from vllm.v1.worker.cpu_worker import CPUWorker

    class Eagle3AuxCPUWorker(CPUWorker):
        """CPUWorker that turns EAGLE-3 aux capture on at load time, the way
        the GPU model runner does, and records what the runner produces."""

        def load_model(self) -> None:
            super().load_model()
            self.eagle3_e2e_setup: AuxSetup | None = None
            self.eagle3_e2e_log: list[dict[str, Any]] = []
            extra = self.vllm_config.additional_config or {}
            draft = extra.get(DRAFT_KEY) if isinstance(extra, dict) else None
            if draft:
                error_dir = extra.get(ERROR_DIR_KEY)
                try:
                    self.eagle3_e2e_setup = enable_aux_like_gpu_runner(
                        self.model_runner, draft, extra.get(DRAFT_PP_KEY)
                    )
                except Exception as exc:
                    if error_dir:
                        _write_worker_error(Path(error_dir), self.rank, exc)
                    raise
            install_aux_recorder(self.model_runner, self.eagle3_e2e_log)

        def eagle3_e2e_report(self) -> dict[str, Any]:
            """Return (and clear) what was recorded; called via collective_rpc."""
            log = list(self.eagle3_e2e_log)
            self.eagle3_e2e_log.clear()
            return {
                "setup": self.eagle3_e2e_setup,
                "use_aux_hidden_state_outputs": self.model_runner.use_aux_hidden_state_outputs,
                "model_class": type(self.model_runner.get_model()).__name__,
                "children": {
                    name: type(mod).__name__
                    for name, mod in self.model_runner.get_model().named_children()
                },
                "steps": log,
            }

        def eagle3_e2e_parallel_info(self) -> dict[str, Any]:
            """This worker's place in the parallel layout, and whether any
            MoE block of its model chunks tokens (sequence-parallel MoE)."""
            from vllm.distributed import get_pp_group, get_tp_group

            model = self.model_runner.get_model()
            moe = [
                bool(mod.is_sequence_parallel)
                for mod in model.modules()
                if type(mod).__name__ == "DeepseekV2MoE"
            ]
            return {
                "rank": self.rank,
                "tp_rank": get_tp_group().rank_in_group,
                "tp_size": get_tp_group().world_size,
                "pp_rank": get_pp_group().rank_in_group,
                "pp_size": get_pp_group().world_size,
                "pid": os.getpid(),
                "moe_sequence_parallel": moe,
            }

    Eagle3AuxCPUWorker.__module__ = HARNESS_MODULE
    Eagle3AuxCPUWorker.__qualname__ = "Eagle3AuxCPUWorker"
    return Eagle3AuxCPUWorker


def __getattr__(name: str) -> Any:
    # Built on first use, so that importing this module does not import vLLM's
    # worker stack before the engine environment is set.
    if name == "Eagle3AuxCPUWorker":
        cls = _make_worker_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


# ---------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------


def engine_kwargs(
    model: str | Path,
    *,
    draft: str | Path | None = None,
    record: bool = True,
    max_num_batched_tokens: int = 16,
    max_num_seqs: int = 4,
    **overrides: Any,
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "seed": 0,
        "enforce_eager": True,
        "max_model_len": 256,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_num_seqs": max_num_seqs,
        "enable_prefix_caching": False,
        "compilation_config": dict(CPU_COMPILATION_CONFIG),
        "disable_log_stats": True,
    }
    if draft is not None or record:
        kwargs["worker_cls"] = f"{HARNESS_MODULE}.Eagle3AuxCPUWorker"
    if draft is not None:
        kwargs["additional_config"] = {DRAFT_KEY: str(draft)}
    kwargs.update(overrides)
    return kwargs


def shutdown_engine(llm: Any | None) -> None:
    """Tear the in-process engine down so the next one can start."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    try:
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


@contextlib.contextmanager
def running_engine(**kwargs: Any) -> Iterator[Any]:
    from vllm import LLM

    llm = None
    try:
        llm = LLM(**kwargs)
        yield llm
    finally:
        shutdown_engine(llm)


def run_prompts(
    model: str | Path,
    draft: str | Path | None,
    prompts: Sequence[str],
    *,
    max_tokens: int,
    step_budget: int,
    **overrides: Any,
) -> dict[str, Any]:
    """Start an engine, generate greedily for ``prompts`` as one batch, stop it.

    Returns prompt and output token ids, each worker's report (aux setup and
    every recorded step; ``report`` is rank 0's) and parallel info, in rank
    order, and the engine's start and total seconds."""
    import time

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
        "report": reports[0],
        "reports": list(reports),
        "parallel_info": list(info),
        "start_s": started,
        "total_s": time.monotonic() - start,
    }


# ---------------------------------------------------------------------------
# Turning recorded steps into per-request rows
# ---------------------------------------------------------------------------


@dataclass
class RequestRows:
    input_ids: torch.Tensor  # every token the engine fed for this request
    aux: list[torch.Tensor]  # per aux id: [num_fed_tokens, hidden]
    chunks: list[int] = field(default_factory=list)  # tokens per step


def rows_by_request(steps: list[dict[str, Any]]) -> dict[str, RequestRows]:
    parts: dict[str, list[tuple[torch.Tensor, list[torch.Tensor] | None]]] = {}
    for step in steps:
        start = 0
        for req_id, count in zip(step["req_ids"], step["num_scheduled"]):
            ids = step["input_ids"][start : start + count]
            aux = (
                None
                if step["aux"] is None
                else [a[start : start + count] for a in step["aux"]]
            )
            parts.setdefault(req_id, []).append((ids, aux))
            start += count
        assert start == step["input_ids"].shape[0], "rows do not add up"
    out: dict[str, RequestRows] = {}
    for req_id, pieces in parts.items():
        ids = torch.cat([p[0] for p in pieces])
        if pieces[0][1] is None:
            aux: list[torch.Tensor] = []
        else:
            aux = [
                torch.cat([p[1][k] for p in pieces])  # type: ignore[index]
                for k in range(len(pieces[0][1]))
            ]
        out[req_id] = RequestRows(ids, aux, [p[0].shape[0] for p in pieces])
    return out


def match_requests(
    rows: dict[str, RequestRows], prompts: Sequence[list[int]]
) -> list[RequestRows]:
    """The engine's internal request ids, matched to prompts by their tokens."""
    matched: list[RequestRows] = []
    for prompt in prompts:
        hits = [
            r
            for r in rows.values()
            if r.input_ids[: len(prompt)].tolist() == list(prompt)
        ]
        assert len(hits) == 1, f"{len(hits)} engine requests match a prompt"
        matched.append(hits[0])
    return matched


# ---------------------------------------------------------------------------
# Hugging Face reference
# ---------------------------------------------------------------------------


def hf_deepseek_v3(text_config: dict[str, Any], weights: dict[str, torch.Tensor]) -> Any:
    """transformers' own DeepseekV3ForCausalLM, float32, on the given weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = dict(text_config)
    cfg.pop("architectures", None)
    cfg.pop("model_type", None)
    config = DeepseekV3Config(**cfg)
    config._attn_implementation = "eager"
    with torch.device("cpu"):
        model = DeepseekV3ForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # e_score_correction_bias is a buffer in HF; everything must load.
    assert not missing and not unexpected, (missing, unexpected)
    return model.eval()


def load_hf_reference(checkpoint: Path, prefix: str = "", text_key: str | None = None) -> Any:
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    text_config = config[text_key] if text_key else config
    weights = {
        k[len(prefix) :]: v.to(torch.float32)
        for k, v in load_file(str(checkpoint / "model.safetensors")).items()
        if k.startswith(prefix)
    }
    return hf_deepseek_v3(text_config, weights)


@dataclass
class HFStates:
    by_id: dict[int, torch.Tensor]  # id k -> input of layer k; N -> pre-norm out
    post_norm: torch.Tensor  # HF's last output_hidden_states entry (after norm)
    logits: torch.Tensor


@torch.inference_mode()
def hf_states(model: Any, token_ids: Sequence[int]) -> HFStates:
    n_layers = model.config.num_hidden_layers
    captured: list[torch.Tensor] = []
    # output_hidden_states' last entry is AFTER the final norm: take the last
    # decoder layer's own output (before the norm) with a hook instead.
    handle = model.model.layers[n_layers - 1].register_forward_hook(
        lambda mod, args, out: captured.append(
            (out[0] if isinstance(out, tuple) else out).detach().clone()
        )
    )
    try:
        out = model(
            input_ids=torch.tensor([list(token_ids)]),
            output_hidden_states=True,
            use_cache=False,
        )
    finally:
        handle.remove()
    hs = out.hidden_states
    assert len(hs) == n_layers + 1 and len(captured) == 1
    by_id = {k: hs[k][0] for k in range(n_layers)}
    by_id[n_layers] = captured[0][0]
    return HFStates(by_id, hs[n_layers][0], out.logits[0])


def compare_aux_with_hf(
    hf_model: Any,
    run: dict[str, Any],
    expect_ids: tuple[int, ...],
    atol: float,
    tie_gap: float = 1e-3,
) -> dict[str, Any]:
    """Every recorded row of every request of ``run`` against HF.

    ``run`` holds ``prompt_ids``, ``output_ids`` and the worker ``report``.
    Returns the worst |vLLM - HF|, the smallest per-token gap between the
    right HF state and its neighbours (the states an off-by-one, or for id
    ``num_hidden_layers`` "after the final norm", would capture), the margin
    (gap / atol), and how many greedy tokens were checked against HF's argmax.
    """
    rep = run["report"]
    assert rep["use_aux_hidden_state_outputs"] is True
    assert rep["setup"].aux_layers == expect_ids, rep["setup"]
    rows = match_requests(rows_by_request(rep["steps"]), run["prompt_ids"])
    n_layers = hf_model.config.num_hidden_layers
    hidden = hf_model.config.hidden_size
    worst_err, worst_scale, min_gap, gap_at = 0.0, 0.0, float("inf"), ""
    checked = mismatches = 0
    for prompt, output, req in zip(run["prompt_ids"], run["output_ids"], rows):
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
                f"id {j}": ref.by_id[j]
                for j in (layer_id - 1, layer_id + 1)
                if 0 <= j <= n_layers
            }
            if layer_id == n_layers:
                neighbours["post-norm output"] = ref.post_norm
            for name, other in neighbours.items():
                gap = (want - other).abs().amax(dim=-1).min().item()
                if gap < min_gap:
                    min_gap, gap_at = gap, f"id {layer_id} vs {name}"
        # Greedy tokens: HF's argmax after each fed prefix that produced one.
        logits = ref.logits[len(prompt) - 1 :]
        top2 = logits.topk(2, dim=-1)
        for pos, token in enumerate(output):
            if (top2.values[pos, 0] - top2.values[pos, 1]).item() < tie_gap:
                continue
            checked += 1
            mismatches += int(top2.indices[pos, 0].item() != token)
    return {
        "max_abs_err": worst_err,
        "max_abs_state": worst_scale,
        "min_neighbour_gap": min_gap,
        "min_gap_at": gap_at,
        "margin": min_gap / atol,
        "tokens_checked": checked,
        "token_mismatches": mismatches,
    }


# ---------------------------------------------------------------------------
# Engines with worker processes (tensor / pipeline parallel > 1)
# ---------------------------------------------------------------------------
#
# With world size > 1 the engine core (still in-process) drives one worker
# process per rank through vLLM's MultiprocExecutor; the CPU platform forces
# the "mp" backend and the "spawn" start method, so each worker is a fresh
# interpreter that must resolve worker_cls by name. spawn hands the parent's
# sys.path to the child, so a directory holding this file under
# HARNESS_MODULE's name, put on sys.path for the duration, is enough.


def worker_import_dir(tmp_dir: Path) -> Path:
    """A directory in which this module is importable as HARNESS_MODULE (a
    symlink to this file); put it on sys.path while worker processes start."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    link = tmp_dir / f"{HARNESS_MODULE}.py"
    if not link.exists():
        link.symlink_to(Path(__file__).resolve())
    return tmp_dir


def parallel_engine_env(world_size: int = 2) -> dict[str, str]:
    """Extra environment for CPU engines with ``world_size`` worker processes.

    * ``VLLM_CPU_OMP_THREADS_BIND``: the default ("auto") binds rank N to the
      N-th NUMA node and asserts there are ``world_size`` of them; a one-node
      machine has one, so each rank gets one allowed CPU of its own instead
      (or no binding if there are fewer CPUs than ranks).
    * ``TORCHDYNAMO_DISABLE=1``: with TP > 1, VocabParallelEmbedding masks
      token ids with ``get_masked_input_and_mask``, a ``torch.compile``
      (inductor) function; on CPU its first call builds C++ probes and a
      kernel with the system compiler, 10-30 s per engine on 2 cores. The
      function is pure integer arithmetic and runs eagerly with the same
      result; nothing else in these engines (``enforce_eager=True``) compiles.
    """
    cpus = sorted(os.sched_getaffinity(0))
    env = {"TORCHDYNAMO_DISABLE": "1"}
    if len(cpus) >= world_size:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in cpus[:world_size])
    else:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = "1"
    return env
