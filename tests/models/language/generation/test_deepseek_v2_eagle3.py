# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EAGLE-3 support of the DeepSeek family (DeepseekV2ForCausalLM and subclasses).

CPU-only: DeepseekV2Model.forward runs on stand-in decoder layers that treat
the residual stream as the real ones do, so no kernels, weights or
distributed setup are needed; the AOT test compiles a tiny model with
inductor in two child processes (_deepseek_v2_aot_child.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm.model_executor.models import deepseek_v2
from vllm.model_executor.models.interfaces import SupportsEagle3, supports_eagle3
from vllm.model_executor.models.utils import PPMissingLayer
from vllm.sequence import IntermediateTensors

HIDDEN, VOCAB = 8, 32
IDS = torch.tensor([3, 1, 4, 1, 5])
FIELD = "eagle_aux_hidden_state_layer_ids"
FAMILY = [
    deepseek_v2.DeepseekV2ForCausalLM,
    deepseek_v2.DeepseekForCausalLM,
    deepseek_v2.DeepseekV3ForCausalLM,
    deepseek_v2.GlmMoeDsaForCausalLM,
]
same = partial(torch.testing.assert_close, rtol=0, atol=0)


class RecorderLayer(nn.Module):
    """Stand-in for DeepseekV2DecoderLayer: the stream is hidden_states +
    residual (hidden_states alone before layer 0); returns (f(stream), stream)
    and records each stream it sees."""

    def __init__(self, idx: int) -> None:
        super().__init__()
        self.idx = idx
        self.inputs: list[torch.Tensor] = []

    def forward(self, positions, hidden_states, residual, llama_4_scaling=None):
        stream = hidden_states if residual is None else hidden_states + residual
        self.inputs.append(stream.clone())
        return torch.tanh(stream * (0.5 + 0.1 * self.idx)) + 0.01 * self.idx, stream


class AddNorm(nn.Module):
    """Stand-in for the fused add + RMSNorm: returns (normed, stream)."""

    def forward(self, hidden_states, residual):
        stream = hidden_states + residual
        return stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + 1e-6), stream


@pytest.fixture
def pp_group(monkeypatch: pytest.MonkeyPatch):
    """A single pipeline stage unless the test calls set_pp()."""

    def set_pp(world_size: int = 1, rank: int = 0) -> None:
        group = SimpleNamespace(
            world_size=world_size, rank_in_group=rank, is_first_rank=rank == 0,
            is_last_rank=rank == world_size - 1,
        )
        monkeypatch.setattr(deepseek_v2, "get_pp_group", lambda: group)

    set_pp()
    return set_pp


def make_model(num_layers: int, start: int = 0, end: int | None = None):
    """A DeepseekV2Model holding layers [start, end) of num_layers, as one
    pipeline stage would, built without running its __init__."""
    end = num_layers if end is None else end
    torch.manual_seed(0)
    model = object.__new__(deepseek_v2.DeepseekV2Model)
    nn.Module.__init__(model)
    model.config = SimpleNamespace(num_hidden_layers=num_layers)
    model.embed_tokens = nn.Embedding(VOCAB, HIDDEN) if start == 0 else PPMissingLayer()
    model.start_layer, model.end_layer = start, end
    model.layers = nn.ModuleList(
        RecorderLayer(i) if start <= i < end else PPMissingLayer()
        for i in range(num_layers)
    )
    model.norm = AddNorm() if end == num_layers else PPMissingLayer()
    return model


def make_causal_lm(cls=deepseek_v2.DeepseekV3ForCausalLM, num_layers=61, model=None):
    lm = object.__new__(cls)
    nn.Module.__init__(lm)
    lm.config = SimpleNamespace(num_hidden_layers=num_layers)
    lm.model = model if model is not None else make_model(4)
    return lm


