# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where EAGLE-3 aux layer ids are read from, and what is logged.

Published drafters keep the ids at the top level of their config or nested
under ``eagle_config`` (SGLang, SpecForge, TorchSpec); v0.16.0 read only the
top level, so a nested-only drafter silently got the target's default layers.

Every toolchain that writes the nested field (SGLang, SpecForge, TorchSpec
training, ModelOpt) numbers layers by output, while vLLM reads it verbatim as
its input-of-layer ids. A drafter fed the wrong layers only accepts less, so
the engine warns once, while its config is built, and top-level ids (what
``tools.eagle3_layers convert`` writes) end the warning.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import LlamaConfig

import vllm.config.speculative as speculative
from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
from vllm.config.speculative import get_eagle3_aux_layer_ids
from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

TOP = "eagle_aux_hidden_state_layer_ids"
NESTED = "eagle_config.eagle_aux_hidden_state_layer_ids"


def draft_config(top=None, nested=None, **fields) -> LlamaConfig:
    """A drafter config as vLLM loads a Llama-architecture one, with ``top``
    and ``nested`` ids where given."""
    if top is not None:
        fields[TOP] = top
    if nested is not None:
        fields["eagle_config"] = {TOP: nested}
    fields["architectures"] = ["LlamaForCausalLMEagle3"]
    return LlamaConfig.from_dict(fields)


@pytest.mark.parametrize(
    "config, expected",
    [
        (dict(top=[1, 29, 57]), ((1, 29, 57), TOP)),
        (dict(nested=[2, 30, 58]), ((2, 30, 58), NESTED)),
        (dict(top=[2, 30, 58], nested=[2, 30, 58]), ((2, 30, 58), TOP)),
    ],
    ids=["top_level", "nested", "equal_in_both"],
)
def test_ids_and_their_source(config, expected):
    assert get_eagle3_aux_layer_ids(draft_config(**config)) == expected


def test_conflicting_ids_name_both():
    with pytest.raises(ValueError) as exc_info:
        get_eagle3_aux_layer_ids(draft_config(top=[3, 31, 59], nested=[2, 30, 58]))
    msg = str(exc_info.value)
    assert f"{TOP}=[3, 31, 59]" in msg
    assert f"{NESTED}=[2, 30, 58]" in msg


@pytest.mark.parametrize("config", [dict(top=30), dict(nested="2,30,58")])
def test_ids_that_are_not_a_list_are_refused(config):
    with pytest.raises(ValueError, match=r"must be a list of target layer ids"):
        get_eagle3_aux_layer_ids(draft_config(**config))


@pytest.mark.parametrize(
    "fields",
    [{}, {TOP: []}, {TOP: None}, {"eagle_config": {"use_aux_hidden_state": True}},
     {"eagle_config": {TOP: []}}],
)
def test_no_ids(fields):
    assert get_eagle3_aux_layer_ids(draft_config(**fields)) is None


class _Target:
    """The target model's EAGLE-3 interface, recording what it is told."""

    layers: tuple[int, ...] | None = None

    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]:
        return (2, 30, 58)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.layers = tuple(layers)


def runner_lines(monkeypatch, hf_config) -> tuple[_Target, list[str]]:
    """GPUModelRunner._set_eagle3_aux_layers on a runner with only the
    attributes it reads; returns the target and the EAGLE-3 lines logged."""
    from vllm import logger as vllm_logger

    runner = object.__new__(GPUModelRunner)
    runner.model = _Target()
    text_config = SimpleNamespace(num_hidden_layers=61)
    runner.model_config = SimpleNamespace(hf_text_config=text_config)
    runner.speculative_config = SimpleNamespace(
        draft_model_config=SimpleNamespace(hf_config=hf_config)
    )
    lines: list[str] = []
    for level in ("info", "warning"):
        monkeypatch.setattr(
            gpu_model_runner.logger, level,
            lambda fmt, *args, level=level, **kw: lines.append(f"{level}: " + fmt % args),
        )
    # info_once remembers messages per process; each call here starts afresh.
    vllm_logger._print_info_once.cache_clear()
    runner._set_eagle3_aux_layers()
    return runner.model, [line for line in lines if "EAGLE-3" in line]


def run_set_aux_layers(monkeypatch, hf_config) -> tuple[_Target, str]:
    target, lines = runner_lines(monkeypatch, hf_config)
    (line,) = lines
    assert line.startswith("info: "), line
    return target, line


