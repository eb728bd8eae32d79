# SPDX-License-Identifier: Apache-2.0
"""speculators 0.4.x (the real package) against the CPU engine: its training
data, its drafter configs, and the one-layer shift between it and vLLM.

speculators' layer numbering, from its source (speculators 0.4.0.1, tag
v0.4.0.1 = commit fb8c4290e53c670403ef219ed65f74be70d77c98 of
vllm-project/speculators; v0.4.0 has the same code):

* src/speculators/data_generation/custom_worker.py:52-60 -- the patched
  decoder forward calls ``layer(...)`` and THEN, if the layer's index is in
  ``layer_ids``, keeps ``hidden_states + residual``: id k is the OUTPUT of
  layer k, which is vLLM's aux id k + 1 (vLLM's id k is layer k's input).
* src/speculators/data_generation/vllm_hidden_states_generator.py:102-116 --
  default ``layer_ids = [2, n // 2, n - 3, n - 1]``, ids must lie in
  [0, n - 1].
* src/speculators/train/data.py:107-112 -- training feeds the drafter
  ``cat(hidden_states[:-1])``; the last id is the verifier's final state.
* src/speculators/convert/eagle/eagle3_converter.py:38,124-131 and
  src/speculators/models/eagle3/config.py:53-56 -- the converter writes the
  ``eagle_aux_hidden_state_layer_ids`` it is given, top-level, unchanged; vLLM
  (transformers_utils/configs/speculators/algos.py, ``update_eagle3``)
  copies them to the top-level field it reads, as inputs of layers.
* src/speculators/models/eagle3/core.py:518-535 -- the trainer's own config
  (``from_training_args``) sets no ids at all.

So a drafter trained on speculators data for layers L, with L written into
its config, is served by vLLM one layer early unless the ids are shifted
(``python -m tools.eagle3_layers convert --from output-of-layer``).

What runs here, for the tiny DeepSeek-V3 (6 layers) and Kimi-K2.5 (8 layers)
targets of conftest.py, with L = every layer (0..n-1):

1. speculators' ``VllmHiddenStatesGenerator`` (its own MultiprocExecutor,
   worker extension and patched forward) on the patched CPU engine. Three
   CPU-only adaptations, made on the names its module imported and nothing
   else: ``mem_get_info`` (speculators/utils/util.py:34-43 reports 0 bytes
   without an accelerator, which leaves no KV cache), ``dtype="float32"`` on
   its ModelConfig (vLLM downcasts float32 to bfloat16 under "auto"; float32
   lets the states be compared at 2e-4), and the CPU harness's compilation
   config (the stock CPU rotary kernel mis-rotates DeepSeek's q_pe, see
   _eagle3_cpu_harness.py). Its layer selection and capture code run as
   shipped. The tiny Kimi-K2.5 copy gets ``auto_map`` to a config module, as
   the published checkpoint ships one, because the generator reads the
   config with transformers' AutoConfig (line 92), which has no kimi_k25.
2. (a) Its states for id k equal transformers' DeepseekV3ForCausalLM
   hidden_states[k + 1] (the input of layer k + 1; for k = n - 1 the last
   layer's output before the final norm), and differ from the neighbours an
   off-by-one would give by far more than the tolerance. Passes on stock
   vLLM too (marked regression): speculators does not use the series.
3. (b) A drafter written by speculators' own ``Eagle3Converter`` with L is
   read by vLLM's SpeculativeConfig (tiny target, method eagle3) with ids L
   from the top level; ``tools.eagle3_layers convert --from output-of-layer``
   turns them into L + 1, which ``show`` reports; the engine started with
   that converted drafter (CPU harness: SpeculativeConfig, the runner's own
   ``_get_eagle3_aux_layers_from_config``, the model's capture) captures, for
   every prompt token, exactly the states speculators generated. Fails on
   stock v0.16.0, whose EAGLE-3 allow-list refuses both targets.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[3]

try:
    import speculators  # noqa: F401
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.data_generation import vllm_hidden_states_generator as spec_gen
except ImportError as exc:  # pragma: no cover - reported as a skip with the reason
    reason = (f"speculators cannot be imported ({exc}); tools/testenv.py installs "
              "speculators==0.4.0.1 into the cpu venv")
    print(f"\nSKIP {__name__}: {reason}")
    pytest.skip(reason, allow_module_level=True)

SPECULATORS_VERSION = importlib.metadata.version("speculators")

PROMPTS = [
    "Hi",
    "speculators captures layer outputs; vLLM, layer inputs.",
    "A drafter fed one layer early loses acceptance and nobody is told.",
]
ATOL = 2e-4  # float32 both sides, as in test_eagle3_cpu_deepseek_v3.py
MIN_MARGIN = 100.0  # neighbour gap / ATOL, on every token
STEP_TOKEN_BUDGET = 16
KV_BYTES = 1 << 30  # what mem_get_info reports instead of 0 on CPU

TARGETS = ("dsv3", "kimi")


def _load_tool() -> ModuleType:
    # Appended (never first): the installed vllm must win over a repo-root
    # vllm/ source tree, here and in the worker processes spawned later.
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))
    from tools import eagle3_layers

    return eagle3_layers


def _kimi_with_config_code(src: Path, dest: Path) -> Path:
    """A copy of the tiny Kimi-K2.5 checkpoint (weights hard-linked) whose
    config.json maps AutoConfig to a config module, as the published
    checkpoint's does. vLLM itself keeps using its registered KimiK25Config
    (its config registry comes before auto_map); the module only serves
    transformers' AutoConfig in speculators' generator, with vLLM's class."""
    if dest.exists():
        return dest
    shutil.copytree(src, dest, copy_function=os.link)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_kimi_k25.KimiK25Config"}
    (dest / "config.json").unlink()  # a hard link: never write through it
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (dest / "configuration_kimi_k25.py").write_text(
        "from vllm.transformers_utils.configs.kimi_k25 import KimiK25Config  # noqa: F401\n"
    )
    return dest