def stock_forward(model, intermediate_tensors=None):
    """What DeepseekV2Model.forward computed in v0.16.0, on the same stand-ins."""
    if intermediate_tensors is None:
        hidden_states, residual = model.embed_tokens(IDS), None
    else:
        hidden_states = intermediate_tensors["hidden_states"]
        residual = intermediate_tensors["residual"]
    for layer in model.layers[model.start_layer : model.end_layer]:
        hidden_states, residual = layer(None, hidden_states, residual, None)
    if model.end_layer != model.config.num_hidden_layers:
        return hidden_states, residual
    return model.norm(hidden_states, residual)


def run(model, intermediate_tensors=None):
    for layer in model.layers:
        if isinstance(layer, RecorderLayer):
            layer.inputs.clear()
    return model.forward(IDS, torch.arange(5), intermediate_tensors)


@pytest.mark.parametrize("cls", FAMILY, ids=lambda c: c.__name__)
def test_family_implements_supports_eagle3(cls):
    assert SupportsEagle3 in cls.__mro__
    assert supports_eagle3(cls)
    assert supports_eagle3(make_causal_lm(cls))


@pytest.mark.parametrize(
    ("num_layers", "expected"), [(61, (2, 30, 58)), (27, (2, 13, 24))]
)
def test_default_aux_layers(pp_group, num_layers, expected):
    lm = make_causal_lm(num_layers=num_layers)
    assert lm.get_eagle3_aux_hidden_state_layers() == expected


@pytest.mark.parametrize("layers", [(2, 30, 58), [1, 29, 57], (0, 61), (61,)])
def test_set_aux_layers_accepts_valid_ids(pp_group, layers):
    lm = make_causal_lm(num_layers=61)
    lm.set_aux_hidden_state_layers(layers)
    assert lm.model.aux_hidden_state_layers == tuple(layers)


def refused(lm, layers) -> str:
    """set_aux_hidden_state_layers raises and leaves no capture configured."""
    with pytest.raises(ValueError) as exc_info:
        lm.set_aux_hidden_state_layers(layers)
    assert lm.model.aux_hidden_state_layers == ()
    return str(exc_info.value)


# Unsorted ids would hand the drafter's fc its inputs permuted: the forward
# returns states in layer order.
@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        ((2, "30", 58), ["invalid ids ['30']", "[0, 61]", FIELD]),
        ((2, 30.0, 58), ["invalid ids [30.0]", "[0, 61]", FIELD]),
        ((True, 30, 58), ["invalid ids [True]", "[0, 61]", FIELD]),
        ((-1, 30, 58), ["invalid ids [-1]", "[0, 61]", FIELD]),
        ((2, 30, 62), ["invalid ids [62]", "[0, 61]", FIELD]),
        ((2, 30, 100), ["invalid ids [100]", "[0, 61]", FIELD]),
        ((58, 2, 30), ["not in ascending order", "[2, 30, 58]", FIELD]),
        ([30, 2, 58], ["not in ascending order", "[2, 30, 58]", FIELD]),
        ((61, 0), ["not in ascending order", "[0, 61]", FIELD]),
        ((2, 30, 30), ["duplicate ids [30]"]),
        (30, ["list or tuple"]),
    ],
)
def test_set_aux_layers_rejects_bad_ids(pp_group, layers, expected):
    msg = refused(make_causal_lm(num_layers=61), layers)
    for text in expected:
        assert text in msg


def test_set_aux_layers_refuses_pipeline_parallel(pp_group):
    pp_group(world_size=2, rank=1)
    msg = refused(make_causal_lm(num_layers=61), (2, 30, 58))
    assert "pipeline" in msg and "pipeline_parallel_size=2" in msg


@pytest.mark.regression
def test_capture_off_output_unchanged(pp_group):
    model = make_model(6)
    expected, _ = stock_forward(model)
    out = run(model)
    assert isinstance(out, torch.Tensor)
    same(out, expected)


