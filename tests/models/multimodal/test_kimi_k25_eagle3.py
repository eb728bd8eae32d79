# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EAGLE-3 support of KimiK25ForConditionalGeneration (CPU-only, no weights).

The wrapper is built without its __init__ (no vision tower); its language
model is a real DeepseekV3ForCausalLM whose DeepseekV2Model runs stand-in
decoder layers.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm.model_executor.models import deepseek_v2
from vllm.model_executor.models.interfaces import SupportsEagle3, supports_eagle3
from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration

HIDDEN, VOCAB = 8, 32


class StandInLayer(nn.Module):
    def __init__(self, idx: int) -> None:
        super().__init__()
        self.idx = idx

    def forward(self, positions, hidden_states, residual, llama_4_scaling=None):
        stream = hidden_states if residual is None else hidden_states + residual
        return torch.sin(stream + self.idx), stream


class AddNorm(nn.Module):
    def forward(self, hidden_states, residual):
        stream = hidden_states + residual
        return stream / 2, stream


@pytest.fixture(autouse=True)
def single_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    group = SimpleNamespace(world_size=1, is_first_rank=True, is_last_rank=True)
    monkeypatch.setattr(deepseek_v2, "get_pp_group", lambda: group)


def make_kimi(num_layers: int = 61) -> KimiK25ForConditionalGeneration:
    torch.manual_seed(0)
    inner = object.__new__(deepseek_v2.DeepseekV2Model)
    nn.Module.__init__(inner)
    inner.config = SimpleNamespace(num_hidden_layers=num_layers)
    inner.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
    inner.start_layer, inner.end_layer = 0, num_layers
    inner.layers = nn.ModuleList(StandInLayer(i) for i in range(num_layers))
    inner.norm = AddNorm()
    inner.do_not_compile = True  # plain forward, no torch.compile
    text = object.__new__(deepseek_v2.DeepseekV3ForCausalLM)
    nn.Module.__init__(text)
    text.config, text.model = inner.config, inner
    kimi = object.__new__(KimiK25ForConditionalGeneration)
    nn.Module.__init__(kimi)
    kimi.language_model = text
    return kimi


def test_kimi_k25_implements_supports_eagle3():
    assert SupportsEagle3 in KimiK25ForConditionalGeneration.__mro__
    assert supports_eagle3(KimiK25ForConditionalGeneration)
    assert supports_eagle3(make_kimi())


def test_kimi_k25_default_aux_layers_come_from_text_model():
    assert make_kimi(61).get_eagle3_aux_hidden_state_layers() == (2, 30, 58)


def test_kimi_k25_set_aux_layers_reaches_text_model():
    kimi = make_kimi(61)
    kimi.set_aux_hidden_state_layers((2, 30, 61))
    assert kimi.language_model.model.aux_hidden_state_layers == (2, 30, 61)


def test_kimi_k25_set_aux_layers_is_validated():
    with pytest.raises(ValueError, match=r"invalid ids \[62\].*\[0, 61\]"):
        make_kimi(61).set_aux_hidden_state_layers((2, 30, 62))


def test_kimi_k25_forward_hands_aux_states_through():
    kimi = make_kimi(5)
    kimi.set_aux_hidden_state_layers((1, 5))
    out = kimi.forward(torch.tensor([1, 2, 3]), torch.arange(3))
    assert isinstance(out, tuple)
    hidden_states, aux = out
    assert hidden_states.shape == (3, HIDDEN)
    assert len(aux) == 2 and all(a.shape == (3, HIDDEN) for a in aux)


@pytest.mark.regression
def test_kimi_k25_forward_without_capture_returns_tensor():
    out = make_kimi(5).forward(torch.tensor([1, 2, 3]), torch.arange(3))
    assert isinstance(out, torch.Tensor)
    assert out.shape == (3, HIDDEN)
