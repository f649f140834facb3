"""Typed configs: strict keys, round trips, and shapes that fail at construction."""

from __future__ import annotations

import json
import re
from typing import ClassVar

import pytest

from egmla.config import (ATTENTION_REGISTRY, ConfigError, EGMLAConfig, MHAConfig, MLAConfig,
                          ModelConfig)
from egmla.presets import PRESETS, preset

BASE = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_through_json(name):
    cfg = preset(name)
    data = json.loads(json.dumps(cfg.to_dict()))
    assert ModelConfig.from_dict(data) == cfg
    assert data["attention"]["type"] == cfg.attention.type


def test_every_registered_config_has_its_one_module():
    from egmla.models.attention import ATTENTION_MODULES, AttentionLayer

    assert {"mha", "mla", "egmla"} <= set(ATTENTION_REGISTRY)
    assert set(ATTENTION_MODULES) == set(ATTENTION_REGISTRY)  # derived from it
    for name, cls in ATTENTION_REGISTRY.items():
        module = ATTENTION_MODULES[name]
        assert cls.type == name and issubclass(module, AttentionLayer)
        assert module.config_class is cls


def test_a_type_name_is_registered_once():
    with pytest.raises(ConfigError, match="'mla' of .*Again is taken by egmla.config.MLAConfig"):
        class Again(MLAConfig):
            type: ClassVar[str] = "mla"
    assert ATTENTION_REGISTRY["mla"] is MLAConfig


def test_a_config_without_a_module_fails_by_name():
    from egmla.models.attention import attention_module

    class Orphan(MHAConfig):
        type: ClassVar[str] = "orphan_for_a_test"

    try:
        with pytest.raises(LookupError, match="'orphan_for_a_test'.*config_class = .*Orphan"):
            attention_module(Orphan())
    finally:
        del ATTENTION_REGISTRY["orphan_for_a_test"]


def test_unknown_top_level_key_is_named():
    with pytest.raises(ConfigError, match="'n_layer'"):
        ModelConfig.from_dict({**BASE, "n_layer": 3})


def test_unknown_attention_key_is_named():
    with pytest.raises(ConfigError, match="'dc'.*allowed keys"):
        ModelConfig.from_dict({**BASE, "attention": {"type": "mla", "dc": 16}})


def test_mha_key_is_not_accepted_by_mla():
    with pytest.raises(ConfigError, match="'head_dim'"):
        ModelConfig.from_dict({**BASE, "attention": {"type": "mla", "head_dim": 16}})


def test_unknown_attention_type_lists_choices():
    with pytest.raises(ConfigError, match="'gqa'.*egmla"):
        ModelConfig.from_dict({**BASE, "attention": {"type": "gqa"}})


def test_missing_required_key_is_named():
    with pytest.raises(ConfigError, match="'n_heads'"):
        ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "n_heads"})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention": {"type": "mha", "n_kv_heads": 3}}, "n_kv_heads=3 must divide n_heads=4"),
        ({"d_model": 30}, "d_model=30 is not divisible by n_heads=4"),
        ({"vocab_size": 0}, "vocab_size=0"),
        ({"n_layers": 2.5}, "n_layers=2.5"),
        ({"attention": {"type": "mha", "head_dim": 7}}, "head_dim=7"),
        ({"attention": {"type": "mla", "d_rope": 5}}, "d_rope=5"),
        ({"attention": {"type": "mla", "impl": "fast"}}, "impl='fast'"),
        ({"attention": {"type": "egmla", "gate_group_size": 3}}, "gate_group_size=3"),
        ({"attention": {"type": "egmla", "gate_position": "query"}}, "gate_position='query'"),
        ({"attention": {"type": "egmla", "gate_norm": "batchnorm"}}, "gate_norm='batchnorm'"),
        ({"attention": {"type": "egmla", "gate_init": "zeros"}}, "gate_init='zeros'"),
        ({"attention": {"type": "mla", "n_kv_heads": 3}}, "n_kv_heads=3: must be >= 1 and divide"),
        ({"attention": {"type": "mla", "rope_heads": 0}}, "rope_heads=0: must be >= 1"),
        ({"attention": {"type": "mla", "d_nope": -1}}, "d_nope=-1: must be >= 0"),
        ({"attention": {"type": "mla", "rope_freqs": [[[0] * 32]]}}, "one entry per layer (2)"),
        ({"attention": {"type": "mla", "d_rope": 4, "d_nope": 4,
                        "rope_freqs": [[[0, 1]], [[0, 4]]]}}, "rope_freqs[1][0]=[0, 4]"),
        ({"attention": {"type": "mla", "d_rope": 4, "rope_freqs": [[[1, 1]], [[0, 2]]]}},
         "rope_freqs[0][0]=[1, 1]: needs d_rope/2=2 distinct"),
        ({"attention": {"type": "mla", "d_rope": 4, "rope_heads": 2,
                        "rope_freqs": [[[1, 2]], [[0, 2]]]}}, "one list per RoPE key"),
        ({"attention": {"type": "egmla", "gate_init": "identity"}}, "needs gate_residual=true"),
        ({"attention": {"type": "mla_value_embed", "n_kv_heads": 2}}, "n_kv_heads null"),
    ],
)
def test_impossible_shapes_fail_at_construction(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_dict({**BASE, **change})


@pytest.mark.parametrize("value", [0, -1e-6, float("inf"), float("nan"), "1e-6", True])
def test_latent_norm_eps_must_be_a_positive_finite_number_or_null(value):
    for kind in ("mla", "egmla"):
        with pytest.raises(ConfigError, match=re.escape(f"attention.latent_norm_eps={value!r}: must")):
            ModelConfig.from_dict({**BASE, "attention": {"type": kind, "latent_norm_eps": value}})


def test_latent_norm_eps_round_trips_and_is_null_when_absent():
    """A config written before the key (a run, an export, the study's records) reads it as null:
    the latent norms at the model's norm_eps, as they were."""
    old = ModelConfig.from_dict({**BASE, "attention": {"type": "mla"}})
    assert old.attention.latent_norm_eps is None
    assert old.attention.latent_eps(old) == old.norm_eps == 1e-5
    new = ModelConfig.from_dict({**BASE, "attention": {"type": "egmla", "latent_norm_eps": 1e-6}})
    assert new.attention.latent_eps(new) == 1e-6 and new.norm_eps == 1e-5
    back = ModelConfig.from_dict(json.loads(json.dumps(new.to_dict())))
    assert back == new and back.to_dict()["attention"]["latent_norm_eps"] == 1e-6


def test_defaults_are_filled():
    cfg = ModelConfig(**BASE)
    assert isinstance(cfg.attention, MHAConfig)
    assert cfg.attention.kv_heads(cfg) == 4 and cfg.attention.head_size(cfg) == 8
    assert cfg.d_ff % 64 == 0 and cfg.d_ff >= 8 * 32 // 3


def test_egmla_latent_allows_absorbed():
    cfg = ModelConfig.from_dict(
        {**BASE, "attention": {"type": "egmla", "gate_position": "latent", "impl": "absorbed"}}
    )
    assert isinstance(cfg.attention, EGMLAConfig)


def test_unknown_preset_is_named():
    with pytest.raises(ConfigError, match="'paper-mlaa'"):
        preset("paper-mlaa")