@pytest.mark.regression
@pytest.mark.parametrize("aux", [(), (1, 2)], ids=["capture_off", "requested"])
def test_non_last_rank_returns_intermediate_tensors_unchanged(pp_group, aux):
    pp_group(world_size=2, rank=0)
    model = make_model(8, 0, 4)
    exp_hidden, exp_residual = stock_forward(model)
    model.aux_hidden_state_layers = aux
    out = run(model)
    assert isinstance(out, IntermediateTensors)
    assert set(out.tensors) == {"hidden_states", "residual"}
    same(out["hidden_states"], exp_hidden)
    same(out["residual"], exp_residual)


@pytest.mark.parametrize("requested", [(1, 3, 4), (4, 1, 3)])
def test_capture_returns_inputs_of_requested_layers(pp_group, requested):
    """States come back in ascending layer order, whatever order was set."""
    model = make_model(6)
    expected, _ = stock_forward(model)
    model.aux_hidden_state_layers = requested
    out = run(model)
    assert isinstance(out, tuple) and len(out) == 2
    hidden_states, aux = out
    same(hidden_states, expected)
    assert isinstance(aux, list) and len(aux) == 3
    for state, layer_id in zip(aux, (1, 3, 4), strict=True):
        assert state.shape == (5, HIDDEN)
        same(state, model.layers[layer_id].inputs[0])


def test_capture_layer_zero_is_embedding(pp_group):
    model = make_model(6)
    model.aux_hidden_state_layers = (0, 2)
    _, aux = run(model)
    assert len(aux) == 2
    same(aux[0], model.embed_tokens(IDS))
    same(aux[1], model.layers[2].inputs[0])


def test_capture_final_layer_id_is_pre_norm_output(pp_group):
    model = make_model(6)
    _, pre_norm = stock_forward(model)
    model.aux_hidden_state_layers = (2, 6)
    hidden_states, aux = run(model)
    assert len(aux) == 2, "the final-layer id must not be dropped"
    same(aux[0], model.layers[2].inputs[0])
    same(aux[1], pre_norm)
    same(hidden_states, AddNorm()(aux[1], torch.zeros_like(aux[1]))[0])


def test_capture_uses_global_layer_ids_on_later_stage(pp_group):
    """Layers 4..7 of 8 on the last stage: ids stay global, not stage-local."""
    pp_group(world_size=2, rank=1)
    model = make_model(8, 4, 8)
    torch.manual_seed(1)
    inputs = IntermediateTensors(
        {"hidden_states": torch.randn(5, HIDDEN), "residual": torch.randn(5, HIDDEN)}
    )
    expected, pre_norm = stock_forward(model, inputs)
    # 1 belongs to the first stage; a stage-local numbering would wrongly
    # capture the input of global layer 5 for it and miss 6 and 8.
    model.aux_hidden_state_layers = (1, 6, 8)
    hidden_states, aux = run(model, inputs)
    same(hidden_states, expected)
    assert len(aux) == 2
    same(aux[0], model.layers[6].inputs[0])
    same(aux[1], pre_norm)
    same(model.layers[4].inputs[0], inputs["hidden_states"] + inputs["residual"])


def test_capture_default_layers_end_to_end(pp_group):
    """Defaults from get_eagle3_aux_hidden_state_layers() drive the forward."""
    model = make_model(7)
    lm = make_causal_lm(num_layers=7, model=model)
    layers = lm.get_eagle3_aux_hidden_state_layers()
    assert layers == (2, 3, 4)
    lm.set_aux_hidden_state_layers(layers)
    _, aux = run(model)
    for state, layer_id in zip(aux, layers, strict=True):
        same(state, model.layers[layer_id].inputs[0])


def test_causal_lm_forward_passes_aux_states_through(pp_group):
    model = make_model(6)
    model.do_not_compile = True  # call the plain forward, no torch.compile
    lm = make_causal_lm(num_layers=6, model=model)
    lm.set_aux_hidden_state_layers((1, 6))
    out = lm.forward(IDS, torch.arange(5))
    assert isinstance(out, tuple)
    hidden_states, aux = out
    assert hidden_states.shape == (5, HIDDEN)
    assert [a.shape for a in aux] == [(5, HIDDEN), (5, HIDDEN)]


