"""Every model size in configs/ composes with every attention variant into a valid config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from egmla.config import ModelConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"
SIZES = sorted(CONFIGS.glob("*.yaml"))
ATTENTIONS = sorted((CONFIGS / "attention").glob("*.yaml"))


@pytest.mark.parametrize("size", SIZES, ids=lambda p: p.stem)
@pytest.mark.parametrize("attention", ATTENTIONS, ids=lambda p: p.stem)
def test_size_and_attention_compose(size, attention):
    data = yaml.safe_load(size.read_text())
    data["attention"] = yaml.safe_load(attention.read_text())
    cfg = ModelConfig.from_dict(data)
    assert cfg.to_dict()["attention"]["type"] == data["attention"]["type"]


def test_there_is_something_to_compose():
    assert len(SIZES) >= 2 and len(ATTENTIONS) >= 4
