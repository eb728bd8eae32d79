# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The EAGLE-3 drafter with a DeepSeek MLA draft layer (deepseek_eagle3.py).

CPU-only: the real drafter is built from tiny configs in the published
"eagle3-mla" layout and loads a seeded random checkpoint. Only MLA backend
selection (refused on CPU) is stubbed; weight loading never reaches a kernel,
so parameter names, shapes and loaders are what a GPU build creates. Paged and
MLA attention kernels run in tests/e2e/gpu/test_eagle3_mla_drafter_e2e.py.
"""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

HIDDEN, VOCAB, DRAFT_VOCAB, HEADS, INTER = 128, 320, 256, 4, 256
Q_LORA, KV_LORA = 64, 32
NOPE, ROPE, V_DIM = 48, 16, 64
AUX_IDS = [1, 3, 6]

COMMON = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
    hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False,
    torch_dtype="float32", num_attention_heads=HEADS, num_key_value_heads=HEADS,
    q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE,
    qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
)
TARGET = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
    moe_intermediate_size=64, num_hidden_layers=6, n_routed_experts=8,
    num_experts_per_tok=2, n_group=4, topk_group=2, topk_method="noaux_tc",
    first_k_dense_replace=2, **COMMON,
)
# The published MLA drafter configs: a DeepSeek-V3 text config with one dense
# layer, the target's attention geometry and the EAGLE-3 fields.
DRAFT = dict(
    architectures=["Eagle3DeepseekV2ForCausalLM"], model_type="deepseek_v3",
    num_hidden_layers=1, n_routed_experts=None, first_k_dense_replace=1,
    draft_vocab_size=DRAFT_VOCAB, target_hidden_size=HIDDEN,
    eagle_aux_hidden_state_layer_ids=AUX_IDS, **COMMON,
)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("eagle3_mla")

    def write(name: str, **config) -> str:
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        return str(root / name)

    return SimpleNamespace(
        root=root, target=write("target", **TARGET), draft=write("draft", **DRAFT),
        write=write,
    )


@pytest.fixture(scope="module")
def dist_group(tmp_path_factory):
    """A one-process gloo world; torn down so later in-process engines start
    clean."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        yield
        return
    init_file = tmp_path_factory.mktemp("dist") / "init"
    ps.init_distributed_environment(
        world_size=1, rank=0, distributed_init_method=f"file://{init_file}",
        local_rank=0, backend="gloo",
    )
    ps.ensure_model_parallel_initialized(1, 1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


class _StubImpl:
    supports_quant_query_input = False
    process_weights_after_loading = staticmethod(lambda act_dtype: None)

    def __init__(self, *args, **kwargs) -> None:
        pass


class _StubBackend:
    """A backend class where the platform selects none; only construction asks
    for it, weight loading never does."""

    accept_output_buffer = True
    get_name = staticmethod(lambda: "CUSTOM")  # the name for out-of-tree backends
    get_impl_cls = staticmethod(lambda: _StubImpl)
    supports_alibi_sqrt = staticmethod(lambda: False)


@pytest.fixture
def cpu_env(monkeypatch, model_dirs, dist_group):
    # The registry's `python -m` subprocess would import the repository root's
    # pristine vllm/ tree instead of the installed package.
    monkeypatch.chdir(model_dirs.root)
    # get_rope() caches rotary modules process-wide with the op implementation
    # chosen at build time; keep ours out of a later in-process engine's way.
    from vllm.model_executor.layers import rotary_embedding
    from vllm.platforms import current_platform

    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})
    if not current_platform.is_cpu():  # the CUDA wheel on a machine without GPU
        from vllm.model_executor.layers.attention import attention

        monkeypatch.setattr(attention, "get_attn_backend", lambda *a, **k: _StubBackend)
    return monkeypatch


