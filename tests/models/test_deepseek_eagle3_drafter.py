# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The EAGLE-3 drafter with a DeepSeek MLA draft layer (deepseek_eagle3.py).

CPU-only and fast. Each test builds the real drafter class from real vLLM
configs (a tiny DeepSeek-V3 target config and a tiny drafter config in the
layout of the published "eagle3-mla" checkpoints, loaded through
SpeculativeConfig, so through EAGLEConfig and the model registry) inside
``set_current_vllm_config`` and a one-process gloo "distributed" group, then
feeds ``load_weights`` a seeded random checkpoint in the published layout
(``midlayer.*``, ``fc``, ``d2t``, ``t2d``, ...).

How the attention layers get built on CPU, honestly:

* The draft layer uses the target's attention kind. With MLA off
  (``VLLM_MLA_DISABLE=1``, which the CPU platform needs: it raises "MLA is not
  supported on CPU") that is ``DeepseekV2Attention``; on the CPU platform it
  is built with the real CPU attention backend, nothing stubbed.
* With MLA on, ``DeepseekV2MLAAttention`` (with its ``fused_qkv_a_proj``) is
  built for real except for one call: MLA backend *selection*, which the CPU
  platform refuses, is replaced by a stub backend class whose impl is never
  run. Weight loading touches parameters only, never the attention kernel,
  so the parameter dict, names, shapes and loaders under test are exactly
  what a GPU build creates.
* Where vLLM has no platform at all (the CUDA wheel imported on a machine
  without a GPU) the non-MLA backend selection is stubbed the same way.

One test runs the drafter's forward (MLA off) with vLLM's paged attention
layer replaced by plain causal attention over a single prefill, and compares
it with the draft step written out by hand from the checkpoint tensors; the
paged attention and the MLA kernels themselves need an engine with KV caches
(tests/e2e/gpu/test_eagle3_mla_drafter_e2e.py runs them on a GPU). Two
regression tests check that DeepseekV2Attention/DeepseekV2MLAAttention built
without an input width are what they were.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

HIDDEN = 128
VOCAB = 320
DRAFT_VOCAB = 256
HEADS = 4
Q_LORA, KV_LORA = 64, 32
NOPE, ROPE, V_DIM = 48, 16, 64
INTER = 256
AUX_IDS = [1, 3, 6]

ATTN = dict(
    num_attention_heads=HEADS,
    num_key_value_heads=HEADS,
    q_lora_rank=Q_LORA,
    kv_lora_rank=KV_LORA,
    qk_nope_head_dim=NOPE,
    qk_rope_head_dim=ROPE,
    v_head_dim=V_DIM,
)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    hidden_act="silu",
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    tie_word_embeddings=False,
    torch_dtype="float32",
    **ATTN,
)
TARGET = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    intermediate_size=INTER,
    moe_intermediate_size=64,
    num_hidden_layers=6,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    topk_method="noaux_tc",
    first_k_dense_replace=2,
    **COMMON,
)
# The shape of the published MLA drafter configs: a DeepSeek-V3 text config
# with one dense layer, the target's attention geometry and EAGLE-3 fields.
DRAFT = dict(
    architectures=["Eagle3DeepseekV2ForCausalLM"],
    model_type="deepseek_v3",
    intermediate_size=INTER,
    num_hidden_layers=1,
    n_routed_experts=None,
    first_k_dense_replace=1,
    draft_vocab_size=DRAFT_VOCAB,
    target_hidden_size=HIDDEN,
    eagle_aux_hidden_state_layer_ids=AUX_IDS,
    **COMMON,
)


# ----------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("eagle3_mla")

    def write(name: str, **config) -> str:
        path = root / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        return str(path)

    return SimpleNamespace(
        root=root,
        target=write("target", **TARGET),
        draft=write("draft", **DRAFT),
        write=write,
    )


