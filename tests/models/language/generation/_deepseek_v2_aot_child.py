# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One engine start's worth of DeepseekV2Model compilation, for
test_deepseek_v2_eagle3.py's AOT test (not a test module): run as
``python _deepseek_v2_aot_child.py DIR``, it builds a tiny
DeepseekV3ForCausalLM the way the model loader does, sets the aux layers as
GPUModelRunner.load_model does, runs the first forward through
support_torch_compile, and prints one JSON line of what it saw. Two runs with
the same VLLM_CACHE_ROOT are a cold start (compile, save the AOT artifact)
and a warm one (load it from disk).

VLLM_COMPILE, as on CUDA: the CPU platform switches to DYNAMO_TRACE_ONCE,
whose compile never reaches the piecewise backend's completion callback, so
it never saves an AOT artifact to load. The decoder layers are swapped for
plain torch layers before the first forward, so the graph holds no attention
op and needs no KV cache; the capture loop, the final norm and the decorator
are the model's own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

AUX = (1, 2)
HIDDEN, LAYERS = 32, 3
CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=64,
    hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
    first_k_dense_replace=LAYERS, num_attention_heads=2, num_key_value_heads=2,
    q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16,
    v_head_dim=16, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
    max_position_embeddings=128, torch_dtype="float32", rms_norm_eps=1e-6,
)


class PlainLayer(nn.Module):
    """A decoder layer's interface: (positions, hidden, residual, scaling)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, positions, hidden_states, residual, llama_4_scaling):
        residual = hidden_states if residual is None else hidden_states + residual
        return self.proj(residual), residual


def main(work: Path) -> dict:
    from vllm.config import (
        CacheConfig, CompilationConfig, CompilationMode, DeviceConfig, ModelConfig,
        VllmConfig, set_current_vllm_config,
    )
    from vllm.distributed import parallel_state as ps
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM

    ps.init_distributed_environment(
        world_size=1, rank=0, distributed_init_method=f"file://{work}/dist",
        local_rank=0, backend="gloo",
    )
    ps.ensure_model_parallel_initialized(1, 1)
    # One checkpoint directory for both starts: its path is in the config hash.
    model_dir = work.parent / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(CONFIG))
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), tokenizer=str(model_dir),
                                 skip_tokenizer_init=True, dtype="float32"),
        device_config=DeviceConfig("cpu"), cache_config=CacheConfig(block_size=16),
        compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE),
    )
    config.compilation_config.mode = CompilationMode.VLLM_COMPILE
    config.compilation_config.compile_sizes = []
    with set_current_vllm_config(config):
        lm = DeepseekV3ForCausalLM(vllm_config=config, prefix="")
    torch.manual_seed(0)
    lm.model.layers = nn.ModuleList(PlainLayer() for _ in range(LAYERS))
    lm.set_aux_hidden_state_layers(AUX)  # GPUModelRunner.load_model's call

    ids, positions = torch.arange(5), torch.arange(5)

    def forward() -> int:
        with set_current_vllm_config(config), set_forward_context(None, config, num_tokens=5):
            _, aux = lm.model(ids, positions, None)
        return len(aux)

    seen = {"aux_states": forward(), "compiled": bool(lm.model.compiled),
            "loaded_from_disk": bool(lm.model.was_aot_compile_fn_loaded_from_disk)}
    try:
        lm.set_aux_hidden_state_layers((0, 1, 2))
        seen["refused"] = None
    except RuntimeError as e:
        seen["refused"] = str(e)
    # What the guard prevents: the graph ignores a changed attribute.
    lm.model.aux_hidden_state_layers = (0, 1, 2)
    seen["aux_states_after_change"] = forward()
    return seen


if __name__ == "__main__":
    print("AOT-CHILD " + json.dumps(main(Path(sys.argv[1]))), flush=True)