@pytest.fixture(scope="module", params=TARGETS)
def target(request: pytest.FixtureRequest, harness: ModuleType,
           tiny_ckpts: dict[str, Any]) -> dict[str, Any]:
    name = request.param
    ckpt = Path(tiny_ckpts[name])
    n = tiny_ckpts["dsv3_layers" if name == "dsv3" else "kimi_layers"]
    if name == "kimi":
        ckpt = _kimi_with_config_code(ckpt, ckpt.parent / "kimi_autoconfig")
        hf = harness.load_hf_reference(ckpt, prefix="language_model.", text_key="text_config")
    else:
        hf = harness.load_hf_reference(ckpt)
    assert hf.config.num_hidden_layers == n
    return {"name": name, "ckpt": ckpt, "n": n, "hf": hf, "L": list(range(n))}


@contextlib.contextmanager
def _cpu_adapted_generator_module(harness: ModuleType) -> Iterator[None]:
    from vllm.config import CompilationConfig

    model_config, vllm_config = spec_gen.ModelConfig, spec_gen.VllmConfig

    def cpu_model_config(**kwargs: Any) -> Any:
        return model_config(**{**kwargs, "dtype": "float32"})

    def cpu_vllm_config(**kwargs: Any) -> Any:
        kwargs["compilation_config"] = CompilationConfig(**harness.CPU_COMPILATION_CONFIG)
        return vllm_config(**kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(spec_gen, "mem_get_info", lambda: (KV_BYTES, KV_BYTES))
        mp.setattr(spec_gen, "ModelConfig", cpu_model_config)
        mp.setattr(spec_gen, "VllmConfig", cpu_vllm_config)
        yield


@pytest.fixture(scope="module")
def datagen(harness: ModuleType, target: dict[str, Any]) -> dict[str, Any]:
    """speculators' VllmHiddenStatesGenerator run with layer ids L."""
    with _cpu_adapted_generator_module(harness):
        gen = spec_gen.VllmHiddenStatesGenerator(
            str(target["ckpt"]), layer_ids=target["L"], max_model_len=256
        )
    try:
        prompt_ids = [gen.tokenizer(p)["input_ids"] for p in PROMPTS]
        results = gen.generate(prompt_ids)
    finally:
        gen.executor.shutdown()
    assert gen.layer_ids == target["L"]
    return {"prompt_ids": prompt_ids, "results": results}


@pytest.fixture(scope="module")
def spec_drafter(target: dict[str, Any], tmp_path_factory: pytest.TempPathFactory,
                 harness: ModuleType) -> dict[str, Path]:
    """A drafter written by speculators' own converter with ids L (what a user
    who generated data with L passes it), and its tools.eagle3_layers copy."""
    tc = harness.load_tiny_checkpoints()
    root = tmp_path_factory.mktemp(f"spec_drafter_{target['name']}")
    legacy = tc.write_checkpoint("eagle3-drafter", root / "legacy", seed=11,
                                 aux_layer_ids=None).outdir
    written = root / "speculators"
    Eagle3Converter().convert(
        legacy, written, base_model=str(target["ckpt"]), validate=False,
        eagle_aux_hidden_state_layer_ids=target["L"],
    )
    converted = root / "converted"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.eagle3_layers", "convert", str(written),
         "--from", "output-of-layer", "--target", str(target["ckpt"]),
         "--out", str(converted)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"written": Path(written), "converted": converted}


