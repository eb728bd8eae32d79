# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EAGLE-3 settings a DeepSeek-family target cannot serve are refused while
SpeculativeConfig is built, before any weight is loaded, with the error
naming where the bad value came from and what to change. The model's own
load-time check stays as a backstop (tests/models/language/generation).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
from vllm.config import speculative

TOP = "eagle_aux_hidden_state_layer_ids"
PUBLISHED = Path(__file__).parent / "published_configs"
KIMI_K25 = PUBLISHED / "moonshotai-kimi-k25-target"
NESTED = f"eagle_config.{TOP}"
LAYERS = 8
MLA = dict(q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
           torch_dtype="float32")
# Draft configs by kind, without ids: the tiny Llama head, and an MLA one.
DRAFTERS = {
    "llama": ("llama_eagle3", {}),
    "mla": ("deepseek_v3", dict(MLA, architectures=["Eagle3DeepseekV2ForCausalLM"],
                                num_hidden_layers=1, n_routed_experts=None,
                                draft_vocab_size=128)),
}


@pytest.fixture
def warnings(monkeypatch) -> list[str]:
    """The EAGLE-3 WARNINGs SpeculativeConfig logs while the test runs."""
    logged: list[str] = []

    def record(fmt, *args, **kwargs):
        logged.append(fmt % args)

    # warning_once deduplicates per process (lru_cache): record the calls.
    monkeypatch.setattr(speculative.logger, "warning_once", record)
    monkeypatch.setattr(speculative.logger, "warning", record)
    return logged


def spec_config(draft: str, target: str, parallel=None) -> SpeculativeConfig:
    return SpeculativeConfig(
        method="eagle3", model=draft, num_speculative_tokens=3,
        target_model_config=ModelConfig(
            model=target, tokenizer=target, skip_tokenizer_init=True,
            trust_remote_code=False,
        ),
        target_parallel_config=ParallelConfig(**(parallel or {})),
    )


@pytest.fixture
def build(tiny_config, tmp_path, monkeypatch):
    """``build(kind, target_layers=LAYERS, parallel=None, target="deepseek_v3",
    **draft_fields)``: the SpeculativeConfig of a ``kind`` drafter on a tiny
    ``target`` config, with ``parallel`` the ParallelConfig fields."""
    # The registry inspects model classes in a `python -m` subprocess, which
    # from the repository root would import the pristine vllm/ tree there.
    monkeypatch.chdir(tmp_path)

    def make(kind: str, target_layers: int = LAYERS, parallel=None,
             target: str = "deepseek_v3", **fields):
        base, extra = DRAFTERS[kind]
        target_fields = MLA if target == "deepseek_v3" else {}
        target_dir = tiny_config(
            target, f"{target}{target_layers}", num_hidden_layers=target_layers,
            **target_fields,
        )
        draft = tiny_config(base, f"draft_{kind}", **{**extra, **fields})
        return spec_config(draft, target_dir, parallel)

    return make


BAD = [
    ([2, 4, LAYERS + 1], [f"invalid ids [{LAYERS + 1}]", f"[0, {LAYERS}]"]),
    ([-1, 4, 6], ["invalid ids [-1]", f"[0, {LAYERS}]"]),
    ([6, 2, 4], ["not in ascending order", "[2, 4, 6]"]),
    ([2, 4, 4], ["duplicate ids [4]"]),
]


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
@pytest.mark.parametrize("where", ["top_level", "nested"])
@pytest.mark.parametrize("ids, expected", BAD, ids=["past_end", "negative",
                                                    "unsorted", "duplicate"])