def test_capture_traces_under_torch_compile(pp_group):
    """The capture must stay inside one dynamo graph (no graph breaks)."""
    model = make_model(4)
    expected_hidden, pre_norm = stock_forward(model)
    model.aux_hidden_state_layers = (0, 2, 4)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend="eager", fullgraph=True)
    hidden_states, aux = compiled(IDS, torch.arange(5), None)
    same(hidden_states, expected_hidden)
    assert len(aux) == 3
    same(aux[2], pre_norm)


# --- float16: the down-scaled residual stream, multiplied back ---

FP16_MAX = torch.finfo(torch.float16).max


def test_float16_aux_state_beyond_the_range_saturates_instead_of_inf():
    """In float16 the stream is kept divided by routed_scaling_factor because
    its true value can pass 65504; multiplying it back must not recreate the
    overflow as inf (the drafter's fc would make NaN drafts of it)."""
    h = torch.tensor([[30000.0, -30000.0, 100.0, 1.0]], dtype=torch.float16)
    r = torch.tensor([[20000.0, -20000.0, 50.0, 1.0]], dtype=torch.float16)
    out = deepseek_v2._eagle3_aux_state(h, r, 2.5)
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all(), out
    # True values: +-125000 (past the range, saturated), 375 and 5 (exact).
    expected = torch.tensor([[FP16_MAX, -FP16_MAX, 375.0, 5.0]], dtype=torch.float16)
    same(out, expected)


def test_float16_forward_captures_finite_true_scale_states(pp_group):
    """Through DeepseekV2Model.forward: a float16 stream of ~4e4 (true value
    ~1e5 after the x2.5) gives finite aux states, and in-range entries are
    the true stream (2.5 x what the layer saw)."""
    model = make_model(3).half()
    model.config = SimpleNamespace(num_hidden_layers=3, routed_scaling_factor=2.5)
    for layer in model.layers:
        layer.use_mha = False
    with torch.no_grad():
        model.embed_tokens.weight.fill_(1.0)
        model.embed_tokens.weight[:, 0] = 40000.0  # one feature past 65504 / 2.5
    model.aux_hidden_state_layers = (1, 2, 3)
    _, aux = run(model)
    for layer_id, state in zip((1, 2, 3), aux, strict=True):
        assert state.dtype == torch.float16
        assert torch.isfinite(state).all(), (layer_id, state)
        same(state[:, 0], torch.full_like(state[:, 0], FP16_MAX))
        seen = model.layers[layer_id].inputs[0] if layer_id < 3 else None
        if seen is not None:
            torch.testing.assert_close(state[:, 1:].float(), 2.5 * seen[:, 1:].float(),
                                       rtol=2e-3, atol=0)


# --- mutations the other tests did not catch (docs/loo.md lists them) ---


def test_id0_state_is_a_copy_not_the_input_buffer(pp_group):
    """Id 0 is the embedding before layer 0; the runner passes its
    persistent inputs_embeds buffer, which the next step overwrites (and a
    CUDA graph replays into), so the captured state must be a copy."""
    model = make_model(3)
    model.aux_hidden_state_layers = (0, 2)
    buf = torch.randn(5, HIDDEN)
    want = buf.clone()
    _, aux = model.forward(None, torch.arange(5), None, inputs_embeds=buf)
    assert aux[0].data_ptr() != buf.data_ptr()
    buf.fill_(7.0)  # the next step's inputs
    same(aux[0], want)