@pytest.fixture(scope="module")
def dist_group(tmp_path_factory):
    """A one-process gloo world, as vLLM's parallel layers expect one; torn
    down afterwards so later tests (e.g. in-process engines) start clean."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        yield
        return
    init_file = tmp_path_factory.mktemp("dist") / "init"
    ps.init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"file://{init_file}",
        local_rank=0,
        backend="gloo",
    )
    ps.ensure_model_parallel_initialized(1, 1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


class _StubImpl:
    supports_quant_query_input = False

    def __init__(self, *args, **kwargs) -> None:
        pass

    def process_weights_after_loading(self, act_dtype) -> None:
        pass


class _StubBackend:
    """Stands in for a backend class where the platform selects none; only
    construction asks for it, weight loading never does."""

    accept_output_buffer = True

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the registry's name for out-of-tree backends

    @staticmethod
    def get_impl_cls():
        return _StubImpl

    @staticmethod
    def supports_alibi_sqrt() -> bool:
        return False


@pytest.fixture
def cpu_env(monkeypatch, model_dirs, dist_group):
    # The registry inspects lazily registered models in a `python -m`
    # subprocess; from the repository root that would import the pristine
    # vllm/ tree there instead of the installed package.
    monkeypatch.chdir(model_dirs.root)
    # get_rope() caches rotary modules process-wide, each with the op
    # implementation chosen when it was built; keep this module's out of the
    # cache so a later in-process engine (tests/e2e/cpu) builds its own.
    from vllm.model_executor.layers import rotary_embedding

    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        from vllm.model_executor.layers.attention import attention

        monkeypatch.setattr(
            attention, "get_attn_backend", lambda *a, **k: _StubBackend
        )
    return monkeypatch


def make_vllm_config(
    model_dirs, draft: str | None = None, mla: bool = False, custom_ops=None
):
    from vllm.config import (
        CacheConfig,
        CompilationConfig,
        CompilationMode,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    target = ModelConfig(
        model=model_dirs.target,
        tokenizer=model_dirs.target,
        skip_tokenizer_init=True,
        dtype="float32",
    )
    assert target.use_mla == mla
    spec = SpeculativeConfig(
        method="eagle3",
        model=draft or model_dirs.draft,
        num_speculative_tokens=3,
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
    )
    return VllmConfig(
        model_config=target,
        speculative_config=spec,
        device_config=DeviceConfig("cpu"),
        # Set here because a machine without a vLLM platform sets no default.
        cache_config=CacheConfig(block_size=16),
        # Eager, as with enforce_eager: nothing here is compiled.
        compilation_config=CompilationConfig(
            mode=CompilationMode.NONE, custom_ops=custom_ops or []
        ),
    )


def build_drafter(
    cpu_env, model_dirs, draft: str | None = None, mla: bool = False, custom_ops=None
):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.utils.torch_utils import set_default_torch_dtype

    cpu_env.setenv("VLLM_MLA_DISABLE", "0" if mla else "1")
    if mla:
        from vllm.model_executor.layers.attention import mla_attention

        cpu_env.setattr(mla_attention, "get_attn_backend", lambda *a, **k: _StubBackend)
    vllm_config = make_vllm_config(model_dirs, draft, mla, custom_ops)
    draft_config = vllm_config.speculative_config.draft_model_config
    cls, _ = ModelRegistry.resolve_model_cls(draft_config.architectures, draft_config)
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.float32):
        model = cls(vllm_config=vllm_config, prefix="")
    model._vllm_config_for_test = vllm_config
    return model


def checkpoint(seed: int = 0, prefix: str = "midlayer.") -> dict[str, torch.Tensor]:
    """A random drafter checkpoint in the published eagle3-mla layout."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        if len(shape) == 1:  # norm gains near 1
            return 1.0 + 0.1 * torch.randn(*shape, generator=g)
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    m, a = prefix, f"{prefix}self_attn."
    keep = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[keep] = True
    return {
        "embed_tokens.weight": rand(VOCAB, HIDDEN),
        "fc.weight": rand(HIDDEN, len(AUX_IDS) * HIDDEN),
        f"{m}input_layernorm.weight": rand(HIDDEN),
        f"{m}hidden_norm.weight": rand(HIDDEN),
        f"{m}post_attention_layernorm.weight": rand(HIDDEN),
        f"{a}q_a_proj.weight": rand(Q_LORA, 2 * HIDDEN),
        f"{a}q_a_layernorm.weight": rand(Q_LORA),
        f"{a}q_b_proj.weight": rand(HEADS * (NOPE + ROPE), Q_LORA),
        f"{a}kv_a_proj_with_mqa.weight": rand(KV_LORA + ROPE, 2 * HIDDEN),
        f"{a}kv_a_layernorm.weight": rand(KV_LORA),
        f"{a}kv_b_proj.weight": rand(HEADS * (NOPE + V_DIM), KV_LORA),
        f"{a}o_proj.weight": rand(HIDDEN, HEADS * V_DIM),
        f"{m}mlp.gate_proj.weight": rand(INTER, HIDDEN),
        f"{m}mlp.up_proj.weight": rand(INTER, HIDDEN),
        f"{m}mlp.down_proj.weight": rand(HIDDEN, INTER),
        "norm.weight": rand(HIDDEN),
        "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN),
        "d2t": (keep - torch.arange(DRAFT_VOCAB)).to(torch.int64),
        "t2d": t2d,
    }