def make_vllm_config(cpu_env, model_dirs, mla=False, draft=None, custom_ops=()):
    """The target's VllmConfig, with an EAGLE-3 drafter when draft is given.
    The CPU platform only builds attention with MLA off (VLLM_MLA_DISABLE=1)."""
    from vllm.config import (
        CacheConfig, CompilationConfig, CompilationMode, DeviceConfig,
        ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig,
    )

    cpu_env.setenv("VLLM_MLA_DISABLE", "0" if mla else "1")
    if mla:
        from vllm.model_executor.layers.attention import mla_attention

        cpu_env.setattr(mla_attention, "get_attn_backend", lambda *a, **k: _StubBackend)
    target = ModelConfig(
        model=model_dirs.target, tokenizer=model_dirs.target,
        skip_tokenizer_init=True, dtype="float32",
    )
    assert target.use_mla == mla
    spec = draft and SpeculativeConfig(
        method="eagle3", model=draft, num_speculative_tokens=3,
        target_model_config=target, target_parallel_config=ParallelConfig(),
    )
    return VllmConfig(
        model_config=target, speculative_config=spec,
        device_config=DeviceConfig("cpu"),
        # A machine without a vLLM platform sets no default block size.
        cache_config=CacheConfig(block_size=16),
        compilation_config=CompilationConfig(
            mode=CompilationMode.NONE, custom_ops=list(custom_ops)
        ),
    )


def build_drafter(cpu_env, model_dirs, draft=None, mla=False, custom_ops=()):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.utils.torch_utils import set_default_torch_dtype

    draft = draft or model_dirs.draft
    vllm_config = make_vllm_config(cpu_env, model_dirs, mla, draft, custom_ops)
    draft_config = vllm_config.speculative_config.draft_model_config
    cls, _ = ModelRegistry.resolve_model_cls(draft_config.architectures, draft_config)
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.float32):
        model = cls(vllm_config=vllm_config, prefix="")
    model._vllm_config_for_test = vllm_config
    return model


def finish_loading(model) -> None:
    """What the model loader does after load_weights (CPU linears need it)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model_config = SimpleNamespace(dtype=torch.float32, quantization=None)
    process_weights_after_loading(model, model_config, torch.device("cpu"))


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
        "norm.weight": rand(HIDDEN), "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN),
        "d2t": (keep - torch.arange(DRAFT_VOCAB)).to(torch.int64), "t2d": t2d,
    }


def assert_loaded(model, ckpt: dict[str, torch.Tensor], fused: bool) -> None:
    """Every parameter holds its checkpoint tensor, and nothing is left over."""
    L = "model.layers.0."
    want = {
        "draft_id_to_target_id": ckpt["d2t"],
        "lm_head.weight": ckpt["lm_head.weight"],
        "model.embed_tokens.weight": ckpt["embed_tokens.weight"],
        "model.fc.weight": ckpt["fc.weight"],
        "model.norm.weight": ckpt["norm.weight"],
    }
    for name, t in ckpt.items():
        if name.startswith("midlayer."):
            want[L + name.removeprefix("midlayer.")] = t
    gate, up = want.pop(L + "mlp.gate_proj.weight"), want.pop(L + "mlp.up_proj.weight")
    want[L + "mlp.gate_up_proj.weight"] = torch.cat([gate, up])
    if fused:
        q_a = want.pop(L + "self_attn.q_a_proj.weight")
        kv_a = want.pop(L + "self_attn.kv_a_proj_with_mqa.weight")
        want[L + "self_attn.fused_qkv_a_proj.weight"] = torch.cat([q_a, kv_a])
    params = dict(model.named_parameters())
    assert set(params) == set(want)
    for name, tensor in want.items():
        assert params[name].shape == tensor.shape, name
        assert torch.equal(params[name].data, tensor.to(params[name].dtype)), name


def test_registry_resolves_mla_drafter_names(cpu_env):
    from vllm.model_executor.models.registry import ModelRegistry

    # DeepseekV3ForCausalLMEagle3: SpecForge's DeepSeek-R1 MLA drafter.
    for arch in ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM",
                 "DeepseekV3ForCausalLMEagle3"):
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
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV2MLP"  # no MoE

    ckpt = checkpoint(seed=1)
    loaded = model.load_weights(iter(ckpt.items()))
    assert loaded == {name for name, _ in model.named_parameters()}
    assert_loaded(model, ckpt, fused=mla)
    assert model.has_own_lm_head and model.has_own_embed_tokens


def test_embed_input_ids_merges_multimodal_embeddings(cpu_env, model_dirs):
    """On an image prompt of a multimodal target (Kimi-K2.5) the proposer
    passes the target's media embeddings and their mask: the drafter must
    draft from them, not from the placeholder token's text embedding."""
    model = build_drafter(cpu_env, model_dirs)
    model.load_weights(iter(checkpoint(seed=3).items()))
    ids = torch.tensor([5, 7, 7, 7, 9])
    is_mm = torch.tensor([False, True, True, True, False])
    media = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(4))
    text = model.embed_input_ids(ids)
    got = model.embed_input_ids(ids, multimodal_embeddings=[media], is_multimodal=is_mm)
    torch.testing.assert_close(got[is_mm], media, rtol=0, atol=0)
    torch.testing.assert_close(got[~is_mm], text[~is_mm], rtol=0, atol=0)
    # Text-only calls (and the proposer's probe with None) are unchanged.
    torch.testing.assert_close(
        model.embed_input_ids(ids, multimodal_embeddings=None), text, rtol=0, atol=0
    )