def test_bad_draft_ids_refused_at_config_time_naming_their_field(
    build, kind, where, ids, expected
):
    fields = {TOP: ids} if where == "top_level" else {"eagle_config": {TOP: ids}}
    field = TOP if where == "top_level" else NESTED
    with pytest.raises(ValueError) as exc_info:
        build(kind, **fields)
    msg = str(exc_info.value)
    for text in expected:
        assert text in msg, msg
    assert f"from the draft model config's {field}" in msg, msg
    assert f"Fix {field} in the draft model's config.json" in msg, msg


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_a_default_that_does_not_fit_the_target_is_blamed_on_the_default(build, kind):
    # 4 layers: the default (2, n // 2, n - 3) is (2, 2, 1).
    with pytest.raises(ValueError) as exc_info:
        build(kind, target_layers=4)
    msg = str(exc_info.value)
    assert "[2, 2, 1] from the target's default (2, n // 2, n - 3) for n = 4" in msg
    assert "the draft model config's" not in msg
    assert f"Set {TOP} in the draft model's config.json" in msg


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_good_ids_and_the_fitting_default_pass(build, kind):
    assert build(kind, **{TOP: [0, 4, LAYERS]}).method == "eagle3"
    assert build(kind, **{"eagle_config": {TOP: [1, 2, 7]}}).method == "eagle3"
    assert build(kind).method == "eagle3"  # default (2, 4, 5)


def assert_default_warning(msg: str, ids: list[int], n: int) -> None:
    """The no-ids WARNING: the default and why it matters, and the fix."""
    assert "names no aux layer ids" in msg, msg
    assert f"the target's default ids {ids}, (2, n // 2, n - 3) for n = {n}" in msg, msg
    assert "lower acceptance" in msg, msg
    assert f"as the top-level {TOP} of the drafter's config.json" in msg, msg
    assert "tools.eagle3_layers calibrate" in msg, msg


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_no_ids_anywhere_warns_naming_the_default_and_the_fix(build, warnings, kind):
    """Served on the target's default, a drafter trained on other layers
    only accepts less: say so once, at config time (a warning, not a
    refusal: published drafter configs without ids exist)."""
    assert build(kind).method == "eagle3"
    (msg,) = warnings
    assert_default_warning(msg, [2, 4, 5], LAYERS)


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
@pytest.mark.parametrize(
    "fields",
    [{TOP: [1, 4, 7]}, {"eagle_config": {"use_aux_hidden_state": False}}],
    ids=["top_level_ids", "no_aux_states"],
)
def test_ids_or_no_aux_states_no_default_warning(build, warnings, kind, fields):
    build(kind, **fields)
    assert not [w for w in warnings if "names no aux layer ids" in w], warnings


@pytest.mark.regression
def test_no_default_warning_for_a_llama_target(build, warnings):
    # Not a DeepSeek-family target: its default is its own model's.
    build("llama", target="llama")
    assert not [w for w in warnings if "names no aux layer ids" in w], warnings


def test_published_kimi_k25_pair_without_ids_warns(warnings, tmp_path, monkeypatch):
    """TorchSpec's Kimi-K2.5 drafter names no ids: on the published 61-layer
    Kimi-K2.5 config (model_type kimi_k25) it gets (2, 30, 58), and says so."""
    monkeypatch.chdir(tmp_path)
    draft = PUBLISHED / "torchspec-kimi-k25-eagle3"
    assert spec_config(str(draft), str(KIMI_K25)).method == "eagle3"
    (msg,) = [w for w in warnings if "names no aux layer ids" in w]
    assert_default_warning(msg, [2, 30, 58], 61)


def test_bad_ids_refused_on_the_published_kimi_k25_target(tmp_path, monkeypatch):
    """The seeds' own target: SpecForge's Kimi-K2.5 drafter config with one id
    past the 61 layers is refused at config time, before any weight."""
    monkeypatch.chdir(tmp_path)
    published = PUBLISHED / "specforge-kimi-k25-eagle3" / "config.json"
    config = json.loads(published.read_text())
    config["eagle_config"][TOP] = [2, 30, 62]
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as exc_info:
        spec_config(str(tmp_path / "draft"), str(KIMI_K25))
    msg = str(exc_info.value)
    assert "invalid ids [62]" in msg and "[0, 61]" in msg, msg
    assert f"Fix {NESTED} in the draft model's config.json" in msg, msg