def expected_params(ckpt: dict[str, torch.Tensor], fused: bool) -> dict:
    """What each drafter parameter must hold after loading ckpt."""
    L = "model.layers.0."
    out: dict[str, torch.Tensor] = {
        "draft_id_to_target_id": ckpt["d2t"],
        "lm_head.weight": ckpt["lm_head.weight"],
        "model.embed_tokens.weight": ckpt["embed_tokens.weight"],
        "model.fc.weight": ckpt["fc.weight"],
        "model.norm.weight": ckpt["norm.weight"],
    }
    for name, t in ckpt.items():
        if name.startswith("midlayer."):
            out[L + name[len("midlayer.") :]] = t
    gate = out.pop(L + "mlp.gate_proj.weight")
    up = out.pop(L + "mlp.up_proj.weight")
    out[L + "mlp.gate_up_proj.weight"] = torch.cat([gate, up])
    if fused:
        q_a = out.pop(L + "self_attn.q_a_proj.weight")
        kv_a = out.pop(L + "self_attn.kv_a_proj_with_mqa.weight")
        out[L + "self_attn.fused_qkv_a_proj.weight"] = torch.cat([q_a, kv_a])
    return out


def assert_loaded(model, ckpt: dict[str, torch.Tensor], fused: bool) -> None:
    params = dict(model.named_parameters())
    want = expected_params(ckpt, fused)
    # Every parameter is accounted for by a checkpoint tensor and vice versa.
    assert set(params) == set(want)
    for name, tensor in want.items():
        assert params[name].shape == tensor.shape, name
        assert torch.equal(params[name].data, tensor.to(params[name].dtype)), name


# -------------------------------------------------------------------- tests


def test_registry_resolves_mla_drafter_names(cpu_env):
    from vllm.model_executor.models.registry import ModelRegistry

    # DeepseekV3ForCausalLMEagle3: SpecForge's DeepSeek-R1 MLA drafter.
    for arch in (
        "Eagle3DeepseekV2ForCausalLM",
        "Eagle3DeepseekV3ForCausalLM",
        "DeepseekV3ForCausalLMEagle3",
    ):
        assert arch in ModelRegistry.get_supported_archs()
        cls = ModelRegistry._try_load_model_cls(arch)
        assert cls is not None and cls.__name__ == "Eagle3DeepseekV2ForCausalLM"
        assert cls.__module__.endswith("deepseek_eagle3")


