# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EagleProposer.load_model resolves a Kimi-K2.5 target's image token.

For multimodal targets outside its short list of special cases the proposer
copies target_model.config.image_token_index into the drafter's config. The
real load_model runs here with the drafter loader and the layer lookups
stubbed out, against a KimiK25ForConditionalGeneration built without its
vision tower.
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


def make_target(config: KimiK25Config) -> KimiK25ForConditionalGeneration:
    target = object.__new__(KimiK25ForConditionalGeneration)
    nn.Module.__init__(target)
    target.config = config
    target.language_model = TextModelStub()
    return target


def load_drafter(monkeypatch: pytest.MonkeyPatch, target: nn.Module):
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
    return proposer, shared


def test_kimi_k25_target_image_token_default(monkeypatch):
    target = make_target(KimiK25Config())
    proposer, shared = load_drafter(monkeypatch, target)
    assert proposer.model.config.image_token_index == 163605
    # The proposer went on to share weights with Kimi's text model.
    assert shared == [target.language_model, target.language_model]


def test_kimi_k25_target_image_token_follows_checkpoint(monkeypatch):
    target = make_target(KimiK25Config(media_placeholder_token_id=170000))
    proposer, _ = load_drafter(monkeypatch, target)
    assert proposer.model.config.image_token_index == 170000
