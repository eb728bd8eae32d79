# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KimiK25Config exposes image_token_index, which the EAGLE proposer reads for
multimodal targets, as an alias of media_placeholder_token_id."""

import json

import pytest

from vllm.transformers_utils.configs import KimiK25Config

DEFAULT_MEDIA_TOKEN = 163605


@pytest.mark.parametrize(
    ("kwargs", "assign", "value"),
    [
        ({}, {}, DEFAULT_MEDIA_TOKEN),
        ({"media_placeholder_token_id": 1234}, {}, 1234),
        ({}, {"media_placeholder_token_id": 99}, 99),
        ({}, {"image_token_index": 4321}, 4321),
        ({"image_token_index": 777}, {}, 777),
    ],
    ids=["default", "constructor", "later_assignment", "set_alias", "alias_kwarg"],
)
def test_image_token_index_aliases_media_placeholder(kwargs, assign, value):
    config = KimiK25Config(**kwargs)
    for name, v in assign.items():
        setattr(config, name, v)
    assert config.image_token_index == value
    assert config.media_placeholder_token_id == value


def test_dict_round_trip_keeps_alias():
    data = KimiK25Config(media_placeholder_token_id=555).to_dict()
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
    assert KimiK25Config.from_pretrained(tmp_path).image_token_index == 4242


@pytest.mark.regression
def test_media_placeholder_serialisation_unchanged():
    config = KimiK25Config()
    assert config.media_placeholder_token_id == DEFAULT_MEDIA_TOKEN
    data = config.to_dict()
    assert data["media_placeholder_token_id"] == DEFAULT_MEDIA_TOKEN
    assert "image_token_index" not in data
    assert data["model_type"] == "kimi_k25"