@pytest.mark.parametrize("mla", [False, True], ids=["mla_off", "mla_on"])
def test_load_published_layout_consumes_every_tensor(cpu_env, model_dirs, mla):
    model = build_drafter(cpu_env, model_dirs, mla=mla)
    attn = model.model.layers[0].self_attn
    assert type(attn).__name__ == (
        "DeepseekV2MLAAttention" if mla else "DeepseekV2Attention"
    )
    # The first draft layer reads [embeds, hidden]: 2 x hidden wide.
    reads = [attn.fused_qkv_a_proj] if mla else [attn.q_a_proj, attn.kv_a_proj_with_mqa]
    for proj in reads:
        assert proj.weight.shape[1] == 2 * HIDDEN
    assert attn.o_proj.weight.shape == (HIDDEN, HEADS * V_DIM)
    assert model.model.fc.weight.shape == (HIDDEN, len(AUX_IDS) * HIDDEN)
    # Dense MLP, no MoE.
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV2MLP"

    ckpt = checkpoint(seed=1)
    loaded = model.load_weights(iter(ckpt.items()))
    assert loaded == {name for name, _ in model.named_parameters()}
    assert_loaded(model, ckpt, fused=mla)
    assert model.has_own_lm_head and model.has_own_embed_tokens


def test_layers_n_and_model_prefixed_names_load_too(cpu_env, model_dirs):
    model = build_drafter(cpu_env, model_dirs)
    ckpt = checkpoint(seed=2, prefix="layers.0.")
    renamed = {
        ("model." + k if k.startswith("layers.") else k): v for k, v in ckpt.items()
    }
    model.load_weights(iter(renamed.items()))
    midlayer = {k.replace("layers.0.", "midlayer."): v for k, v in ckpt.items()}
    assert_loaded(model, midlayer, fused=False)


def test_unknown_tensor_is_named(cpu_env, model_dirs):
    model = build_drafter(cpu_env, model_dirs)
    ckpt = checkpoint()
    ckpt["midlayer.self_attn.q_proj_extra.weight"] = torch.zeros(4, 4)
    with pytest.raises(ValueError, match=r"midlayer\.self_attn\.q_proj_extra\.weight"):
        model.load_weights(iter(ckpt.items()))
    # A MoE drafter checkpoint does not fit the dense draft layer either.
    ckpt = checkpoint()
    ckpt["midlayer.mlp.experts.0.gate_proj.weight"] = torch.zeros(INTER, HIDDEN)
    with pytest.raises(ValueError, match=r"midlayer\.mlp\.experts\.0\.gate_proj"):
        model.load_weights(iter(ckpt.items()))


@pytest.mark.parametrize(
    "name, bad_shape",
    [
        # fc over two target states although three aux layers are captured
        ("fc.weight", (HIDDEN, 2 * HIDDEN)),
        # a draft layer reading hidden_size instead of [embeds, hidden]
        ("midlayer.self_attn.q_a_proj.weight", (Q_LORA, HIDDEN)),
        ("midlayer.self_attn.kv_a_proj_with_mqa.weight", (KV_LORA + ROPE, HIDDEN)),
        # a too-large tensor, which a sharded loader would silently narrow
        ("midlayer.self_attn.kv_b_proj.weight", (HEADS * (NOPE + V_DIM) + 8, KV_LORA)),
        ("lm_head.weight", (VOCAB, HIDDEN)),
        ("d2t", (VOCAB,)),
    ],
)
def test_shape_mismatch_is_named(cpu_env, model_dirs, name, bad_shape):
    model = build_drafter(cpu_env, model_dirs)
    ckpt = checkpoint()
    ckpt[name] = torch.zeros(bad_shape, dtype=ckpt[name].dtype)
    with pytest.raises(ValueError, match=rf"{name}.*{bad_shape[0]}") as exc_info:
        model.load_weights(iter(ckpt.items()))
    assert "shape" in str(exc_info.value)


