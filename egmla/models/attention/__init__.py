"""Attention variants behind one interface (`AttentionLayer`): `forward(x, positions,
cache=None, token_ids=None)`, `cache_spec()`, and how their layers are built, initialized and
counted. Adding a variant: its config in egmla/config.py (ATTENTION_REGISTRY), its module here
(ATTENTION_MODULES)."""

from __future__ import annotations

from egmla.config import ModelConfig
from egmla.models.attention.common import AttentionLayer
from egmla.models.attention.controls import EGMLAConstGate, EGMLAHiddenGate, MLAValueEmbed
from egmla.models.attention.egmla import EGMLA
from egmla.models.attention.mha import MHA
from egmla.models.attention.mla import MLA

ATTENTION_MODULES: dict[str, type[AttentionLayer]] = {
    "mha": MHA, "mla": MLA, "egmla": EGMLA,
    # the study's controls (controls.py)
    "egmla_const_gate": EGMLAConstGate, "egmla_hidden_gate": EGMLAHiddenGate,
    "mla_value_embed": MLAValueEmbed,
}


def build_attention(config: ModelConfig) -> list[AttentionLayer]:
    """The model's attention layers, built by the module of `config.attention.type`."""
    return ATTENTION_MODULES[config.attention.type].build_layers(config)


__all__ = ["ATTENTION_MODULES", "EGMLA", "MHA", "MLA", "AttentionLayer", "EGMLAConstGate",
           "EGMLAHiddenGate", "MLAValueEmbed", "build_attention"]