def test_loads_through_auto_weights_loader(cpu_env, model_dirs, monkeypatch):
    """vLLM's AutoWeightsLoader dispatches the mapped names (upstream
    review's ask); the drafter adds only the renaming and its checks."""
    from vllm.model_executor.models import utils

    calls: list[str] = []
    original = utils.AutoWeightsLoader.load_weights

    def recording(self, weights, *args, **kwargs):
        calls.append(type(self.module).__name__)
        return original(self, weights, *args, **kwargs)

    monkeypatch.setattr(utils.AutoWeightsLoader, "load_weights", recording)
    model = build_drafter(cpu_env, model_dirs)
    ckpt = checkpoint(seed=5)
    assert model.load_weights(iter(ckpt.items())) == {
        name for name, _ in model.named_parameters()
    }
    assert calls == ["Eagle3DeepseekV2ForCausalLM"]
    assert_loaded(model, ckpt, fused=False)


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
    for name, shape in [
        ("midlayer.self_attn.q_proj_extra.weight", (4, 4)),
        # A MoE drafter checkpoint does not fit the dense draft layer either.
        ("midlayer.mlp.experts.0.gate_proj.weight", (INTER, HIDDEN)),
    ]:
        ckpt = {**checkpoint(), name: torch.zeros(shape)}
        with pytest.raises(ValueError, match=re.escape(name)):
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
    # A 256-token draft vocabulary needs d2t to reach the 320 target ids.
    out_of_range = torch.full((DRAFT_VOCAB,), VOCAB, dtype=torch.int64)
    for name, value, match in [
        ("midlayer.self_attn.kv_b_proj.weight", None, "kv_b_proj"),
        ("d2t", None, "d2t"),
        ("d2t", out_of_range, "outside"),
    ]:
        ckpt = checkpoint()
        del ckpt[name]
        if value is not None:
            ckpt[name] = value
        with pytest.raises(ValueError, match=match):
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
    model = build_drafter(cpu_env, model_dirs)
    ckpt = checkpoint(seed=3)
    model.load_weights(iter(ckpt.items()))
    finish_loading(model)
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


@pytest.mark.parametrize(
    ("aux", "nested"), [([2, 6], False), ([1, 2, 4, 6], True)],
    ids=["top_level", "eagle_config"],
)
def test_fc_width_follows_the_aux_layer_ids(cpu_env, model_dirs, aux, nested):
    # SGLang, SpecForge and TorchSpec keep the ids in eagle_config only.
    config = {k: v for k, v in DRAFT.items() if k != "eagle_aux_hidden_state_layer_ids"}
    ids = {"eagle_aux_hidden_state_layer_ids": aux}
    config.update({"eagle_config": ids} if nested else ids)
    draft = model_dirs.write(f"draft_{len(aux)}_aux", **config)
    model = build_drafter(cpu_env, model_dirs, draft=draft)
    width = len(aux) * HIDDEN
    assert model.model.fc.weight.shape == (HIDDEN, width)
    with pytest.raises(ValueError, match=rf"fc\.weight.*\({HIDDEN}, {width}\)"):
        model.load_weights(iter(checkpoint().items()))


