#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Does the vLLM this Python imports carry the EAGLE-3 series? One line per
patch (``vllm-eagle3 doctor``).

Each check asks vLLM itself (its registry, SpeculativeConfig, config classes,
interfaces) about the behaviour one patch adds; nothing is downloaded and no
GPU is needed.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from ._base import CANNOT, OK, PROBLEM, print_out, source_tree_vllm

CHECKS: list[tuple[str, Callable[[], str]]] = []


def check(patch: str):
    def register(fn: Callable[[], str]) -> Callable[[], str]:
        CHECKS.append((patch, fn))
        return fn
    return register


def _speculative_config_accepts(model_type: str, top_level: str | None = None, **fields) -> bool:
    """Whether SpeculativeConfig's checks pass an eagle3 config (``fields``
    over its defaults here) on a target of this model type."""
    from vllm.config import SpeculativeConfig

    config = object.__new__(SpeculativeConfig)
    target = SimpleNamespace(hf_text_config=SimpleNamespace(model_type=model_type),
                             hf_config=SimpleNamespace(model_type=top_level or model_type))
    defaults = dict(tensor_parallel_size=None, num_speculative_tokens=3, draft_model_config=None,
                    disable_by_batch_size=None, method="eagle3", target_model_config=target)
    for name, value in {**defaults, **fields}.items():
        object.__setattr__(config, name, value)
    try:
        config._verify_args()
    except ValueError:
        return False
    return True


def _resolve(arch: str) -> type:
    from vllm.model_executor.models.registry import ModelRegistry

    cls = ModelRegistry._try_load_model_cls(arch)
    if cls is None:
        raise LookupError(f"{arch} is not registered")
    return cls


@check("Spec-Decode-Read-EAGLE-3-aux-layer-ids-from-eagle_co")
def nested_ids() -> str:
    from transformers import LlamaConfig
    from vllm.config.speculative import get_eagle3_aux_layer_ids

    config = LlamaConfig(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 30, 58]})
    ids, field = get_eagle3_aux_layer_ids(config)
    assert ids == (2, 30, 58), ids
    return f"reads {field}"


@check("Config-Expose-image_token_index-on-KimiK25Config")
def image_token() -> str:
    from vllm.transformers_utils.configs import KimiK25Config

    return f"image_token_index={KimiK25Config().image_token_index}"


@check("Model-Capture-EAGLE-3-aux-hidden-states-in-DeepseekV")
def deepseek_interface() -> str:
    from vllm.model_executor.models.interfaces import supports_eagle3

    archs = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM")
    missing = [a for a in archs if not supports_eagle3(_resolve(a))]
    assert not missing, f"no SupportsEagle3: {missing}"
    return ", ".join(archs)


@check("Model-Validate-DeepSeek-EAGLE-3-aux-layer-ids-and-re")
def id_validation() -> str:
    from vllm.model_executor.models import deepseek_v2

    for bad in ((2, 30, 62), (58, 2, 30)):
        try:
            deepseek_v2._check_eagle3_aux_layer_ids(bad, 61)
        except ValueError:
            continue
        raise AssertionError(f"accepts {bad} for a 61-layer target")
    return "refuses out-of-range and unsorted ids"


@check("Model-Support-EAGLE-3-in-KimiK25ForConditionalGenera")
def kimi_interface() -> str:
    from vllm.model_executor.models.interfaces import supports_eagle3

    assert supports_eagle3(_resolve("KimiK25ForConditionalGeneration"))
    return "KimiK25ForConditionalGeneration"


@check("Spec-Decode-Allow-EAGLE-3-for-DeepSeek-family-target")
def allow_list() -> str:
    family = ["deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25", "glm_moe_dsa"]
    refused = [t for t in family if not _speculative_config_accepts(t)]
    assert not refused, f"SpeculativeConfig refuses {refused}"
    assert not _speculative_config_accepts("deepseek_v2", "deepseek_vl_v2")
    return "accepts " + ", ".join(family)


@check("Model-Let-DeepSeek-V2-attention-read-an-input-wider-")
def attention_input_size() -> str:
    from vllm.model_executor.models import deepseek_v2

    for cls in (deepseek_v2.DeepseekV2Attention, deepseek_v2.DeepseekV2MLAAttention):
        assert "input_size" in inspect.signature(cls).parameters, cls.__name__
    return "input_size on both attention classes"