def test_missing_or_inconsistent_tensors_are_refused(cpu_env, model_dirs):
    model = build_drafter(cpu_env, model_dirs)
    ckpt = checkpoint()
    del ckpt["midlayer.self_attn.kv_b_proj.weight"]
    with pytest.raises(ValueError, match="kv_b_proj"):
        model.load_weights(iter(ckpt.items()))
    # A 256-token draft vocabulary needs d2t to reach the 320 target ids.
    ckpt = checkpoint()
    del ckpt["d2t"]
    with pytest.raises(ValueError, match="d2t"):
        model.load_weights(iter(ckpt.items()))
    ckpt = checkpoint()
    ckpt["d2t"] = torch.full((DRAFT_VOCAB,), VOCAB, dtype=torch.int64)
    with pytest.raises(ValueError, match="outside"):
        model.load_weights(iter(ckpt.items()))


def test_embed_tokens_and_lm_head_may_come_from_the_target(cpu_env, model_dirs):
    model = build_drafter(cpu_env, model_dirs)
    ckpt = checkpoint()
    del ckpt["embed_tokens.weight"], ckpt["t2d"]
    loaded = model.load_weights(iter(ckpt.items()))
    # Reported as handled so the loader's completeness check passes; the
    # proposer then shares the target's embedding (has_own_embed_tokens unset).
    assert "model.embed_tokens.weight" in loaded
    assert not getattr(model, "has_own_embed_tokens", False)


def test_combine_hidden_states_and_draft_vocab_logits(cpu_env, model_dirs):
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model = build_drafter(cpu_env, model_dirs)
    ckpt = checkpoint(seed=3)
    model.load_weights(iter(ckpt.items()))
    # What the model loader does next (the CPU linear kernels need it).
    model_config = SimpleNamespace(dtype=torch.float32, quantization=None)
    process_weights_after_loading(model, model_config, torch.device("cpu"))
    aux = torch.randn(5, len(AUX_IDS) * HIDDEN)
    combined = model.combine_hidden_states(aux)
    torch.testing.assert_close(combined, aux @ ckpt["fc.weight"].T)

    hidden = torch.randn(5, HIDDEN)
    logits = model.compute_logits(hidden)
    assert logits.shape == (5, VOCAB)
    draft_logits = hidden @ ckpt["lm_head.weight"].T
    target_ids = torch.arange(DRAFT_VOCAB) + ckpt["d2t"]
    assert torch.equal(target_ids, ckpt["t2d"].nonzero().flatten())
    torch.testing.assert_close(logits[:, target_ids], draft_logits)
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[target_ids] = False
    assert torch.isneginf(logits[:, others]).all()


def test_fc_width_follows_the_aux_layer_ids(cpu_env, model_dirs):
    draft = model_dirs.write(
        "draft_two_aux", **{**DRAFT, "eagle_aux_hidden_state_layer_ids": [2, 6]}
    )
    model = build_drafter(cpu_env, model_dirs, draft=draft)
    assert model.model.fc.weight.shape == (HIDDEN, 2 * HIDDEN)
    ckpt = checkpoint()
    with pytest.raises(ValueError, match=r"fc\.weight.*\(128, 256\)"):
        model.load_weights(iter(ckpt.items()))


def test_fc_width_follows_nested_aux_layer_ids(cpu_env, model_dirs):
    # SGLang, SpecForge and TorchSpec keep the ids in eagle_config only.
    config = {k: v for k, v in DRAFT.items() if k != "eagle_aux_hidden_state_layer_ids"}
    draft = model_dirs.write(
        "draft_nested_aux",
        **config,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 4, 6]},
    )
    model = build_drafter(cpu_env, model_dirs, draft=draft)
    assert model.model.fc.weight.shape == (HIDDEN, 4 * HIDDEN)


