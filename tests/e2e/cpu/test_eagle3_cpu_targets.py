# SPDX-License-Identifier: Apache-2.0
"""EAGLE-3 aux hidden states from the real vLLM v0.16.0 CPU engine against
transformers' DeepseekV3ForCausalLM on the same weights (how the engine's aux
path is driven on CPU: _eagle3_cpu_harness.py).

DeepSeek-V3 (ids 0..6 of a 6-layer target: embedding, every layer input, the
last layer's output before the norm) over a batch with chunked prefill;
greedy tokens unchanged by capture; an out-of-range id is refused while
the engine config is built.
Also: float16 (the residual-stream scaling), a published drafter's nested ids
on a shrunk published target, and Kimi-K2.5's multimodal wrapper.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.e2e

# Byte-level tokenizer: 3, 38, 66 and 104 tokens against a 16-token budget.
PROMPTS = [
    "Hi",
    "EAGLE-3 drafts tokens; the target v3.",
    "DeepSeek-V3 routes each token to experts chosen by a biased gate.",
    "Speculative decoding runs a small draft head on hidden states the target "
    "model exposes at three depths.",
]
MAX_TOKENS = 10
STEP_TOKEN_BUDGET = 16
# float32 on both sides; vLLM's CPU kernels sum in another order than HF's
# eager code: measured ~1e-5 on states of ~10, headroom for other CPUs.
ATOL = 2e-4


def _run(harness: ModuleType, tiny_ckpts: dict[str, Any], draft: Any) -> dict:
    return harness.run_prompts(
        tiny_ckpts["dsv3"], draft, PROMPTS,
        max_tokens=MAX_TOKENS, step_budget=STEP_TOKEN_BUDGET,
    )


@pytest.fixture(scope="module")
def aux_on(harness: ModuleType, tiny_ckpts: dict[str, Any]) -> dict[str, Any]:
    return _run(harness, tiny_ckpts, tiny_ckpts["draft_all_ids"])


@pytest.fixture(scope="module")
def aux_off(harness: ModuleType, tiny_ckpts: dict[str, Any]) -> dict[str, Any]:
    return _run(harness, tiny_ckpts, None)


def test_aux_states_match_hf_deepseek_v3(
    harness: ModuleType, tiny_ckpts: dict[str, Any], aux_on: dict[str, Any],
    record_property: Any,
) -> None:
    rep = aux_on["report"]
    assert rep["model_class"] == "DeepseekV3ForCausalLM"
    assert rep["setup"].source == "draft config"
    assert rep["setup"].draft_architectures == ["LlamaForCausalLMEagle3"]
    nums = harness.compare_aux_with_hf(
        harness.load_hf_reference(tiny_ckpts["dsv3"]), aux_on,
        tuple(range(tiny_ckpts["dsv3_layers"] + 1)), ATOL,
        min_tokens_checked=0.9 * len(PROMPTS) * MAX_TOKENS,
    )
    for key, value in nums.items():
        record_property(key, value)


def test_greedy_identical_with_aux_on_and_off(
    harness: ModuleType, aux_on: dict[str, Any], aux_off: dict[str, Any]
) -> None:
    assert aux_off["report"]["use_aux_hidden_state_outputs"] is False
    assert aux_off["report"]["setup"] is None
    assert all(s["aux"] is None for s in aux_off["report"]["steps"])
    assert aux_on["prompt_ids"] == aux_off["prompt_ids"]
    assert len({len(p) for p in aux_on["prompt_ids"]}) == len(PROMPTS)
    for got, want in zip(aux_on["output_ids"], aux_off["output_ids"]):
        assert len(got) == MAX_TOKENS
        assert got == want
    # Same schedule (batches, chunks) in both runs: a like-for-like comparison.
    layout = [s["num_scheduled"] for s in aux_on["report"]["steps"]]
    assert layout == [s["num_scheduled"] for s in aux_off["report"]["steps"]]
    for run in (aux_on, aux_off):
        harness.assert_chunked_prefill_and_decode(run, STEP_TOKEN_BUDGET, MAX_TOKENS)


def test_out_of_range_aux_layer_id_fails_before_any_weight_loads(
    harness: ModuleType, tiny_ckpts: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine config refuses the id, from the target's config.json and
    the drafter's alone: no engine process, no model class built, no weight
    read (a Kimi-K2.5 start used to fail only after loading the target)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import base_loader

    def no_load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model was loaded before the ids were checked")

    monkeypatch.setattr(base_loader.BaseModelLoader, "load_model", no_load)
    n = tiny_ckpts["dsv3_layers"]
    args = EngineArgs(
        model=str(tiny_ckpts["dsv3"]), dtype="float32", max_model_len=256,
        enforce_eager=True, speculative_config={
            "method": "eagle3", "model": str(tiny_ckpts["draft_bad_ids"]),
            "num_speculative_tokens": 3,
        },
    )
    start = time.perf_counter()
    with pytest.raises(ValueError) as excinfo:
        args.create_engine_config()
    print(f"\nrefused at config time after {time.perf_counter() - start:.2f} s")
    msg = str(excinfo.value)
    assert f"invalid ids [{n + 1}]" in msg, msg
    assert re.search(rf"\[\s*0\s*,\s*{n}\s*\]", msg), f"no valid range [0, {n}]: {msg}"
    field = "eagle_aux_hidden_state_layer_ids"
    assert f"from the draft model config's {field}" in msg, msg
    assert f"Fix {field} in the draft model's config.json" in msg, msg
    frames = [entry.name for entry in excinfo.traceback]
    assert "create_speculative_config" in frames, frames


def test_float16_aux_states_are_the_true_residual_stream(
    harness: ModuleType, tiny_ckpts: dict[str, Any]
) -> None:
    """In float16 DeepseekV2DecoderLayer divides the residual stream by
    routed_scaling_factor (2.5, as in DeepSeek-V3) against overflow. The
    logits do not see it (RMSNorm), a drafter trained on unscaled bfloat16
    states would: per id the least-squares scale against the float32 HF
    reference must be 1 within float16 noise, not 1/2.5."""
    n = tiny_ckpts["dsv3_layers"]
    hf_model = harness.load_hf_reference(tiny_ckpts["dsv3"])
    assert hf_model.config.routed_scaling_factor == 2.5
    run = harness.run_prompts(
        tiny_ckpts["dsv3"], tiny_ckpts["draft_all_ids"],
        ["Hi", "EAGLE-3 drafts tokens; the target v3."],
        max_tokens=4, step_budget=64, dtype="float16",
    )
    assert run["report"]["setup"].aux_layers == tuple(range(n + 1))
    scales: dict[int, list[float]] = {}
    errors: dict[int, list[float]] = {}
    for prompt, output, req in zip(
        run["prompt_ids"], run["output_ids"], harness.run_rows(run)
    ):
        ref = harness.hf_states(hf_model, prompt + output[:-1])
        for layer_id, got in zip(range(n + 1), req.aux, strict=True):
            assert got.dtype == torch.float16
            want, got = ref.by_id[layer_id], got.float()
            scale = (got * want).sum() / (want * want).sum()
            rel_err = (got - want).norm() / want.norm()
            scales.setdefault(layer_id, []).append(round(scale.item(), 4))
            errors.setdefault(layer_id, []).append(round(rel_err.item(), 4))
    print(f"\nfloat16 vs float32 reference, per id: scale {scales}, error {errors}")
    # Unscaled, ids >= 1 would give scale 0.4 and a relative error >= 0.6;
    # float16 (and the odd expert-routing flip it causes) stays well inside.
    for layer_id in scales:
        assert all(abs(v - 1.0) < 0.05 for v in scales[layer_id]), scales
        assert all(e < 0.2 for e in errors[layer_id]), errors


PUBLISHED = Path(__file__).parents[2] / "v1" / "spec_decode" / "published_configs"
STRUCTURE = (
    "num_hidden_layers", "first_k_dense_replace", "n_group", "topk_group",
    "topk_method", "scoring_func", "routed_scaling_factor", "norm_topk_prob",
)


def test_nested_ids_of_a_published_drafter_on_a_shrunk_published_target(
    harness: ModuleType, tmp_path: Path
) -> None:
    """The published DeepSeek-R1-0528 layer and routing structure (61 layers,
    3 dense, grouped routing) at CPU widths, with SpecForge's DeepSeek-V3
    drafter ids where it has them, in eagle_config only: v0.16.0 ignored that
    field and fed the default layers."""
    def published(name: str) -> dict:
        return json.loads((PUBLISHED / name / "config.json").read_text())

    real_target = published("deepseek-r1-0528-target-ttmetal")
    real_draft = published("specforge-deepseek-v3-671b-eagle3")
    ids = real_draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert "eagle_aux_hidden_state_layer_ids" not in real_draft
    tc = harness.load_tiny_checkpoints()
    target = tc.write_checkpoint(
        "deepseek-v3", tmp_path / "target", seed=11, n_routed_experts=16,
        num_experts_per_tok=4, **{k: real_target[k] for k in STRUCTURE},
    ).outdir
    draft = tc.write_checkpoint(
        "eagle3-drafter", tmp_path / "draft", seed=12, aux_layer_ids=ids
    ).outdir
    # As SpecForge writes it: the ids in eagle_config only.
    config_path = Path(draft) / "config.json"
    config = json.loads(config_path.read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    config_path.write_text(json.dumps(config))

    run = harness.run_prompts(
        target, draft, ["Hi", "EAGLE-3 drafts tokens; the target v3."],
        max_tokens=3, step_budget=64,
    )
    assert run["report"]["setup"].source == "draft config"
    hf_model = harness.load_hf_reference(target)
    assert hf_model.config.num_hidden_layers == 61
    harness.compare_aux_with_hf(hf_model, run, tuple(ids), 2e-4, min_margin=100)


KIMI_PROMPTS = [
    "Kimi",
    "Moonshot's K2.5 wraps a DeepSeek-V3 text model.",
    "Text-only prompts never reach the vision tower, but it is loaded.",
]
KIMI_MAX_TOKENS = 8


def test_aux_states_match_hf_kimi_k25(
    harness: ModuleType, tiny_ckpts: dict[str, Any], record_property: Any
) -> None:
    """KimiK25ForConditionalGeneration (vision tower and projector built and
    loaded) around an 8-layer DeepSeek-V3; text prompts. The draft config has
    no ids, so the runner takes the model default (2, n // 2, n - 3), which
    the wrapper must delegate to its language model."""
    n = tiny_ckpts["kimi_layers"]
    run = harness.run_prompts(
        tiny_ckpts["kimi"], tiny_ckpts["draft_default_ids"], KIMI_PROMPTS,
        max_tokens=KIMI_MAX_TOKENS, step_budget=16,
    )
    rep = run["report"]
    assert rep["model_class"] == "KimiK25ForConditionalGeneration"
    children = rep["children"]
    assert children["vision_tower"] == "MoonViT3dPretrainedModel", children
    assert children["mm_projector"] == "KimiK25MultiModalProjector", children
    assert children["language_model"] == "DeepseekV2ForCausalLM", children
    assert rep["setup"].source == "model default", rep["setup"]
    hf_model = harness.load_hf_reference(
        tiny_ckpts["kimi"], prefix="language_model.", text_key="text_config"
    )
    assert hf_model.config.num_hidden_layers == n
    nums = harness.compare_aux_with_hf(
        hf_model, run, (2, n // 2, n - 3), 2e-4,  # the DeepSeek-V3 tolerance
        min_tokens_checked=0.9 * len(KIMI_PROMPTS) * KIMI_MAX_TOKENS,
    )
    for key, value in nums.items():
        record_property(key, value)
