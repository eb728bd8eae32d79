# SPDX-License-Identifier: Apache-2.0
"""speculators 0.4.x (the real package) against the CPU engine: its training
data, its drafter configs, and the one-layer shift between it and vLLM.

In speculators v0.4.0.1 (commit fb8c4290e53c) id k is the OUTPUT of layer k
(data_generation/custom_worker.py:52-60), i.e. vLLM's id k + 1, and its
converter writes the ids unchanged (convert/eagle/eagle3_converter.py). So a
drafter trained on its data for layers L is served one layer early unless the
ids are shifted (``tools.eagle3_layers convert --from output-of-layer``).

With L = every layer of the tiny DeepSeek-V3 and Kimi-K2.5 targets: its own
generator, on the patched CPU engine, yields for id k HF's input of layer
k + 1 (a regression: it does not use the series); vLLM reads its converter's
drafter with ids L, the tool makes them L + 1, and the engine serving that
drafter captures exactly speculators' states (stock refuses both targets).
The generator's CPU adaptations: ``mem_get_info`` (0 bytes without an
accelerator), float32, the harness's rotary work-around; the Kimi copy gets
the published checkpoint's ``auto_map`` for transformers' AutoConfig.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[3]

try:
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
ATOL = 2e-4  # float32 both sides, as in test_eagle3_cpu_targets.py
MIN_MARGIN = 100.0  # neighbour gap / ATOL, on every token
KV_BYTES = 1 << 30  # what mem_get_info reports instead of 0 on CPU


@pytest.fixture(scope="module", params=("dsv3", "kimi"))
def target(request: pytest.FixtureRequest, harness: ModuleType,
           tiny_ckpts: dict[str, Any]) -> dict[str, Any]:
    name, hf_keys = request.param, {}
    ckpt, n = Path(tiny_ckpts[name]), tiny_ckpts[f"{name}_layers"]
    if name == "kimi":
        # Weights hard-linked; AutoConfig mapped to vLLM's KimiK25Config
        # (vLLM's own config registry still wins over auto_map).
        src, ckpt = ckpt, ckpt.parent / "kimi_autoconfig"
        if not ckpt.exists():
            shutil.copytree(src, ckpt, copy_function=os.link)
            cfg = json.loads((ckpt / "config.json").read_text())
            cfg["auto_map"] = {"AutoConfig": "configuration_kimi_k25.KimiK25Config"}
            (ckpt / "config.json").unlink()  # a hard link: never write through it
            (ckpt / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            (ckpt / "configuration_kimi_k25.py").write_text(
                "from vllm.transformers_utils.configs.kimi_k25 import KimiK25Config"
                "  # noqa: F401\n"
            )
        hf_keys = {"prefix": "language_model.", "text_key": "text_config"}
    hf = harness.load_hf_reference(ckpt, **hf_keys)
    assert hf.config.num_hidden_layers == n
    return {"name": name, "ckpt": ckpt, "n": n, "hf": hf, "L": list(range(n))}


@pytest.fixture(scope="module")
def datagen(harness: ModuleType, target: dict[str, Any]) -> dict[str, Any]:
    """speculators' VllmHiddenStatesGenerator run with layer ids L."""
    from vllm.config import CompilationConfig

    model_config, vllm_config = spec_gen.ModelConfig, spec_gen.VllmConfig
    rotary = {"compilation_config": CompilationConfig(**harness.CPU_COMPILATION_CONFIG)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(spec_gen, "mem_get_info", lambda: (KV_BYTES, KV_BYTES))
        mp.setattr(spec_gen, "ModelConfig",
                   lambda **kw: model_config(**{**kw, "dtype": "float32"}))
        mp.setattr(spec_gen, "VllmConfig", lambda **kw: vllm_config(**{**kw, **rotary}))
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
    root = tmp_path_factory.mktemp(f"spec_drafter_{target['name']}")
    legacy = harness.load_tiny_checkpoints().write_checkpoint(
        "eagle3-drafter", root / "legacy", seed=11, aux_layer_ids=None
    ).outdir
    written, converted = root / "speculators", root / "converted"
    Eagle3Converter().convert(
        legacy, written, base_model=str(target["ckpt"]), validate=False,
        eagle_aux_hidden_state_layer_ids=target["L"],
    )
    proc = subprocess.run(
        [sys.executable, "-m", "tools.eagle3_layers", "convert", str(written),
         "--from", "output-of-layer", "--target", str(target["ckpt"]),
         "--out", str(converted)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"written": written, "converted": converted}


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
    print(f"\nspeculators {SPECULATORS_VERSION} {target['name']}: "
          f"max |spec - HF[k+1]| = {worst:.2e}, min neighbour gap {min_gap:.3f}")
    assert worst <= ATOL
    assert min_gap / ATOL >= MIN_MARGIN


def _draft_hf_config(target_ckpt: Path, draft: Path) -> Any:
    """The draft config as vLLM's SpeculativeConfig loads it for the target."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    target = ModelConfig(model=str(target_ckpt), dtype="float32", max_model_len=256)
    return SpeculativeConfig(
        method="eagle3", model=str(draft), num_speculative_tokens=3,
        target_model_config=target, target_parallel_config=ParallelConfig(),
    ).draft_model_config.hf_config


def test_speculators_drafter_config_is_read_by_vllm_and_converted(
    target: dict[str, Any], spec_drafter: dict[str, Path],
) -> None:
    from vllm.config.speculative import get_eagle3_aux_layer_ids

    L, n, top = target["L"], target["n"], "eagle_aux_hidden_state_layer_ids"
    shifted = [k + 1 for k in L]
    written = json.loads((spec_drafter["written"] / "config.json").read_text())
    assert written["speculators_model_type"] == "eagle3"
    assert written["speculators_version"] == SPECULATORS_VERSION
    assert written[top] == L
    assert "eagle_config" not in written

    # Stock v0.16.0 stops here: its EAGLE-3 allow-list refuses the target.
    hf_written = _draft_hf_config(target["ckpt"], spec_drafter["written"])
    assert get_eagle3_aux_layer_ids(hf_written) == (tuple(L), top)
    hf = _draft_hf_config(target["ckpt"], spec_drafter["converted"])
    assert get_eagle3_aux_layer_ids(hf) == (tuple(shifted), top)
    # Still speculators' format: vLLM converted it the same way.
    assert list(hf.architectures) == list(hf_written.architectures)
    # The converter kept everything but the ids, and recorded the conversion.
    conv = json.loads((spec_drafter["converted"] / "config.json").read_text())
    assert conv.pop(top) == shifted
    assert conv.pop("vllm_eagle3_converted") == {"from": "output-of-layer", "trained_ids": L}
    written.pop(top)
    assert conv == written

    sys.path.append(str(REPO_ROOT))  # never first: the installed vllm must win
    from tools import eagle3_layers

    text = "\n".join(eagle3_layers.show(spec_drafter["converted"], target["ckpt"]))
    assert f"aux ids: {shifted}" in text
    assert "source: top-level eagle_aux_hidden_state_layer_ids" in text
    assert "equivalently: " + ", ".join(f"output of layer {k}" for k in L) in text
    assert f"id {n:>3}: the final norm's input" in text


def test_engine_capture_with_converted_ids_equals_speculators_data(
    harness: ModuleType, target: dict[str, Any], datagen: dict[str, Any],
    spec_drafter: dict[str, Path], record_property: Any,
) -> None:
    L = target["L"]
    run = harness.run_prompts(
        target["ckpt"], spec_drafter["converted"], PROMPTS, max_tokens=2, step_budget=16
    )
    setup = run["report"]["setup"]
    assert setup.source == "draft config", setup
    assert setup.aux_layers == tuple(k + 1 for k in L), setup
    # The engine tokenized the prompts as speculators' tokenizer did.
    assert run["prompt_ids"] == datagen["prompt_ids"]
    worst = 0.0
    rows = harness.run_rows(run)
    for prompt, req, res in zip(run["prompt_ids"], rows, datagen["results"]):
        assert len(req.aux) == len(res["hidden_states"]) == len(L)
        for engine_state, spec_state in zip(req.aux, res["hidden_states"]):
            got = engine_state[: len(prompt)]
            assert got.shape == spec_state.shape
            worst = max(worst, (got - spec_state).abs().max().item())
    record_property("max_abs_engine_vs_speculators", worst)
    print(f"\n{target['name']}: max |engine(L+1) - speculators(L)| = {worst:.2e}")
    assert worst <= ATOL


def test_speculators_version_decides_the_numbering(
    target: dict[str, Any], spec_drafter: dict[str, Path],
) -> None:
    """The config speculators' own converter writes records
    speculators_version; its ids are numbered by output (the test above), so
    vllm-eagle3 says so, and refuses to keep them as vLLM ids."""
    def tool(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tools.eagle3_layers", *args],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)

    written = spec_drafter["written"]
    before = (written / "config.json").read_bytes()
    show = tool("show", str(written), "--json")
    assert show.returncode == 0, show.stderr
    prov = json.loads(show.stdout)["provenance"]
    assert (prov["field"], prov["value"], prov["numbering"]) == (
        "speculators_version", SPECULATORS_VERSION, "output-of-layer")
    proc = tool("convert", str(written), "--from", "input-of-layer")
    assert proc.returncode == 2
    assert "speculators_version says the ids are numbered output-of-layer" in proc.stderr
    assert (written / "config.json").read_bytes() == before
    # What `convert --from output-of-layer` wrote is vLLM's, by its own record.
    show = tool("show", str(spec_drafter["converted"]), "--json")
    prov = json.loads(show.stdout)["provenance"]
    assert (prov["field"], prov["numbering"]) == ("vllm_eagle3_converted", "input-of-layer")