@check("Model-Add-the-EAGLE-3-drafter-with-a-DeepSeek-MLA-dr")
def mla_drafter() -> str:
    from vllm.model_executor.models import deepseek_eagle3

    source = inspect.getsource(deepseek_eagle3.Eagle3DeepseekV2ForCausalLM.load_weights)
    assert "AutoWeightsLoader" in source, "the drafter does not load through AutoWeightsLoader"
    return "deepseek_eagle3.Eagle3DeepseekV2ForCausalLM, loaded via AutoWeightsLoader"


@check("Model-Check-DeepSeek-MLA-EAGLE-3-drafter-checkpoints")
def mla_drafter_checks() -> str:
    from vllm.model_executor.models import deepseek_eagle3

    assert hasattr(deepseek_eagle3.Eagle3DeepseekV2ForCausalLM, "_checkpoint_shapes")
    return "checkpoint shapes, completeness and d2t checked while loading"


@check("Model-Register-the-DeepSeek-MLA-EAGLE-3-drafter")
def mla_drafter_registered() -> str:
    names = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM",
             "DeepseekV3ForCausalLMEagle3")
    for name in names:
        _resolve(name)
    return "registers " + ", ".join(names)


@check("Spec-Decode-Keep-DeepSeek-type-EAGLE-3-drafters-out-")
def not_mtp() -> str:
    from transformers import DeepseekV3Config
    from vllm.config import SpeculativeConfig

    config = DeepseekV3Config(architectures=["DeepseekV3ForCausalLMEagle3"])
    config.draft_vocab_size = 32000
    out = SpeculativeConfig.hf_config_override(config)
    assert out.model_type == "deepseek_v3", f"rewritten to {out.model_type}"
    return "a deepseek_v3 EAGLE-3 drafter stays one"


@check("Spec-Decode-Accept-the-DeepSeek-MLA-EAGLE-3-drafter-")
def proposer() -> str:
    from vllm.v1.spec_decode import eagle

    assert "Eagle3DeepseekV2ForCausalLM" in inspect.getsource(eagle)
    return "EagleProposer accepts Eagle3DeepseekV2ForCausalLM"


@check("Config-Load-kimi_k2-EAGLE-3-drafter-configs-that-shi")
def kimi_k2_config() -> str:
    from vllm.transformers_utils.config import get_config

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(
            {"model_type": "kimi_k2", "architectures": ["Eagle3DeepseekV2ForCausalLM"],
             "kv_lora_rank": 512, "qk_rope_head_dim": 64}))
        config = get_config(tmp, trust_remote_code=False)
    return f"kimi_k2 without code loads as {type(config).__name__}"


@check("Spec-Decode-Key-the-compile-cache-on-the-EAGLE-3-dra")
def compile_hash() -> str:
    from vllm.config import SpeculativeConfig

    source = inspect.getsource(SpeculativeConfig.compute_hash)
    assert "draft_model_config" in source, "the hash ignores the drafter"
    return "compute_hash includes the drafter"


@check("Spec-Decode-Load-EAGLE-3.1-drafters-fc_norm-norm_out")
def eagle31() -> str:
    from vllm.model_executor.models import deepseek_eagle3, llama_eagle3

    for module in (llama_eagle3, deepseek_eagle3):
        source = inspect.getsource(module)
        assert "apply_eagle3_fc_norm" in source and "norm_output" in source, module
    return "fc_norm and norm_output in both drafters"


@check("Model-Add-GlmMoeDsaConfig-so-GLM-5-configs-load-with")
def glm5_config() -> str:
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    assert "glm_moe_dsa" in _CONFIG_REGISTRY, "no glm_moe_dsa config class"
    return f"glm_moe_dsa -> {_CONFIG_REGISTRY['glm_moe_dsa']}"


