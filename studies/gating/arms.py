"""The arms' configurations, composed by Hydra as train.py composes them: the model of an arm,
the FFN width that matches MLA's parameters to EG-MLA's, and what the record says of each
arm (parameters, KV bytes per token)."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from studies.gating.protocol import ABLATIONS, ARM, BASE


def model_of(attention: str, overrides: Iterable[str] = (), base: Iterable[str] = BASE):
    from egmla.config import ModelConfig

    return ModelConfig.from_dict(_composed_model(attention, tuple(overrides), tuple(base)))


@functools.lru_cache(maxsize=None)
def _composed_model(attention: str, overrides: tuple[str, ...], base: tuple[str, ...]) -> dict:
    """The model section Hydra composes for these overrides (composed once: the record is
    rewritten after every run and describes every arm)."""
    from egmla.training.compose import compose_config

    return compose_config([*base, f"model/attention={attention}", *overrides])["model"]


def param_matched_d_ff(base: Iterable[str] = BASE) -> int:
    """d_ff that gives MLA d_c 32 as many parameters as EG-MLA kv, lookup tables included."""
    target = model_of("small_egmla", base=base).num_params(include_gate_tables=True)
    mla = model_of("small_mla_dc32", base=base)
    per_unit = 3 * mla.d_model * mla.n_layers  # SwiGLU parameters per unit of d_ff
    return mla.d_ff + round((target - mla.num_params()) / per_unit)


def arm_overrides(arm: str, base: Iterable[str] = BASE) -> tuple[str, ...]:
    if arm == "mla_param_matched":
        return (f"model.d_ff={param_matched_d_ff(base)}",)
    return ARM[arm].overrides if arm in ARM else ABLATIONS[arm][1]


def describe(attention: str, overrides: Iterable[str], base: Iterable[str] = BASE) -> dict[str, Any]:
    import torch

    from egmla.models import cache_spec_for

    cfg = model_of(attention, overrides, base)
    spec = cache_spec_for(cfg)
    return {"attention": cfg.attention.to_dict(), "variant": cfg.attention.label(cfg),
            "d_e": getattr(cfg.attention, "d_e", None), "d_ff": cfg.d_ff,
            "params": cfg.num_params(include_gate_tables=True),
            "params_without_lookup_tables": cfg.num_params(include_gate_tables=False),
            "kv_bytes_per_token_bf16": spec.bytes_per_token(torch.bfloat16),
            "kv_elements_per_token": spec.elements_per_token()}
