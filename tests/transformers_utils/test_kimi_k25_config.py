# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KimiK25Config exposes image_token_index as an alias of
media_placeholder_token_id (read by the EAGLE proposer for multimodal
targets)."""

import json

import pytest

from vllm.transformers_utils.configs import KimiK25Config

DEFAULT_MEDIA_TOKEN = 163605


def test_image_token_index_defaults_to_media_placeholder():
    config = KimiK25Config()
    assert config.image_token_index == DEFAULT_MEDIA_TOKEN
    assert config.image_token_index == config.media_placeholder_token_id


def test_image_token_index_follows_constructor_value():
    config = KimiK25Config(media_placeholder_token_id=1234)
    assert config.image_token_index == 1234


def test_image_token_index_follows_later_assignment():
    config = KimiK25Config()
    config.media_placeholder_token_id = 99
    assert config.image_token_index == 99


def test_setting_image_token_index_sets_media_placeholder():
    config = KimiK25Config()
    config.image_token_index = 4321
    assert config.media_placeholder_token_id == 4321
    assert config.image_token_index == 4321


def test_image_token_index_kwarg_sets_media_placeholder():
    config = KimiK25Config(image_token_index=777)
    assert config.media_placeholder_token_id == 777


def test_dict_round_trip_keeps_alias():
    config = KimiK25Config(media_placeholder_token_id=555)
    data = config.to_dict()
    assert data["media_placeholder_token_id"] == 555
    assert "image_token_index" not in data
    restored = KimiK25Config.from_dict(data)
    assert restored.media_placeholder_token_id == 555
    assert restored.image_token_index == 555


def test_save_and_load_round_trip(tmp_path):
    KimiK25Config(media_placeholder_token_id=4242).save_pretrained(tmp_path)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert on_disk["media_placeholder_token_id"] == 4242
    assert "image_token_index" not in on_disk
    restored = KimiK25Config.from_pretrained(tmp_path)
    assert restored.image_token_index == 4242


@pytest.mark.regression
def test_media_placeholder_serialisation_unchanged():
    config = KimiK25Config()
    assert config.media_placeholder_token_id == DEFAULT_MEDIA_TOKEN
    data = config.to_dict()
    assert data["media_placeholder_token_id"] == DEFAULT_MEDIA_TOKEN
    assert "image_token_index" not in data
    assert data["model_type"] == "kimi_k25"