@check("Spec-Decode-Warn-when-EAGLE-3-aux-ids-come-only-from")
def nested_ids_warning() -> str:
    from vllm.config import speculative

    msg = speculative.eagle3_nested_aux_layer_ids_warning((2, 30, 58), 61)
    assert "vLLM ids [3, 31, 59]" in msg, msg
    assert "_verify_eagle3_draft" in inspect.getsource(speculative.SpeculativeConfig)
    return "warns at config time when only eagle_config names the ids"


@check("Model-Make-the-MLA-EAGLE-3-drafter-a-plain-nn.Module")
def mla_drafter_plain_module() -> str:
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM

    assert not issubclass(_resolve("Eagle3DeepseekV2ForCausalLM"), DeepseekV2ForCausalLM)
    return "the MLA drafter claims no PP, MoE, LoRA or EAGLE-3 target interface"


@check("Spec-Decode-Check-EAGLE-3-aux-ids-and-refuse-PP-at-c")
def config_time_checks() -> str:
    from vllm.config import speculative

    try:
        speculative.check_eagle3_aux_layer_ids((2, 30, 62), 61, "here")
    except ValueError:
        pass
    else:
        raise AssertionError("accepts id 62 for a 61-layer target")
    assert "_verify_eagle3_parallel" in inspect.getsource(speculative.SpeculativeConfig)
    assert "[2, 30, 58]" in speculative.eagle3_default_aux_layer_ids_warning((2, 30, 58), 61)
    return "ids and PP checked by SpeculativeConfig; a drafter with no ids warned"


@check("Spec-Decode-Refuse-EAGLE-3-with-DBO-micro-batching-a")
def dbo_refused() -> str:
    from vllm.config import speculative

    source = inspect.getsource(speculative.SpeculativeConfig._verify_eagle3_parallel)
    assert "use_ubatching" in source, "micro-batching is not checked"
    return "EAGLE-3 with --enable-dbo / --ubatch-size refused at config time"


@check("Model-Keep-float16-EAGLE-3-aux-states-of-DeepseekV2M")
def fp16_finite() -> str:
    import torch
    from vllm.model_executor.models import deepseek_v2

    big = torch.full((1, 2), 30000.0, dtype=torch.float16)
    out = deepseek_v2._eagle3_aux_state(big, big, 2.5)
    assert torch.isfinite(out).all(), "float16 aux state overflows to inf"
    return "float16 aux states saturate at 65504, no inf"


@check("Model-Merge-multimodal-embeddings-in-the-MLA-EAGLE-3")
def mla_multimodal() -> str:
    from vllm.model_executor.models import deepseek_eagle3

    source = inspect.getsource(deepseek_eagle3.Eagle3DeepseekV2ForCausalLM.embed_input_ids)
    assert "_merge_multimodal_embeddings" in source, "media embeddings ignored"
    return "the MLA drafter drafts from the target's media embeddings"


@check("Model-Refuse-EAGLE-3-aux-layer-changes-after-Deepsee")
def no_change_after_compile() -> str:
    from vllm.model_executor.models import deepseek_v2

    source = inspect.getsource(deepseek_v2.DeepseekV2ForCausalLM.set_aux_hidden_state_layers)
    assert "compiled" in source, "aux layers can change after compilation"
    return "aux layers fixed once the target is compiled"


