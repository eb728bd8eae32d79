# SPDX-License-Identifier: Apache-2.0
"""The INT4 Kimi-K2.5 target of test_eagle3_int4.py, on CPU: what
tools/tiny_checkpoints.py writes is the published quantization scheme, as
vLLM 0.16's compressed-tensors config reads it, and int4_check.reference
tells a right layer from its neighbour. The serving itself needs Marlin MoE
(a GPU)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import int4_check
from gpu_e2e_helpers import MLA_GEOMETRY
from tiny_checkpoints import (
    dequantize_w4a16,
    kimi_text_view,
    quantize_w4a16,
    write_checkpoint,
    write_kimi_k25_int4,
)

Q = int4_check.published_quantization_config()


def test_the_quantization_config_is_the_published_one():
    assert int4_check.PUBLISHED_KIMI.parent.name == "moonshotai-kimi-k25-target"
    w = Q["config_groups"]["group_0"]["weights"]
    assert (Q["quant_method"], Q["format"], w["num_bits"], w["group_size"], w["symmetric"], w["type"]) == (
        "compressed-tensors", "pack-quantized", 4, 32, True, "int")


def test_packing_matches_a_hand_decode_of_the_nibbles():
    torch.manual_seed(0)
    w = torch.randn(64, 128) / 11
    t = quantize_w4a16(w, Q)
    assert t["weight_packed"].dtype == torch.int32 and t["weight_packed"].shape == (64, 16)
    assert t["weight_scale"].dtype == torch.bfloat16 and t["weight_scale"].shape == (64, 4)
    assert t["weight_shape"].tolist() == [64, 128]
    # Eight 4-bit values per int32, lowest bits first, offset by 8 (the
    # layout Marlin's repack reads): decoded here without compressed_tensors.
    p = t["weight_packed"]
    q = torch.stack([(p >> (4 * i)) & 15 for i in range(8)], -1).reshape(64, 128) - 8
    assert q.min() >= -8 and q.max() <= 7
    by_hand = (q.float().view(64, 4, 32) * t["weight_scale"].float()[..., None]).view(64, 128)
    assert torch.equal(dequantize_w4a16(t, Q), by_hand)
    # Round to nearest on the min-max grid: within half a step of the weight,
    # plus what rounding the scale to bf16 (2^-8 relative) moves the largest
    # value of a group (7.5 steps, the grid's edge) past it.
    step = t["weight_scale"].float().repeat_interleave(32, dim=1)
    assert ((by_hand - w).abs() <= (0.5 + 7.5 * 2 ** -8) * step + 1e-7).all()
    # The grid's edge is reached: the largest value of each group maps to 7 or -8.
    assert (q.view(64, 4, 32).abs().amax(-1) >= 7).all()


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    d = tmp_path_factory.mktemp("int4")
    write_checkpoint("kimi-k25", d / "bf16", seed=7, dtype="bfloat16", **MLA_GEOMETRY)
    write_kimi_k25_int4(d / "bf16", d / "int4", Q)
    kimi_text_view(d / "int4", d / "view")
    return d


def test_only_the_routed_experts_are_packed_and_vllm_agrees(int4):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer

    cfg = json.loads((int4 / "int4" / "config.json").read_text())
    assert cfg["text_config"]["quantization_config"] == Q and "quantization_config" not in cfg
    names = set(load_file(str(int4 / "int4" / "model.safetensors")))
    packed = {n.rsplit(".", 1)[0] for n in names if n.endswith(".weight_packed")}
    text = cfg["text_config"]
    moe_layers = range(text["first_k_dense_replace"], text["num_hidden_layers"])
    assert packed == {f"language_model.model.layers.{i}.mlp.experts.{j}.{p}"
                      for i in moe_layers for j in range(text["n_routed_experts"])
                      for p in ("gate_proj", "up_proj", "down_proj")}
    # vLLM's own reading of the published ignore list, on its layer names:
    # the experts quantized, everything else the list names left in bf16.
    ignore = CompressedTensorsConfig.from_config(Q).ignore
    pre = "language_model.model.layers"
    assert not should_ignore_layer(f"{pre}.3.mlp.experts", ignore)
    for layer in (f"{pre}.3.self_attn.kv_a_proj_with_mqa", f"{pre}.3.mlp.shared_experts.down_proj",
                  f"{pre}.0.mlp.down_proj"):
        assert should_ignore_layer(layer, ignore), layer


def test_the_reference_view_holds_the_dequantized_experts(int4):
    a = load_file(str(int4 / "bf16" / "model.safetensors"))
    v = load_file(str(int4 / "view" / "model.safetensors"))
    assert set(v) == {k[len("language_model."):] for k in a if k.startswith("language_model.")}
    e = "model.layers.3.mlp.experts.5.up_proj.weight"
    rel = ((v[e] - a["language_model." + e].float()).norm() / a["language_model." + e].float().norm()).item()
    assert 0.01 < rel < 0.2  # int4: rounded, not copied
    s = "model.layers.3.self_attn.o_proj.weight"
    assert torch.equal(v[s], a["language_model." + s].float())  # bf16 as written


def test_reference_accepts_the_right_layers_and_refuses_a_shift(int4, tmp_path):
    """States from an independent bf16 forward pass as captured ones; the
    same states under ids one layer later must not (nearest-layer check).
    Ids 1 and 2: on this random (untrained) target a routing near-tie at one
    token spreads through attention to most later tokens by the deeper
    layers, in any bf16 forward (int4_check.TRAIN_STEPS)."""
    prompt = list(range(40, 72))
    st = int4_check.layer_inputs(int4 / "view", prompt, (torch.bfloat16,))["bfloat16"]
    ids = [1, 2]
    aux = torch.cat([st[k].float() for k in ids], dim=-1)
    for name, claimed, want in (("right", ids, True), ("shifted", [2, 3], False)):
        torch.save({"aux": aux, "layer_ids": claimed, "prompt": prompt}, tmp_path / f"{name}.pt")
        res = int4_check.reference(int4 / "view", tmp_path / f"{name}.pt", tmp_path / f"{name}.json")
        assert res["ok"] is want, res["per_id"]
    assert all(r["nearest_reference_layer"] == r["id"] for r in
               json.loads((tmp_path / "right.json").read_text())["per_id"])