# The Llama-architecture EAGLE-3 drafter (llama_eagle3.py) on the same target.
LLAMA_DRAFT = dict(
    architectures=["LlamaForCausalLMEagle3"], model_type="llama",
    intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=HEADS,
    num_key_value_heads=HEADS, vocab_size=VOCAB, hidden_size=HIDDEN,
    draft_vocab_size=VOCAB, max_position_embeddings=4096, rms_norm_eps=1e-6,
    torch_dtype="float32",
    # The 6-layer target's default (2, 3, 3) repeats an id: refused.
    eagle_aux_hidden_state_layer_ids=[1, 3, 5],
)


def test_llama_drafter_loads_and_applies_eagle31_fc_norm(cpu_env, model_dirs):
    """EAGLE-3.1's fc_norm on the Llama drafter: fc_norm.<i>.weight load, and
    combine_hidden_states normalises each captured state before fc."""
    draft = model_dirs.write(
        "draft_llama_eagle31", **LLAMA_DRAFT, fc_norm=True, norm_output=True
    )
    model = build_drafter(cpu_env, model_dirs, draft=draft)
    assert model.model.norm_output is True
    g = torch.Generator().manual_seed(7)
    # Checkpoint names: no "model." prefix, q/k/v and gate/up unfused.
    ckpt = {
        name.removeprefix("model."): 1.0 + 0.1 * torch.randn(param.shape, generator=g)
        for name, param in model.named_parameters()
    }
    L = "layers.0."
    qkv = ckpt.pop(L + "self_attn.qkv_proj.weight")
    for part, t in zip(("q", "k", "v"), qkv.split(HIDDEN)):
        ckpt[f"{L}self_attn.{part}_proj.weight"] = t
    gate, up = ckpt.pop(L + "mlp.gate_up_proj.weight").split(INTER)
    ckpt[L + "mlp.gate_proj.weight"], ckpt[L + "mlp.up_proj.weight"] = gate, up
    del ckpt["draft_id_to_target_id"]
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(ckpt)
    model.load_weights(iter(ckpt.items()))
    finish_loading(model)

    aux = torch.randn(5, 3 * HIDDEN, generator=g)
    chunks = enumerate(aux.split(HIDDEN, -1))
    normed = torch.cat([_rms(c, ckpt[f"fc_norm.{i}.weight"]) for i, c in chunks], -1)
    torch.testing.assert_close(
        model.combine_hidden_states(aux), normed @ ckpt["fc.weight"].T
    )