@pytest.mark.regression
def test_speculators_layer_id_k_is_the_output_of_layer_k(
    harness: ModuleType, target: dict[str, Any], datagen: dict[str, Any],
    record_property: Any,
) -> None:
    n, L = target["n"], target["L"]
    worst, min_gap = 0.0, float("inf")
    assert len(datagen["results"]) == len(PROMPTS)
    for prompt, res in zip(datagen["prompt_ids"], datagen["results"]):
        assert res["input_ids"].tolist() == prompt
        assert len(res["hidden_states"]) == len(L)
        ref = harness.hf_states(target["hf"], prompt)
        for k, got in zip(L, res["hidden_states"]):
            want = ref.by_id[k + 1]  # input of layer k + 1 = output of layer k
            assert got.dtype == torch.float32 and got.shape == want.shape
            worst = max(worst, (got - want).abs().max().item())
            # What vLLM would feed with the id unshifted (k), and one past.
            for j in (k, k + 2):
                if 0 <= j <= n:
                    gap = (want - ref.by_id[j]).abs().amax(dim=-1).min().item()
                    min_gap = min(min_gap, gap)
    record_property("max_abs_err", worst)
    record_property("min_neighbour_gap", min_gap)
    print(f"\nspeculators {SPECULATORS_VERSION} {target['name']}: max |spec - HF[k+1]| = "
          f"{worst:.2e}, min neighbour gap {min_gap:.3f}")
    assert worst <= ATOL
    assert min_gap / ATOL >= MIN_MARGIN


def test_speculators_drafter_config_is_read_by_vllm_and_converted(
    target: dict[str, Any], spec_drafter: dict[str, Path],
) -> None:
    L = target["L"]
    written = json.loads((spec_drafter["written"] / "config.json").read_text())
    assert written["speculators_model_type"] == "eagle3"
    assert written["speculators_version"] == SPECULATORS_VERSION
    assert written["eagle_aux_hidden_state_layer_ids"] == L
    assert "eagle_config" not in written

    # Stock v0.16.0 stops here: its EAGLE-3 allow-list refuses the target.
    as_written = _speculative_config(target["ckpt"], spec_drafter["written"])
    from vllm.config.speculative import get_eagle3_aux_layer_ids

    hf = as_written.draft_model_config.hf_config
    assert get_eagle3_aux_layer_ids(hf) == (tuple(L), "eagle_aux_hidden_state_layer_ids")

    converted = _speculative_config(target["ckpt"], spec_drafter["converted"])
    hf = converted.draft_model_config.hf_config
    assert get_eagle3_aux_layer_ids(hf) == (
        tuple(k + 1 for k in L), "eagle_aux_hidden_state_layer_ids")
    # Still speculators' format: vLLM converted it the same way.
    assert list(hf.architectures) == list(as_written.draft_model_config.hf_config.architectures)
    # The converter kept everything but the ids.
    conv = json.loads((spec_drafter["converted"] / "config.json").read_text())
    assert conv.pop("eagle_aux_hidden_state_layer_ids") == [k + 1 for k in L]
    written.pop("eagle_aux_hidden_state_layer_ids")
    assert conv == written

    lines = _load_tool().show(spec_drafter["converted"], target["ckpt"])
    text = "\n".join(lines)
    n = target["n"]
    assert f"aux ids: {[k + 1 for k in L]}" in text
    assert "source: top-level eagle_aux_hidden_state_layer_ids" in text
    assert "equivalently: " + ", ".join(f"output of layer {k}" for k in L) in text
    assert f"id {n:>3}: the final norm's input" in text


def _speculative_config(target_ckpt: Path, draft: Path) -> Any:
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    target_config = ModelConfig(model=str(target_ckpt), dtype="float32", max_model_len=256)
    return SpeculativeConfig(
        method="eagle3", model=str(draft), num_speculative_tokens=3,
        target_model_config=target_config, target_parallel_config=ParallelConfig(),
    )


def test_engine_capture_with_converted_ids_equals_speculators_data(
    harness: ModuleType, target: dict[str, Any], datagen: dict[str, Any],
    spec_drafter: dict[str, Path], record_property: Any,
) -> None:
    L = target["L"]
    run = harness.run_prompts(
        target["ckpt"], spec_drafter["converted"], PROMPTS,
        max_tokens=2, step_budget=STEP_TOKEN_BUDGET,
    )
    setup = run["report"]["setup"]
    assert setup.source == "draft config", setup
    assert setup.aux_layers == tuple(k + 1 for k in L), setup
    # The engine tokenized the prompts as speculators' tokenizer did.
    assert run["prompt_ids"] == datagen["prompt_ids"]
    rows = harness.match_requests(harness.rows_by_request(run["report"]["steps"]),
                                  run["prompt_ids"])
    worst = 0.0
    for prompt, req, res in zip(run["prompt_ids"], rows, datagen["results"]):
        assert len(req.aux) == len(res["hidden_states"]) == len(L)
        for engine_state, spec_state in zip(req.aux, res["hidden_states"]):
            got = engine_state[: len(prompt)]
            assert got.shape == spec_state.shape
            worst = max(worst, (got - spec_state).abs().max().item())
    record_property("max_abs_engine_vs_speculators", worst)
    print(f"\n{target['name']}: max |engine(L+1) - speculators(L)| = {worst:.2e}")
    assert worst <= ATOL