@check("Spec-Decode-Read-eagle_config-one-way-in-every-EAGLE")
def eagle_config_forms() -> str:
    from transformers import LlamaConfig, PretrainedConfig
    from vllm.config import SpeculativeConfig

    config = LlamaConfig(architectures=["LlamaForCausalLM"])
    config.eagle_config = PretrainedConfig(eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    assert SpeculativeConfig.is_eagle3_draft_config(config), "object eagle_config ignored"
    return "eagle_config read as a dict or a config object alike"


@check("Spec-Decode-Let-the-EAGLE-3-drafter-pick-its-own-att")
def drafter_attention_backend() -> str:
    from vllm.config import AttentionConfig, SpeculativeConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.spec_decode.utils import create_vllm_config_for_eagle_drafter

    parse = SpeculativeConfig._parse_attention_backend
    assert parse("auto") is None and parse("flash_attn") is AttentionBackendEnum.FLASH_ATTN
    forced = AttentionConfig(backend=AttentionBackendEnum.FLASH_ATTN_MLA)
    target = SimpleNamespace(attention_config=forced, speculative_config=SimpleNamespace(
        method="eagle3", attention_backend=None))
    drafter = create_vllm_config_for_eagle_drafter(target)
    assert drafter.attention_config.backend is None, drafter.attention_config.backend
    assert target.attention_config.backend is AttentionBackendEnum.FLASH_ATTN_MLA
    return ("an eagle3 drafter takes speculative_config.attention_backend (default: auto), "
            "not --attention-backend")


@check("Spec-Decode-Refuse-disable_by_batch_size-which-V1-ig")
def disable_by_batch_size_refused() -> str:
    assert _speculative_config_accepts("llama"), "refuses a Llama target without the setting"
    assert not _speculative_config_accepts("llama", disable_by_batch_size=8), (
        "accepts disable_by_batch_size, which the V1 engine ignores")
    return "refuses disable_by_batch_size, which the V1 engine ignores"


STOCK_FIX = ("install the series' wheel where you serve: pip install "
             "dist/vllm-0.16.0+eagle3.*-manylinux_2_31_x86_64.whl (./build.sh writes it; "
             "./build.sh --cpu the CPU build's dist/vllm_cpu-0.16.0+eagle3.*.whl)")


def run(drafter: str | None = None, target: str | None = None, as_json: bool = False) -> int:
    """Print the report (or, ``as_json``, one JSON object with the same
    fields); the exit status (0 every patch present and vllm the installed
    one, 1 a patch missing or vllm imported from a source tree, 2 vLLM
    cannot be imported)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    lines: list[str] = []
    data: dict = {"vllm": None, "version": None, "problems": [], "warnings": [],
                  "patches": [], "present": 0, "total": len(CHECKS), "fix": None}

    def emit(code: int) -> int:
        print_out(json.dumps(data, indent=2) if as_json else "\n".join(lines))
        return code

    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - any import failure means "no vLLM"
        data["problems"].append(f"cannot import vllm ({type(e).__name__}: {e})")
        data["fix"] = STOCK_FIX
        lines.append(f"vllm: cannot import ({type(e).__name__}: {e}); fix: {STOCK_FIX}")
        return emit(CANNOT)
    data["vllm"] = str(Path(vllm.__file__).resolve().parent)
    data["version"] = vllm.__version__
    lines.append(f"vllm: {data['vllm']} (version {vllm.__version__})")
    if (why := source_tree_vllm()) is not None:
        fix = ("take that directory off PYTHONPATH, or start from another directory (or "
               "with PYTHONSAFEPATH=1)")
        data["problems"].append(f"{why}; fix: {fix}")
        lines.append(f"PROBLEM  {why}; fix: {fix}")
    if (Path.cwd() / "vllm" / "__init__.py").is_file():
        warn = (f"{Path.cwd()} holds a vllm/ source tree: a `vllm serve` started here "
                "imports it, not the installed vLLM, in its model-inspection child process "
                "(`python -m vllm.model_executor.models.registry`); start vllm from another "
                "directory, or with PYTHONSAFEPATH=1 (vllm-eagle3 sets it for itself)")
        data["warnings"].append(warn)
        lines.append(f"warn     {warn}")
    missing = 0
    for patch, fn in CHECKS:
        try:
            what = fn()
        except Exception as e:  # noqa: BLE001 - each failure is reported, not raised
            missing += 1
            what = f"{type(e).__name__}: {str(e)[:160]}"
            lines.append(f"MISSING  {patch}: {what}")
            data["patches"].append({"patch": patch, "present": False, "detail": what})
        else:
            lines.append(f"ok       {patch}: {what}")
            data["patches"].append({"patch": patch, "present": True, "detail": what})
    data["present"] = len(CHECKS) - missing
    summary = f"summary: {len(CHECKS) - missing} of {len(CHECKS)} patches present"
    if missing:
        data["fix"] = STOCK_FIX
        summary += f"; fix: {STOCK_FIX}"
    lines.append(summary)
    if drafter:
        from .layers import show_data, show_lines

        shown = show_data(Path(drafter), Path(target) if target else None)
        data["drafter"] = shown
        lines.extend(show_lines(shown))
    return emit(PROBLEM if missing or data["problems"] else OK)