def test_aux_layers_cannot_change_after_the_model_compiled(pp_group):
    """vLLM compiles DeepseekV2Model without guards, so ids set after the
    first (compiling) forward would be ignored by the graph silently."""
    lm = make_causal_lm(num_layers=61)
    lm.set_aux_hidden_state_layers((2, 30, 58))
    lm.model.compiled = True  # what support_torch_compile sets after tracing
    lm.set_aux_hidden_state_layers((2, 30, 58))  # unchanged: fine
    with pytest.raises(RuntimeError, match=r"after DeepseekV2Model was compiled"):
        lm.set_aux_hidden_state_layers((3, 31, 59))
    assert lm.model.aux_hidden_state_layers == (2, 30, 58)


def _aot_start(cache_root: Path, work: Path) -> dict:
    """One engine start's compile in a fresh process (the compilation
    config's hash, which names the AOT cache entry, is only stable across
    processes, as between two real starts)."""
    work.mkdir()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache_root), "VLLM_USE_AOT_COMPILE": "1",
           "VLLM_MLA_DISABLE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "_deepseek_v2_aot_child.py"), str(work)],
        cwd=work, env=env, capture_output=True, text=True, timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("AOT-CHILD ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("AOT-CHILD "))


def test_aux_layers_cannot_change_after_the_graph_loaded_from_the_aot_cache(tmp_path):
    """With AOT compile (vLLM's default from torch 2.10), a warm start loads
    the compiled graph from disk: support_torch_compile then never sets
    `compiled`, and the loaded graph is guard-less too. A cold start compiles
    and saves; the warm one must refuse a different aux tuple all the same."""
    cache = tmp_path / "cache"
    cold = _aot_start(cache, tmp_path / "cold")
    assert cold["compiled"] and not cold["loaded_from_disk"], cold
    assert list(cache.glob("torch_aot_compile/*/rank_0_0/model")), "no AOT artifact saved"
    warm = _aot_start(cache, tmp_path / "warm")
    # The real load path: from disk, and `compiled` never set.
    assert warm["loaded_from_disk"] and not warm["compiled"], warm
    assert warm["aux_states"] == 2
    assert warm["refused"] is not None, "aux layers changed on a graph loaded from disk"
    assert "after DeepseekV2Model was compiled capturing [1, 2]" in warm["refused"]
    # Why: the loaded graph keeps returning the states it was traced with.
    assert warm["aux_states_after_change"] == 2


@pytest.mark.regression
def test_sequence_parallel_moe_returns_every_token(monkeypatch):
    """The capture takes the stream between layers as full [num_tokens,
    hidden] states; v0.16.0's sequence-parallel MoE chunks tokens per TP
    rank and all-gathers them back inside the block. Pinned here (TP = 2
    simulated, rank 0) because a sharded MoE output would be captured
    sharded, as upstream's later change needed an extra gather for."""
    tokens, tp = 5, 2
    chunk = -(-tokens // tp)

    def seq_chunk(x):  # rank 0's share, padded as sequence_parallel_chunk does
        return torch.nn.functional.pad(x, (0, 0, 0, chunk * tp - x.shape[0]))[:chunk]

    gathered = []
    monkeypatch.setattr(deepseek_v2, "sequence_parallel_chunk", seq_chunk)
    monkeypatch.setattr(
        deepseek_v2, "tensor_model_parallel_all_gather",
        lambda x, dim: gathered.append(x.shape[0]) or torch.cat([x] * tp, dim),
    )
    moe = object.__new__(deepseek_v2.DeepseekV2MoE)
    nn.Module.__init__(moe)
    moe.is_sequence_parallel, moe.tp_size = True, tp
    moe.routed_scaling_factor, moe.is_rocm_aiter_moe_enabled = 2.5, False
    moe.shared_experts = None
    moe.gate = lambda x: (x[:, :4], None)
    moe.experts = SimpleNamespace(is_internal_router=False)
    moe.experts = type("Experts", (), {
        "is_internal_router": False,
        "__call__": lambda self, hidden_states, router_logits: (None, hidden_states * 2),
    })()
    out = moe.forward(torch.randn(tokens, HIDDEN))
    assert gathered == [chunk]  # the experts saw rank 0's share only
    assert out.shape == (tokens, HIDDEN)