def test_llama_drafter_feeds_back_the_normed_state_with_norm_output(
    cpu_env, model_dirs
):
    """EAGLE-3.1's norm_output on the Llama drafter: the state fed into the
    next draft step is the final norm's output, RMSNorm of the pre-norm sum
    the same drafter feeds back without the flag (v0.16.0's behaviour); the
    state the logits are computed from is the same either way."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    models = {
        flag: build_drafter(
            cpu_env, model_dirs, custom_ops=["none"],
            draft=model_dirs.write(f"draft_llama_norm_output_{flag}", **LLAMA_DRAFT,
                                   norm_output=flag),
        )
        for flag in (False, True)
    }
    assert models[True].model.norm_output is True
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in models[False].parameters():
            if param.dtype.is_floating_point:
                noise = torch.randn(param.shape, generator=g)
                param.copy_(1.0 + 0.1 * noise if param.dim() == 1
                            else noise / param.shape[-1] ** 0.5)
    models[True].load_state_dict(models[False].state_dict())

    T = 6
    ids = torch.randint(0, VOCAB, (T,), generator=g)
    pos = torch.arange(T) + 2
    aux = torch.randn(T, 3 * HIDDEN, generator=g)
    outs = {}
    for flag, model in models.items():
        finish_loading(model)
        attn = model.model.layers[0].self_attn
        attn.attn = _CausalAttention(attn.scaling)
        cfg = model._vllm_config_for_test
        with set_current_vllm_config(cfg), set_forward_context(None, cfg, num_tokens=T):
            outs[flag] = model(ids, pos, model.combine_hidden_states(aux))
    (out, prenorm), (out_31, fed_back_31) = outs[False], outs[True]
    norm = models[True].model.norm.weight.detach()
    torch.testing.assert_close(out, _rms(prenorm, norm), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_31, out)
    torch.testing.assert_close(fed_back_31, _rms(prenorm, norm), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(fed_back_31, prenorm, atol=1e-3)


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
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models import deepseek_v2

    vllm_config = make_vllm_config(cpu_env, model_dirs, mla)
    cls = deepseek_v2.DeepseekV2MLAAttention if mla else deepseek_v2.DeepseekV2Attention
    with set_current_vllm_config(vllm_config):
        attn = cls(
            vllm_config=vllm_config, config=vllm_config.model_config.hf_config,
            hidden_size=HIDDEN, num_heads=HEADS, qk_nope_head_dim=NOPE,
            qk_rope_head_dim=ROPE, v_head_dim=V_DIM, q_lora_rank=Q_LORA,
            kv_lora_rank=KV_LORA, prefix="model.layers.0.self_attn",
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


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


# TorchSpec's Kimi-K2.5 eagle3-mla drafter's rope_scaling, as published.
YARN = {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"}


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _inv_freq(yarn: dict | None) -> torch.Tensor:
    """RoPE frequencies; with YaRN (DeepSeek's form), those of the dims that
    rotate less than beta_slow times over the original context are divided by
    the factor, those above beta_fast kept, with a linear ramp between."""
    base = 10000.0
    inv = 1.0 / (base ** (torch.arange(0, ROPE, 2).float() / ROPE))
    if yarn is None:
        return inv
    orig, factor = yarn["original_max_position_embeddings"], yarn["factor"]

    def dim_of(rotations: float) -> float:
        return ROPE * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_of(yarn["beta_fast"])), 0)
    high = min(math.ceil(dim_of(yarn["beta_slow"])), ROPE - 1)
    ramp = ((torch.arange(ROPE // 2).float() - low) / ((high - low) or 0.001)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: the original frequency, 0: interpolated
    return inv / factor * (1 - keep) + inv * keep


def _rope_interleaved(x: torch.Tensor, pos: torch.Tensor, yarn=None) -> torch.Tensor:
    """DeepSeek's rotary embedding on the last dim: pairs (2i, 2i+1)."""
    ang = pos[:, None].float() * _inv_freq(yarn)[None]  # [T, ROPE/2]
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(-2)
    # YaRN scales cos/sin by mscale / mscale_all_dim: 1 in the published configs.
    m = 1.0 if yarn is None else (_yarn_mscale(yarn["factor"], yarn["mscale"])
                                  / _yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]))
    cos, sin = ang.cos() * m, ang.sin() * m
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)


def reference_draft_step(ckpt, ids, pos, fused, embed, yarn=None):
    """One EAGLE-3 MLA draft step, written out from the checkpoint tensors."""
    m, a = "midlayer.", "midlayer.self_attn."
    T = ids.shape[0]
    x = torch.cat([_rms(embed[ids], ckpt[m + "input_layernorm.weight"]),
                   _rms(fused, ckpt[m + "hidden_norm.weight"])], -1)  # [T, 2 * HIDDEN]
    q_c = _rms(x @ ckpt[a + "q_a_proj.weight"].T, ckpt[a + "q_a_layernorm.weight"])
    q = (q_c @ ckpt[a + "q_b_proj.weight"].T).view(T, HEADS, NOPE + ROPE)
    kv_a = x @ ckpt[a + "kv_a_proj_with_mqa.weight"].T
    kv_c, k_pe = kv_a.split([KV_LORA, ROPE], dim=-1)
    kv = _rms(kv_c, ckpt[a + "kv_a_layernorm.weight"]) @ ckpt[a + "kv_b_proj.weight"].T
    k_nope, v = kv.view(T, HEADS, NOPE + V_DIM).split([NOPE, V_DIM], dim=-1)
    q_pe = _rope_interleaved(q[..., NOPE:], pos, yarn)
    k_pe = _rope_interleaved(k_pe, pos, yarn)[:, None].expand(T, HEADS, ROPE)
    q = torch.cat([q[..., :NOPE], q_pe], -1).transpose(0, 1)
    k = torch.cat([k_nope, k_pe], -1).transpose(0, 1)
    scale = (NOPE + ROPE) ** -0.5
    if yarn is not None:  # DeepSeek's YaRN attention temperature
        scale *= _yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2
    scores = (q @ k.transpose(1, 2)) * scale
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    attn = (scores.softmax(-1) @ v.transpose(0, 1)).transpose(0, 1).reshape(T, -1)
    h = attn @ ckpt[a + "o_proj.weight"].T + fused  # residual: the fused state
    residual = h
    h = _rms(h, ckpt[m + "post_attention_layernorm.weight"])
    gate = h @ ckpt[m + "mlp.gate_proj.weight"].T
    up = h @ ckpt[m + "mlp.up_proj.weight"].T
    h = (F.silu(gate) * up) @ ckpt[m + "mlp.down_proj.weight"].T
    prenorm = h + residual
    return _rms(prenorm, ckpt["norm.weight"]), prenorm