def test_runner_uses_nested_ids_and_logs_their_source(monkeypatch):
    target, line = run_set_aux_layers(monkeypatch, draft_config(nested=[2, 30, 58]))
    assert target.layers == (2, 30, 58)
    assert NESTED in line
    assert "id 2 = the input of layer 2 (the output of layer 1)" in line
    assert "id 58 = the input of layer 58 (the output of layer 57)" in line


def test_runner_logs_the_target_default_and_final_layer(monkeypatch):
    target, line = run_set_aux_layers(monkeypatch, draft_config())
    assert target.layers == (2, 30, 58)
    assert "the default of _Target" in line

    target, line = run_set_aux_layers(monkeypatch, draft_config(top=[0, 61]))
    assert target.layers == (0, 61)
    assert f"the draft model config's {TOP}" in line
    assert "id 0 = the embeddings" in line
    assert "id 61 = the output of the last layer (60) before the final norm" in line


# --- the WARNING for nested-only ids (issue 22 item 1) ---

REPO_ROOT = Path(__file__).resolve().parents[3]
LAYERS = 8


def build(tiny_config, monkeypatch, **draft_fields) -> list[str]:
    """SpeculativeConfig for a tiny DeepSeek-V3 target and a Llama drafter
    with ``draft_fields``; returns the WARNINGs logged while building it."""
    target = tiny_config("deepseek_v3", "target", num_hidden_layers=LAYERS)
    draft = tiny_config("llama_eagle3", "draft", **draft_fields)
    return build_from(target, draft, monkeypatch)


def build_from(target: str, draft: str, monkeypatch) -> list[str]:
    warnings: list[str] = []

    def record(fmt, *args, **kwargs):
        warnings.append(fmt % args)

    # warning_once deduplicates per process (lru_cache): record the calls.
    monkeypatch.setattr(speculative.logger, "warning_once", record)
    monkeypatch.setattr(speculative.logger, "warning", record)
    SpeculativeConfig(
        method="eagle3", model=draft, num_speculative_tokens=2,
        target_model_config=ModelConfig(
            model=target, tokenizer=target, skip_tokenizer_init=True, dtype="bfloat16"
        ),
        target_parallel_config=ParallelConfig(),
    )
    return [w for w in warnings if "EAGLE-3" in w]


def test_nested_only_ids_warn_once_with_both_readings_and_the_fix(
    tiny_config, monkeypatch
):
    warnings = build(tiny_config, monkeypatch, eagle_config={TOP: [1, 4, 7]})
    assert len(warnings) == 1, warnings
    (msg,) = warnings
    # Where the ids came from, and that vLLM keeps reading them verbatim.
    assert f"eagle_config.{TOP} = [1, 4, 7]" in msg
    assert "layer 1's input, layer 4's input, layer 7's input" in msg
    # Who writes the field, and what it means read their way.
    for writer in ("SGLang", "SpecForge", "TorchSpec", "ModelOpt"):
        assert writer in msg
    assert "vLLM ids [2, 5, 8] (the outputs of layers [1, 4, 7])" in msg
    # How to decide and how to make it explicit.
    assert "compare the mean acceptance length" in msg
    assert "tools.eagle3_layers calibrate DRAFTER --target TARGET" in msg
    assert "tools.eagle3_layers convert" in msg
    assert f"top-level {TOP}" in msg


def test_warning_names_an_output_reading_past_the_last_layer(tiny_config, monkeypatch):
    (msg,) = build(tiny_config, monkeypatch, eagle_config={TOP: [2, 4, LAYERS]})
    assert f"[{LAYERS + 1}] would be past the target's {LAYERS} layers" in msg


@pytest.mark.parametrize(
    "fields",
    [{TOP: [1, 4, 7]}, {TOP: [1, 4, 7], "eagle_config": {TOP: [1, 4, 7]}}],
    ids=["top_level", "top_level_and_nested"],
)
def test_no_warning_without_nested_only_ids(tiny_config, monkeypatch, fields):
    assert build(tiny_config, monkeypatch, **fields) == []


def test_target_default_gets_the_no_ids_warning_not_this_one(tiny_config, monkeypatch):
    # No ids at all: the default's warning (test_eagle3_config_checks.py).
    (msg,) = build(tiny_config, monkeypatch)
    assert "names no aux layer ids" in msg and "eagle_config." in msg
    assert "the outputs of layers" not in msg