def test_llama_drafter_loads_and_applies_eagle31_fc_norm(cpu_env, model_dirs):
    """The Llama-architecture drafter with EAGLE-3.1's fc_norm: the
    checkpoint's fc_norm.<i>.weight load, and combine_hidden_states normalises
    each captured state before fc."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    draft = model_dirs.write(
        "draft_llama_eagle31",
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        intermediate_size=INTER,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        draft_vocab_size=VOCAB,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        torch_dtype="float32",
        fc_norm=True,
        norm_output=True,
    )
    model = build_drafter(cpu_env, model_dirs, draft=draft)
    assert model.model.norm_output is True
    g = torch.Generator().manual_seed(7)
    ckpt = {
        name: 1.0 + 0.1 * torch.randn(param.shape, generator=g)
        for name, param in model.named_parameters()
    }
    # Checkpoint names: no "model." prefix, q/k/v and gate/up unfused.
    ckpt = {k.removeprefix("model."): v for k, v in ckpt.items()}
    L = "layers.0."
    qkv = ckpt.pop(L + "self_attn.qkv_proj.weight")
    for part, t in zip(("q", "k", "v"), qkv.split(HIDDEN)):
        ckpt[f"{L}self_attn.{part}_proj.weight"] = t
    gate, up = ckpt.pop(L + "mlp.gate_up_proj.weight").split(INTER)
    ckpt[L + "mlp.gate_proj.weight"], ckpt[L + "mlp.up_proj.weight"] = gate, up
    del ckpt["draft_id_to_target_id"]
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(ckpt)
    model.load_weights(iter(ckpt.items()))
    model_config = SimpleNamespace(dtype=torch.float32, quantization=None)
    process_weights_after_loading(model, model_config, torch.device("cpu"))

    aux = torch.randn(5, 3 * HIDDEN, generator=g)
    normed = torch.cat(
        [_rms(c, ckpt[f"fc_norm.{i}.weight"]) for i, c in enumerate(aux.split(HIDDEN, -1))],
        dim=-1,
    )
    torch.testing.assert_close(
        model.combine_hidden_states(aux), normed @ ckpt["fc.weight"].T
    )


def test_mla_geometry_must_match_the_target(cpu_env, model_dirs):
    draft = model_dirs.write(
        "draft_other_kv_lora", **{**DRAFT, "kv_lora_rank": 2 * KV_LORA}
    )
    with pytest.raises(ValueError, match="kv_lora_rank: drafter 64, target 32"):
        build_drafter(cpu_env, model_dirs, draft=draft, mla=True)


def test_a_drafter_without_mla_fields_is_refused(cpu_env, model_dirs):
    draft = model_dirs.write("draft_no_mla", **{**DRAFT, "kv_lora_rank": None})
    with pytest.raises(ValueError, match="no kv_lora_rank.*LlamaForCausalLMEagle3"):
        build_drafter(cpu_env, model_dirs, draft=draft)


@pytest.mark.regression
@pytest.mark.parametrize("mla", [False, True], ids=["mla_off", "mla_on"])
def test_target_attention_layers_unchanged(cpu_env, model_dirs, mla):
    """Existing callers pass no input width: every projection still reads
    hidden_size features and the parameter set is what it was."""
    from vllm.config import (
        CacheConfig,
        CompilationConfig,
        CompilationMode,
        DeviceConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.models import deepseek_v2

    cpu_env.setenv("VLLM_MLA_DISABLE", "0" if mla else "1")
    if mla:
        from vllm.model_executor.layers.attention import mla_attention

        cpu_env.setattr(mla_attention, "get_attn_backend", lambda *a, **k: _StubBackend)
    target = ModelConfig(
        model=model_dirs.target,
        tokenizer=model_dirs.target,
        skip_tokenizer_init=True,
        dtype="float32",
    )
    vllm_config = VllmConfig(
        model_config=target,
        device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(block_size=16),
        compilation_config=CompilationConfig(mode=CompilationMode.NONE),
    )
    cls = deepseek_v2.DeepseekV2MLAAttention if mla else deepseek_v2.DeepseekV2Attention
    with set_current_vllm_config(vllm_config):
        attn = cls(
            vllm_config=vllm_config,
            config=target.hf_config,
            hidden_size=HIDDEN,
            num_heads=HEADS,
            qk_nope_head_dim=NOPE,
            qk_rope_head_dim=ROPE,
            v_head_dim=V_DIM,
            q_lora_rank=Q_LORA,
            kv_lora_rank=KV_LORA,
            prefix="model.layers.0.self_attn",
        )
    shapes = {n: tuple(p.shape) for n, p in attn.named_parameters()}
    reads = (
        {"fused_qkv_a_proj.weight": (Q_LORA + KV_LORA + ROPE, HIDDEN)}
        if mla
        else {
            "q_a_proj.weight": (Q_LORA, HIDDEN),
            "kv_a_proj_with_mqa.weight": (KV_LORA + ROPE, HIDDEN),
        }
    )
    assert shapes == {
        **reads,
        "q_a_layernorm.weight": (Q_LORA,),
        "q_b_proj.weight": (HEADS * (NOPE + ROPE), Q_LORA),
        "kv_a_layernorm.weight": (KV_LORA,),
        "kv_b_proj.weight": (HEADS * (NOPE + V_DIM), KV_LORA),
        "o_proj.weight": (HIDDEN, HEADS * V_DIM),
    }


# ------------------------------------------------- forward vs. a reference


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_interleaved(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotary embedding on the last dim: pairs (2i, 2i+1)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2).float() / ROPE))
    ang = pos[:, None].float() * inv_freq[None]  # [T, ROPE/2]
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(-2)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)


def reference_draft_step(ckpt, ids, pos, fused, embed):
    """One EAGLE-3 MLA draft step, written out from the checkpoint tensors."""
    m, a = "midlayer.", "midlayer.self_attn."
    T = ids.shape[0]
    x = torch.cat(
        [
            _rms(embed[ids], ckpt[m + "input_layernorm.weight"]),
            _rms(fused, ckpt[m + "hidden_norm.weight"]),
        ],
        dim=-1,
    )  # [T, 2 * HIDDEN]
    q_c = _rms(x @ ckpt[a + "q_a_proj.weight"].T, ckpt[a + "q_a_layernorm.weight"])
    q = (q_c @ ckpt[a + "q_b_proj.weight"].T).view(T, HEADS, NOPE + ROPE)
    kv_a = x @ ckpt[a + "kv_a_proj_with_mqa.weight"].T
    kv_c, k_pe = kv_a.split([KV_LORA, ROPE], dim=-1)
    kv = _rms(kv_c, ckpt[a + "kv_a_layernorm.weight"]) @ ckpt[a + "kv_b_proj.weight"].T
    k_nope, v = kv.view(T, HEADS, NOPE + V_DIM).split([NOPE, V_DIM], dim=-1)
    q_pe = _rope_interleaved(q[..., NOPE:], pos)
    k_pe = _rope_interleaved(k_pe, pos)[:, None].expand(T, HEADS, ROPE)
    q = torch.cat([q[..., :NOPE], q_pe], -1).transpose(0, 1)
    k = torch.cat([k_nope, k_pe], -1).transpose(0, 1)
    scores = (q @ k.transpose(1, 2)) * (NOPE + ROPE) ** -0.5
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    attn = (scores.softmax(-1) @ v.transpose(0, 1)).transpose(0, 1).reshape(T, -1)
    h = attn @ ckpt[a + "o_proj.weight"].T + fused  # residual: the fused state
    residual = h
    h = _rms(h, ckpt[m + "post_attention_layernorm.weight"])
    gate = h @ ckpt[m + "mlp.gate_proj.weight"].T
    up = h @ ckpt[m + "mlp.up_proj.weight"].T
    h = (torch.nn.functional.silu(gate) * up) @ ckpt[m + "mlp.down_proj.weight"].T
    prenorm = h + residual
    return _rms(prenorm, ckpt["norm.weight"]), prenorm


class _CausalAttention(torch.nn.Module):
    """Plain causal attention over one prefill, in place of the paged
    attention layer (which needs an engine's KV cache and metadata)."""

    def __init__(self, heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.heads, self.head_dim, self.scale = heads, head_dim, scale

    def forward(self, q, k, v):
        T = q.shape[0]
        q, k, v = (
            t.reshape(T, self.heads, self.head_dim).transpose(0, 1) for t in (q, k, v)
        )
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale
        )
        return out.transpose(0, 1).reshape(T, self.heads * self.head_dim)


@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle3.1"])
def test_draft_step_matches_a_reference(cpu_env, model_dirs, eagle31):
    """The draft layer's forward (MLA off) equals the EAGLE-3 MLA draft step
    written out by hand: [input_layernorm(embeds), hidden_norm(fused)] into
    the MLA projections, interleaved rope, causal attention, residual = the
    fused state, dense SwiGLU MLP, final norm; and returns the pre-norm
    state for the next step. vLLM's native torch ops are selected
    (custom_ops none), since v0.16.0's CPU rotary kernel mis-rotates the
    strided 3-D q_pe view DeepseekV2Attention passes it (a stock CPU-kernel
    bug unrelated to EAGLE-3); the paged attention layer is replaced by plain
    causal attention. EAGLE-3.1 (fc_norm, norm_output): each captured state
    is RMS-normed with its own fc_norm weight before fc, and the normed
    output, not the pre-norm one, is returned for the next step."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    # (cpu_env gives this test an empty get_rope() cache, so the rotary
    # module is built here, with custom_ops none.)
    draft = None
    ckpt = checkpoint(seed=4)
    if eagle31:
        draft = model_dirs.write("draft_eagle31", **DRAFT, fc_norm=True, norm_output=True)
        g = torch.Generator().manual_seed(6)
        fc_in = [1.0 + 0.2 * torch.randn(HIDDEN, generator=g) for _ in AUX_IDS]
        ckpt.update({f"fc_norm.{i}.weight": w for i, w in enumerate(fc_in)})
    model = build_drafter(cpu_env, model_dirs, draft=draft, custom_ops=["none"])
    loaded = model.load_weights(iter(ckpt.items()))
    assert loaded == {name for name, _ in model.named_parameters()}
    model_config = SimpleNamespace(dtype=torch.float32, quantization=None)
    process_weights_after_loading(model, model_config, torch.device("cpu"))
    attn = model.model.layers[0].self_attn
    attn.attn = _CausalAttention(HEADS, NOPE + ROPE, attn.scaling)

    T = 7
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (T,), generator=g)
    pos = torch.arange(T) + 3
    aux = torch.randn(T, len(AUX_IDS) * HIDDEN, generator=g)
    with set_current_vllm_config(model._vllm_config_for_test), set_forward_context(
        None, model._vllm_config_for_test, num_tokens=T
    ):
        fused = model.combine_hidden_states(aux)
        out, prenorm = model(ids, pos, fused)
    fc_input = aux
    if eagle31:
        chunks = aux.split(HIDDEN, dim=-1)
        fc_input = torch.cat([_rms(c, w) for c, w in zip(chunks, fc_in)], dim=-1)
    ref_out, ref_prenorm = reference_draft_step(
        ckpt, ids, pos, fc_input @ ckpt["fc.weight"].T, ckpt["embed_tokens.weight"]
    )
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    # What the proposer feeds into the next draft step.
    fed_back = ref_out if eagle31 else ref_prenorm
    torch.testing.assert_close(prenorm, fed_back, rtol=1e-4, atol=1e-4)