class _CausalAttention(torch.nn.Module):
    """Plain causal attention over one prefill, in place of the paged
    attention layer (which needs an engine's KV cache and metadata)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, q, k, v):
        T = q.shape[0]
        q, k, v = (t.reshape(T, HEADS, -1).transpose(0, 1) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.transpose(0, 1).reshape(T, -1)


@pytest.mark.parametrize("yarn", [None, YARN], ids=["rope", "yarn"])
@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle3.1"])
def test_draft_step_matches_a_reference(cpu_env, model_dirs, eagle31, yarn):
    """The draft layer's forward (MLA off) equals the draft step written out
    by hand. custom_ops none: v0.16.0's CPU rotary kernel mis-rotates the
    strided q_pe view DeepseekV2Attention passes it (a stock bug unrelated to
    EAGLE-3). EAGLE-3.1 RMS-norms each captured state with its own fc_norm
    before fc and feeds the normed output, not the pre-norm one, back."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    draft = None
    ckpt = checkpoint(seed=4)
    # YaRN as the published drafters have it: its frequencies and its
    # attention temperature (mscale) must both reach the draft layer.
    rope = {} if yarn is None else dict(rope_scaling=dict(yarn),
                                        max_position_embeddings=4096 * 64)
    name = ("eagle31" if eagle31 else "eagle3") + ("_yarn" if yarn else "")
    if yarn and not eagle31:
        draft = model_dirs.write(name, **{**DRAFT, **rope})
    if eagle31:
        draft = model_dirs.write(name, **{**DRAFT, **rope}, fc_norm=True, norm_output=True)
        g = torch.Generator().manual_seed(6)
        fc_in = [1.0 + 0.2 * torch.randn(HIDDEN, generator=g) for _ in AUX_IDS]
        ckpt.update({f"fc_norm.{i}.weight": w for i, w in enumerate(fc_in)})
    model = build_drafter(cpu_env, model_dirs, draft=draft, custom_ops=["none"])
    loaded = model.load_weights(iter(ckpt.items()))
    assert loaded == {name for name, _ in model.named_parameters()}
    finish_loading(model)
    attn = model.model.layers[0].self_attn
    attn.attn = _CausalAttention(attn.scaling)

    T = 7
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (T,), generator=g)
    pos = torch.arange(T) + 3
    aux = torch.randn(T, len(AUX_IDS) * HIDDEN, generator=g)
    cfg = model._vllm_config_for_test
    with set_current_vllm_config(cfg), set_forward_context(None, cfg, num_tokens=T):
        fused = model.combine_hidden_states(aux)
        out, prenorm = model(ids, pos, fused)
    fc_input = aux
    if eagle31:
        chunks = aux.split(HIDDEN, dim=-1)
        fc_input = torch.cat([_rms(c, w) for c, w in zip(chunks, fc_in)], dim=-1)
    ref_out, ref_prenorm = reference_draft_step(
        ckpt, ids, pos, fc_input @ ckpt["fc.weight"].T, ckpt["embed_tokens.weight"],
        yarn,
    )
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    # What the proposer feeds into the next draft step.
    fed_back = ref_out if eagle31 else ref_prenorm
    torch.testing.assert_close(prenorm, fed_back, rtol=1e-4, atol=1e-4)