def test_convert_writes_top_level_ids_and_ends_the_warning(
    tiny_config, monkeypatch, tmp_path
):
    target = tiny_config("deepseek_v3", "target", num_hidden_layers=LAYERS)
    draft = tiny_config("llama_eagle3", "draft", eagle_config={TOP: [1, 4, 6]})
    assert len(build_from(target, draft, monkeypatch)) == 1
    out = tmp_path / "draft-vllm"
    subprocess.run(
        [sys.executable, "-m", "tools.eagle3_layers", "convert", draft,
         "--from", "output-of-layer", "--target", target, "--out", str(out)],
        cwd=REPO_ROOT, check=True, capture_output=True, text=True,
    )
    assert json.loads((out / "config.json").read_text())[TOP] == [2, 5, 7]
    assert build_from(target, str(out), monkeypatch) == []


def test_runner_logs_its_line_on_the_first_rank_only(monkeypatch):
    """Every worker runs the runner's load-time block: its INFO line comes
    once per engine (the first rank), not once per rank, and no WARNING
    comes from there."""
    from vllm.distributed import parallel_state

    for first, expected in ((True, 1), (False, 0)):
        monkeypatch.setattr(parallel_state, "is_global_first_rank", lambda f=first: f)
        target, lines = runner_lines(monkeypatch, draft_config(nested=[2, 30, 58]))
        assert target.layers == (2, 30, 58)
        assert len(lines) == expected, lines
        assert all(line.startswith("info: ") for line in lines), lines


# --- eagle_config as a dict or as a config object, read the same everywhere ---


@pytest.mark.parametrize("form", ["dict", "config_object"])
def test_every_eagle_config_reader_takes_both_forms(form):
    """Drafter JSON gives a dict; a config built in code may hold a
    PretrainedConfig. Each reader must get the same answer from both: the
    MTP rewrite guard, the compile-cache factors, the MLA drafter, the
    proposer and the config-time check."""
    from transformers import PretrainedConfig

    from vllm.model_executor.models import deepseek_eagle3
    from vllm.v1.spec_decode.eagle import SpecDecodeBaseProposer

    fields = {"use_aux_hidden_state": False, TOP: [1, 2, 3]}
    hf = LlamaConfig(architectures=["LlamaForCausalLM"])
    hf.eagle_config = fields if form == "dict" else PretrainedConfig(**fields)

    assert SpeculativeConfig.is_eagle3_draft_config(hf)
    assert deepseek_eagle3._use_aux_hidden_state(hf) is False
    assert get_eagle3_aux_layer_ids(hf) == ((1, 2, 3), NESTED)

    spec = object.__new__(SpeculativeConfig)
    draft = SimpleNamespace(hf_config=hf, compute_hash=lambda: "draft")
    object.__setattr__(spec, "draft_model_config", draft)
    assert spec._eagle3_graph_factors() == ["draft", (1, 2, 3), False]
    assert spec._eagle3_uses_aux_states() is False

    proposer = object.__new__(SpecDecodeBaseProposer)
    proposer.method, proposer.draft_model_config = "eagle3", draft
    assert proposer._get_eagle3_use_aux_hidden_state_from_config() is False


@pytest.mark.parametrize("value", ["{\"use_aux_hidden_state\": false}", [2, 30, 58]],
                         ids=["string", "list"])
def test_an_eagle_config_that_is_not_an_object_is_refused_in_one_line(
        value, tiny_config, monkeypatch):
    """config.json with eagle_config as a string (a JSON object quoted once
    too often) or a list: before, the first reader raised AttributeError
    ('str' object has no attribute 'to_dict') while SpeculativeConfig was
    built. Now every reader refuses it with one line naming the field."""
    with pytest.raises(ValueError) as direct:
        get_eagle3_aux_layer_ids(draft_config(eagle_config=value))
    msg = str(direct.value)
    assert msg.startswith("The draft model config's eagle_config must be a JSON object")
    assert f"got {type(value).__name__} {value!r}" in msg and "\n" not in msg

    target = tiny_config("deepseek_v3", "target", num_hidden_layers=LAYERS)
    draft = tiny_config("llama_eagle3", "draft", eagle_config=value)
    with pytest.raises(ValueError, match="eagle_config must be a JSON object"):
        build_from(target, draft, monkeypatch)
