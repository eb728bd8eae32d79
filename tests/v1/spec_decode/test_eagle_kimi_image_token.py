# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EagleProposer.load_model resolves a Kimi-K2.5 target's image token (it
copies target_model.config.image_token_index into the drafter's config for
multimodal targets outside its special cases). The real load_model runs with
the drafter loader and layer lookups stubbed, on a target without vision tower.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration
from vllm.transformers_utils.configs import KimiK25Config
from vllm.v1.spec_decode import eagle
from vllm.v1.spec_decode.eagle import EagleProposer


class TextModelStub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(4, 2)
        self.lm_head = nn.Linear(2, 4)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)


@pytest.mark.parametrize(
    "config_kwargs, token",
    [({}, 163605), ({"media_placeholder_token_id": 170000}, 170000)],
)
def test_kimi_k25_target_image_token(monkeypatch, config_kwargs, token):
    target = object.__new__(KimiK25ForConditionalGeneration)
    nn.Module.__init__(target)
    target.config = KimiK25Config(**config_kwargs)
    target.language_model = TextModelStub()

    monkeypatch.setattr(eagle, "get_layers_from_vllm_config", lambda *a, **k: {})
    drafter = nn.Module()
    drafter.config = SimpleNamespace()
    shared: list[nn.Module] = []
    proposer = object.__new__(EagleProposer)
    proposer.vllm_config = None
    proposer.supports_mm_inputs = False
    proposer.parallel_drafting = False
    proposer._get_model = lambda: drafter
    proposer._maybe_share_embeddings = shared.append
    proposer._maybe_share_lm_head = shared.append
    proposer.load_model(target)

    assert proposer.model.config.image_token_index == token
    # The proposer went on to share weights with Kimi's text model.
    assert shared == [target.language_model, target.language_model]