def test_no_aux_states_no_id_check(build):
    # use_aux_hidden_state false: the target captures nothing, ids unused.
    eagle_config = {"use_aux_hidden_state": False, TOP: [9, 1]}
    assert build("llama", eagle_config=eagle_config).method == "eagle3"


@pytest.mark.parametrize(
    "kind, target",
    [("llama", "deepseek_v3"), ("mla", "deepseek_v3"), ("llama", "llama")],
    ids=["llama_drafter", "mla_drafter", "llama_target"],
)
def test_pipeline_parallel_refused_with_an_eagle3_message(build, kind, target):
    with pytest.raises(ValueError) as exc_info:
        build(kind, parallel={"pipeline_parallel_size": 2}, target=target,
              **{TOP: [1, 2, 7]})
    msg = str(exc_info.value)
    assert "EAGLE-3" in msg and "pipeline_parallel_size=2" in msg, msg
    assert "--pipeline-parallel-size 1" in msg and "--tensor-parallel-size" in msg, msg


@pytest.mark.regression
def test_stock_already_refuses_pipeline_parallel_eagle3_on_a_llama_target(build):
    """Why the EAGLE-3 PP refusal covers every target: v0.16.0 refuses the
    pair anyway (its only EAGLE-3 drafter class is not SupportsPP); the
    series changes the message, not what is accepted."""
    # Stock raises the registry's NotImplementedError, the series a ValueError.
    with pytest.raises((ValueError, NotImplementedError), match="(?i)pipeline"):
        build("llama", parallel={"pipeline_parallel_size": 2}, target="llama",
              **{TOP: [1, 2, 7]})


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
@pytest.mark.parametrize(
    "parallel, named",
    [({"enable_dbo": True}, "enable_dbo=True"), ({"ubatch_size": 2}, "ubatch_size=2")],
    ids=["dbo", "ubatch_size"],
)
def test_micro_batching_refused_naming_the_flag(build, kind, parallel, named):
    """gpu_ubatch_wrapper torch.cat()s the per-micro-batch model outputs;
    an EAGLE-3 target's output is a (hidden, [aux]) tuple, so DBO would
    crash on the first micro-batched step."""
    with pytest.raises(ValueError) as exc_info:
        build(kind, parallel=parallel, **{TOP: [1, 2, 7]})
    msg = str(exc_info.value)
    assert "EAGLE-3" in msg and "micro-batching" in msg and named in msg, msg
    assert "--enable-dbo" in msg, msg


def test_micro_batching_allowed_when_the_drafter_takes_no_aux_states(build):
    # use_aux_hidden_state false: the target returns a plain tensor.
    config = build("llama", parallel={"enable_dbo": True},
                   eagle_config={"use_aux_hidden_state": False})
    assert config.target_parallel_config.use_ubatching


def test_mla_drafter_claims_no_interface_it_lacks():
    """The drafter used to subclass DeepseekV2ForCausalLM and so claimed
    SupportsPP (flag and intermediate-tensor methods), MoE, LoRA and
    SupportsEagle3; one dense draft layer supports none of them."""
    from vllm.model_executor.models import interfaces
    from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM

    cls = Eagle3DeepseekV2ForCausalLM
    assert not issubclass(cls, DeepseekV2ForCausalLM)
    assert not getattr(cls, "supports_pp", False)
    assert not hasattr(cls, "make_empty_intermediate_tensors")
    assert not interfaces.supports_eagle3(cls)
    assert interfaces.MixtureOfExperts not in cls.__mro__
    # What it does need: the EAGLE flags loading sets and the proposer reads.
    assert interfaces.supports_any_eagle(cls)
    assert cls.has_own_lm_head is False and cls.has_own_embed_tokens is False
