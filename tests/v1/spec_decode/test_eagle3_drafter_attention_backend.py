# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An EAGLE-3 drafter selects its own attention backend.

--attention-backend (AttentionConfig.backend) used to reach every attention
layer the engine built, the drafter's too: a DeepSeek-V3 target forced to an
MLA backend with a Llama-architecture EAGLE-3 head failed, after the
target's weights were loaded, with "Selected backend ... FLASH_ATTN_MLA is not
valid for this configuration. Reason: [... 'non-MLA not supported']"
(measured on an H200). Now the eagle3 drafter gets automatic selection, or
speculative_config.attention_backend; other methods keep v0.16.0's
behaviour. The CPU platform accepts any backend name, so the end-to-end test
here stands in for CUDA's check that an MLA backend refuses a non-MLA layer.
"""

from __future__ import annotations

import pytest

from vllm.config import (
    AttentionConfig,
    DeviceConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum as B

MLA = dict(q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
           torch_dtype="float32")


@pytest.fixture
def spec(tiny_config, tmp_path, monkeypatch):
    """``spec(method="eagle3", **fields)``: the SpeculativeConfig of the tiny
    Llama-architecture EAGLE-3 head (or, for mtp, of the target's own MTP
    layer; for ngram, of no drafter) on a tiny 8-layer DeepSeek-V3 target."""
    # The registry inspects model classes in a `python -m` subprocess, which
    # from the repository root would import the pristine vllm/ tree there.
    monkeypatch.chdir(tmp_path)
    path = tiny_config("deepseek_v3", "target", num_nextn_predict_layers=1, **MLA)
    target = ModelConfig(model=path, tokenizer=path, skip_tokenizer_init=True)

    def build(method: str = "eagle3", **fields) -> SpeculativeConfig:
        if method == "eagle3":
            fields.setdefault("model", tiny_config("llama_eagle3", "drafter",
                                                   torch_dtype="float32"))
        if method == "ngram":
            fields.setdefault("prompt_lookup_max", 3)
        return SpeculativeConfig(
            method=method, num_speculative_tokens=3, target_model_config=target,
            target_parallel_config=ParallelConfig(), **fields,
        )

    return build


def engine(spec_config: SpeculativeConfig, backend: B | None) -> VllmConfig:
    """The engine's config with the target's backend forced to ``backend``
    (what --attention-backend sets)."""
    # An explicit device: without a GPU the CUDA build cannot infer one.
    return VllmConfig(
        model_config=spec_config.target_model_config,
        speculative_config=spec_config,
        device_config=DeviceConfig(device="cpu"),
        load_config=LoadConfig(load_format="dummy"),
        attention_config=AttentionConfig(
            backend=backend, flash_attn_max_num_splits_for_cuda_graph=8
        ),
    )


def drafter_config(vllm_config: VllmConfig) -> VllmConfig:
    from vllm.v1.spec_decode.utils import create_vllm_config_for_eagle_drafter

    return create_vllm_config_for_eagle_drafter(vllm_config)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("auto", None),
        ("AUTO", None),
        ("flash_attn", B.FLASH_ATTN),
        ("TRITON_ATTN", B.TRITON_ATTN),
        (B.FLASHINFER, B.FLASHINFER),
        (None, None),
    ],
)
def test_attention_backend_parses(spec, value, expected):
    assert spec(attention_backend=value).attention_backend is expected


def test_unset_attention_backend_is_automatic(spec):
    assert spec().attention_backend is None


def test_unknown_attention_backend_names_the_field_and_the_choices(spec):
    with pytest.raises(ValueError) as exc_info:
        spec(attention_backend="flash_mla_typo")
    msg = str(exc_info.value)
    assert "speculative_config.attention_backend='flash_mla_typo'" in msg, msg
    assert "FLASH_ATTN_MLA" in msg and "TRITON_MLA" in msg, msg
    assert "'auto'" in msg, msg


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_attention_backend_refused_for_other_methods(spec, method):
    with pytest.raises(ValueError) as exc_info:
        spec(method=method, attention_backend="TRITON_ATTN")
    msg = str(exc_info.value)
    assert "attention_backend=TRITON_ATTN" in msg, msg
    assert "only supported for the eagle3 method" in msg, msg
    assert f"method {method!r}" in msg, msg
    assert "Remove attention_backend from --speculative-config" in msg, msg
    assert "--attention-backend" in msg, msg


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_auto_is_accepted_for_other_methods(spec, method):
    assert spec(method=method, attention_backend="auto").attention_backend is None


@pytest.mark.parametrize("forced", [B.FLASH_ATTN_MLA, B.TRITON_MLA])
def test_drafter_does_not_inherit_the_targets_forced_backend(spec, forced):
    target = engine(spec(), forced)
    drafter = drafter_config(target)
    assert drafter.attention_config.backend is None
    # The target's config is left as it was.
    assert target.attention_config.backend is forced
    assert drafter is not target
    assert drafter.attention_config is not target.attention_config
    # Only the backend differs; every other config is the target's object,
    # so the drafter's layers register where the proposer looks them up.
    assert drafter.attention_config.flash_attn_max_num_splits_for_cuda_graph == 8
    for name in ("model_config", "cache_config", "parallel_config", "scheduler_config",
                 "compilation_config", "speculative_config", "load_config",
                 "device_config", "quant_config"):
        assert getattr(drafter, name) is getattr(target, name), name
    assert drafter.instance_id == target.instance_id  # __post_init__ not rerun


@pytest.mark.parametrize("forced", [None, B.FLASH_ATTN_MLA])
def test_speculative_attention_backend_is_the_drafters(spec, forced):
    target = engine(spec(attention_backend="triton_attn"), forced)
    assert drafter_config(target).attention_config.backend is B.TRITON_ATTN
    assert target.attention_config.backend is forced


@pytest.mark.parametrize("forced", [None, B.TRITON_ATTN])
def test_same_backend_on_both_sides_needs_no_copy(spec, forced):
    target = engine(spec(attention_backend=forced), forced)
    assert drafter_config(target) is target


def test_tree_attention_stays_on_both_sides(spec):
    # propose() drafts a tree only when the drafter's metadata is TREE_ATTN's.
    target = engine(spec(), B.TREE_ATTN)
    assert drafter_config(target) is target
    with pytest.raises(ValueError, match="TREE_ATTN.*FLASH_ATTN.*Remove attention_backend"):
        drafter_config(engine(spec(attention_backend="FLASH_ATTN"), B.TREE_ATTN))


def test_mtp_drafter_keeps_the_targets_config(spec):
    target = engine(spec(method="mtp"), B.FLASH_ATTN_MLA)
    assert drafter_config(target) is target


@pytest.fixture(scope="module")
def one_process_group(tmp_path_factory):
    """Model construction asks for the tensor-parallel rank: a gloo world of
    one, torn down afterwards so later in-process engines start clean."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        yield
        return
    ps.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"file://{tmp_path_factory.mktemp('dist') / 'init'}",
    )
    ps.ensure_model_parallel_initialized(1, 1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


@pytest.fixture
def selections(monkeypatch, one_process_group):
    """The backend each attention layer built asks the selector for, with
    the platform's answer replaced by CUDA's rule that an MLA backend refuses
    a non-MLA layer (the CPU platform ignores the name) and by CPU_ATTN."""
    from vllm.platforms import current_platform
    from vllm.v1.attention import selector

    seen: list[tuple[B | None, bool]] = []

    def get_attn_backend_cls(selected_backend, attn_selector_config):
        use_mla = attn_selector_config.use_mla
        seen.append((selected_backend, use_mla))
        if selected_backend is not None and selected_backend.name.endswith("MLA") \
                and not use_mla:
            raise ValueError(
                f"Selected backend {selected_backend} is not valid for this "
                "configuration. Reason: ['non-MLA not supported']")
        return B.CPU_ATTN.get_path()

    selector._cached_get_attn_backend.cache_clear()
    monkeypatch.setattr(current_platform, "get_attn_backend_cls", get_attn_backend_cls)
    yield seen
    selector._cached_get_attn_backend.cache_clear()


def _load_drafter(vllm_config: VllmConfig):
    """EagleProposer._get_model() as load_model() calls it: the real loader
    (dummy weights) builds the tiny Llama EAGLE-3 head on the CPU."""
    from vllm.v1.spec_decode.eagle import EagleProposer

    proposer = object.__new__(EagleProposer)
    proposer.vllm_config = vllm_config
    proposer.speculative_config = vllm_config.speculative_config
    return proposer._get_model()


def test_llama_drafter_builds_on_an_mla_forced_target(spec, selections):
    target = engine(spec(), B.FLASH_ATTN_MLA)
    before = set(target.compilation_config.static_forward_context)
    drafter = _load_drafter(target)
    assert drafter.__class__.__name__ == "Eagle3LlamaForCausalLM"
    # The drafter's one attention layer was built under automatic selection.
    assert selections == [(None, False)]
    # Registered where the proposer finds the drafter's layers afterwards.
    assert len(set(target.compilation_config.static_forward_context) - before) == 1
    assert target.attention_config.backend is B.FLASH_ATTN_MLA


def test_speculative_backend_reaches_the_drafters_layers(spec, selections):
    target = engine(spec(attention_backend="FLASH_ATTN"), B.FLASH_ATTN_MLA)
    _load_drafter(target)
    assert selections == [(B.FLASH_ATTN, False)]


@pytest.mark.regression
def test_mtp_drafter_is_loaded_with_the_targets_config(spec, monkeypatch):
    """v0.16.0's behaviour for the other methods: the drafter is built under
    the target's vllm_config, --attention-backend included."""
    from vllm.v1.spec_decode import eagle

    target = engine(spec(method="mtp"), B.FLASH_ATTN_MLA)
    passed = {}
    monkeypatch.setattr(eagle, "get_model", lambda **kwargs: passed.update(kwargs))
    _load_drafter(target)
    assert passed["vllm_config"] is target
    assert passed["model_config"] is target.speculative_config.draft_model_config
