"""Convert a pretrained GQA/MHA model to MLA or EG-MLA, training-free (MHA2MLA's recipe).

    mla = convert(model, to="mla", d_c=48, rope_dims=8, calibration=ids)     # a Transformer
    eg = convert(model, to="egmla", d_c=48, rope_dims=8, calibration=ids)    # step 0 == mla
    result = upcycle(model, to="mla", d_c=48, rope_dims=8, calibration=ids)  # + the record

Per layer, with G KV heads of width d_h (R = H / G query heads each) and r = rope_dims
(MHA2MLA, arXiv 2502.14837; the public code JT-Ushio/MHA2MLA):

1. Partial RoPE. Each KV head g keeps r/2 of its d_h/2 frequency pairs (pair j = dims j and
   j + d_h/2, rotated at theta^(-2j/d_h)), chosen by `rule` (egmla.upcycle.rope): `2norm`
   (the pairs whose query/key 2-norm product contributes most on calibration text, summed
   over the R query heads that read the key: MHA2MLA's best), `uniform`, `high` or `low`.
   Query heads follow their KV head. The other d_h - r dims of each key and query lose RoPE:
   they become the non-RoPE part (d_nope = d_h - r), so q.k is unchanged but for rotation.
2. Joint SVD (egmla.upcycle.svd). The non-RoPE key rows and the value rows of all G KV heads,
   stacked as the up-projection is laid out ([K_nope,0; V_0; K_nope,1; V_1; ...], N = G (2 d_h
   - r) rows), are factored in float64: W ~ U_k S_k V_k^T, the latent c = V_k^T h (d_c wide,
   W_DKV) and the up-projection U_k S_k (W_UKV, one block per KV head, shared by its query
   heads): `svd="plain"`, MHA2MLA's default. `svd="whitened"` (the default here) factors W L
   instead (L L^T the second moment of the layer's inputs on calibration text), so the error
   is small where the inputs are: MHA2MLA's activation-aware option. On SmolLM2 it is the
   difference between a usable and a broken starting point (docs/upcycling.md: held-out
   perplexity 253 against 6,456 at d_c 96, on the recovery domain). At d_c = N nothing is cut:
   the model equals the original with RoPE removed from the unselected pairs (exactly, in exact
   arithmetic), and with r = d_h it equals the original.
3. EG-MLA (`to="egmla"`). By default the gate starts as the identity (`gate_form="identity"`):
   g = 1 + W_UE E[id] with W_UE = 0, no gate norm, no latent norm, so step 0 computes the MLA
   conversion's function and W_UE still receives a gradient through E's random rows.
   `gate_form="paper"` is the paper's form, LayerNorm after the gate, which no init can make
   the identity: the gate starts at 1 (E's first column 1, W_UE's first column 1, the rest of
   W_UE 0) and the LayerNorm's gain and bias are fitted per dimension by least squares on
   calibration text so that LN(u) ~ u. What that costs is measured, not assumed.

The cache: d_c + G r elements per token per layer (SmolLM2-135M, G = 3, r = 8: d_c 96, 48, 24
give 120, 72, 48 against the original's 384).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from egmla.config import ConfigError, EGMLAConfig, MLAConfig, ModelConfig
from egmla.models.attention.common import RopeKV
from egmla.models.transformer import Transformer
from egmla.provenance import machine_memory_bytes
from egmla.upcycle.rope import RULES, select_frequencies
from egmla.upcycle.svd import SVD_KINDS, factor
from egmla.upcycle.stats import LayerStats, collect_stats

TARGETS = ("mla", "egmla")
GATE_FORMS = ("identity", "paper")
# EG-MLA's gate defaults for a converted model: d_e 32, one table per two layers (the study
# found neither costs anything at small scale; at d_e 64 per layer SmolLM2 would gain 94M
# lookup parameters on its 135M).
GATE_DEFAULTS = {"d_e": 32, "gate_group_size": 2, "gate_position": "kv"}


class UpcycleError(ValueError):
    """A conversion that cannot be done as asked; the message names the value."""


@dataclass
class Upcycled:
    """A converted model and what the conversion chose, per layer."""

    model: Transformer
    options: dict[str, Any]  # the arguments of the conversion, JSON-ready
    freqs: list[list[list[int]]]  # [layer][KV head] -> the frequency pairs kept with RoPE
    energy: list[float]  # [layer] share of the squared singular values kept (of W, or of W L)
    calibration_tokens: int = 0
    gate: dict[str, Any] = field(default_factory=dict)  # the paper form's fitted norm, if any

    def record(self) -> dict[str, Any]:
        """JSON-ready: the options, per-layer frequencies and energy, the cache per token."""
        spec = self.model.cache_spec()
        return {"options": self.options, "calibration_tokens": self.calibration_tokens,
                "rope_freqs": self.freqs, "energy_kept": [round(e, 6) for e in self.energy],
                "kv_elements_per_token": spec.elements_per_token(),
                "kv_bytes_per_token_bf16": spec.bytes_per_token(torch.bfloat16),
                "params": self.model.num_params(),
                "params_without_lookup_tables": self.model.num_params(include_gate_tables=False),
                **({"gate": self.gate} if self.gate else {})}


def convert(model: Transformer, *, to: str, d_c: int, rope_dims: int, rule: str = "2norm",
            calibration: torch.Tensor | None = None, **options: Any) -> Transformer:
    """`model` (MHA/GQA) converted to `to` ("mla" or "egmla"): a new Transformer in the source's
    dtype; see the module docstring and `upcycle` for the options."""
    return upcycle(model, to=to, d_c=d_c, rope_dims=rope_dims, rule=rule,
                   calibration=calibration, **options).model


def upcycle(model: Transformer, *, to: str, d_c: int, rope_dims: int, rule: str = "2norm",
            calibration: torch.Tensor | None = None, svd: str = "whitened",
            gate_form: str = "identity", gate_position: str | None = None,
            d_e: int | None = None, gate_group_size: int | None = None, seed: int = 0,
            batch_size: int = 4, progress: bool = False,
            stats: list[LayerStats] | None = None) -> Upcycled:
    """Convert `model` and record what was chosen (see the module docstring).

    `calibration` (N, T) token ids: needed by `rule="2norm"`, `svd="whitened"` and
    `gate_form="paper"`. `gate_position` ("kv" or "latent"), `d_e`, `gate_group_size`: the EG-MLA
    gate (GATE_DEFAULTS). `seed` draws the gate tables. `progress`: a bar over the calibration.
    `stats`: `calibration_stats(model, calibration)` computed once for several conversions of
    the same model and calibration (else computed here).
    """
    options, gate = check_options(model, to=to, d_c=d_c, rope_dims=rope_dims, rule=rule,
                                  svd=svd, gate_form=gate_form, gate_position=gate_position,
                                  d_e=d_e, gate_group_size=gate_group_size, seed=seed)
    if to == "egmla":
        options["seed"] = seed
    needs_data = rule == "2norm" or svd == "whitened" or bool(gate) and gate_form == "paper"
    _check(not needs_data or calibration is not None,
           f"rule={rule!r}, svd={svd!r}, gate_form={gate_form!r}: needs calibration token ids")
    source = model.config
    layers = _source_layers(model)
    d_h = layers[0].rope.dim
    H, G = source.n_heads, layers[0].wk.shape[0] // d_h

    if stats is None and calibration is not None:
        stats = collect_stats(model, layers, calibration, batch_size=batch_size,
                              progress=progress, covariance=svd == "whitened")
    _check(stats is None or len(stats) == source.n_layers, "stats: one per layer")
    freqs = [select_frequencies(G, d_h, rule, rope_dims, None if stats is None else stats[i])
             for i in range(source.n_layers)]
    config = _target_config(source, G, d_h, to, d_c, rope_dims, freqs, gate)
    with torch.no_grad():
        dtype = model.tok_emb.weight.dtype
        target = Transformer(config).to(dtype)
        target.load_state_dict(_carried_weights(model), strict=False)  # embeddings, norms, MLPs
        energy = []
        for i, (src, dst) in enumerate(zip(layers, target.layers)):
            layer_stats = None if stats is None else stats[i]
            energy.append(_convert_layer(src, dst.attn, H, freqs[i], d_c, svd, layer_stats))
        fitted = _init_gate(target, gate, seed, model, calibration, batch_size)
    n_tokens = 0 if calibration is None else int(calibration.numel())
    return Upcycled(target.eval(), options, freqs, energy, n_tokens, fitted)


def check_options(model: Transformer, *, to: str, d_c: int, rope_dims: int,
                  rule: str = "2norm", svd: str = "whitened", gate_form: str = "identity",
                  gate_position: str | None = None, d_e: int | None = None,
                  gate_group_size: int | None = None,
                  seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every check `upcycle` makes of its options against `model`, before any calibration or
    conversion work (UpcycleError naming the value); returns the record's options and the
    gate's settings (empty for MLA)."""
    source = model.config
    layers = _source_layers(model)
    d_h = layers[0].rope.dim
    G = layers[0].wk.shape[0] // d_h
    _check_choice("to", to, TARGETS)
    _check_choice("rule", rule, RULES)
    _check_choice("svd", svd, SVD_KINDS)
    full = G * (2 * d_h - rope_dims) if _is_int(rope_dims) else 0
    _check(_is_int(rope_dims) and 2 <= rope_dims <= d_h and rope_dims % 2 == 0,
           f"rope_dims={rope_dims!r}: must be even, in [2, {d_h}] (the head width)")
    _check(_is_int(d_c) and 1 <= d_c <= full,
           f"d_c={d_c!r}: must be in [1, {full}]; {full} = {G} KV heads x (2 x {d_h} - "
           f"rope_dims {rope_dims}) keeps everything")
    options = {"to": to, "d_c": d_c, "rope_dims": rope_dims, "rule": rule, "svd": svd}
    gate: dict[str, Any] = {}
    if to == "egmla":
        _check_choice("gate_form", gate_form, GATE_FORMS)
        gate = {"gate_form": gate_form, **GATE_DEFAULTS,
                **{k: v for k, v in (("gate_position", gate_position), ("d_e", d_e),
                                     ("gate_group_size", gate_group_size)) if v is not None}}
        _check(gate_form != "paper" or gate["gate_position"] == "kv",
               "gate_form='paper' is the kv gate followed by LayerNorm: gate_position must be kv")
        for name in ("d_e", "gate_group_size"):
            _check(_is_int(gate[name]), f"{name}={gate[name]!r}: must be an integer")
        _check(_is_int(seed) and 0 <= seed < 2**64, f"seed={seed!r}: must be in [0, 2**64)")
        options.update(gate)
    placeholder = [[list(range(rope_dims // 2))] * G] * source.n_layers
    target = _target_config(source, G, d_h, to, d_c, rope_dims, placeholder, gate)  # its checks
    _check_memory(model, target, gate)
    return options, gate


def calibration_stats(model: Transformer, calibration: torch.Tensor, batch_size: int = 4,
                      progress: bool = False) -> list[LayerStats]:
    """The calibration sums every rule and SVD kind needs, for reuse across conversions."""
    return collect_stats(model, _source_layers(model), calibration, batch_size=batch_size,
                         progress=progress, covariance=True)


# --------------------------------------------------------------------------------------------
# Checks


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise UpcycleError(message)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{name}={value!r}: must be one of {', '.join(choices)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_memory(model: Transformer, target: ModelConfig, gate: dict[str, Any]) -> None:
    """The converted model is built beside the source: refuse one whose weights alone would not
    fit the machine's memory (a wide gate table: d_e x vocab per table) before allocating it."""
    memory = machine_memory_bytes()
    itemsize = model.tok_emb.weight.element_size()
    need = target.num_params() * itemsize
    have = sum(p.numel() for p in model.parameters()) * itemsize
    if memory is None or need + have <= memory:
        return
    what = f"d_e={gate['d_e']}" if gate else f"d_c={target.attention.d_c}"
    raise UpcycleError(f"{what}: the converted model's weights would take {need / 2**30:,.1f} GiB "
                       f"beside the source's {have / 2**30:,.1f} GiB; this machine has "
                       f"{memory / 2**30:,.1f} GiB of memory")


def _source_layers(model: Transformer) -> list[RopeKV]:
    """Each layer's attention as plain RoPE attention over K and V heads (what MHA/GQA layers
    declare, `AttentionLayer.rope_kv_attention`), with the standard RoPE; else refused."""
    layers = [block.attn.rope_kv_attention() for block in model.layers]
    kind = model.config.attention.type
    _check(all(a is not None for a in layers),
           f"the source model's attention is {kind!r}: only MHA/GQA models (Llama architecture) "
           "convert")
    for a in layers:
        _check(a.rope.freqs is None and abs(a.scale - a.rope.dim**-0.5) < 1e-12,
               f"the source model's attention ({kind!r}) is not standard RoPE attention")
    return layers


# --------------------------------------------------------------------------------------------
# The target


def _target_config(source: ModelConfig, G: int, d_h: int, to: str, d_c: int, rope_dims: int,
                   freqs: list[list[list[int]]], gate: dict[str, Any]) -> ModelConfig:
    latent = {"d_c": d_c, "d_nope": d_h - rope_dims, "d_rope": rope_dims, "d_v": d_h,
              "latent_norm": False, "n_kv_heads": G, "rope_heads": G, "rope_freqs": freqs}
    if to == "mla":
        attention: MLAConfig = MLAConfig(**latent)
    elif gate["gate_form"] == "identity":
        attention = EGMLAConfig(**latent, d_e=gate["d_e"], gate_group_size=gate["gate_group_size"],
                                gate_position=gate["gate_position"], gate_norm="none",
                                gate_residual=True, gate_init="identity")
    else:
        attention = EGMLAConfig(**latent, d_e=gate["d_e"], gate_group_size=gate["gate_group_size"],
                                gate_position="kv", gate_norm="layernorm")
    try:
        return dataclasses.replace(source, attention=attention)
    except ConfigError as err:  # e.g. gate_group_size not dividing the layers
        raise UpcycleError(str(err)) from None


def _carried_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """Every weight but the attention's: embeddings, norms, MLPs, the LM head."""
    return {k: v for k, v in model.state_dict().items() if ".attn." not in k}


def _convert_layer(src: RopeKV, dst: nn.Module, H: int, freqs: list[list[int]], d_c: int,
                   svd: str, stats: LayerStats | None) -> float:
    """Write one converted attention layer's weights into `dst`; return the energy kept."""
    d_h = src.rope.dim
    G = src.wk.shape[0] // d_h
    R, half = H // G, d_h // 2
    wq = src.wq.double().view(H, d_h, -1)  # (H, d_h, d)
    wk = src.wk.double().view(G, d_h, -1)  # (G, d_h, d)
    wv = src.wv.double().view(G, d_h, -1)
    q_rows, k_rope, kv_rows = [], [], []
    for g in range(G):
        rope = list(freqs[g]) + [j + half for j in freqs[g]]  # half-split: pair i = (i, i + r/2)
        kept = set(rope)
        nope = [j for j in range(d_h) if j not in kept]
        order = torch.tensor(nope + rope)
        q_rows += [wq[h][order] for h in range(g * R, (g + 1) * R)]  # [nope; rope] per head
        k_rope.append(wk[g][rope])
        kv_rows += [wk[g][nope], wv[g]]  # the up-projection's layout: [K_nope,g; V_g]
    down, up, energy = factor(torch.cat(kv_rows), d_c, svd,
                              None if stats is None else stats.covariance())
    dst.wq.weight.copy_(torch.cat(q_rows))
    dst.wkv_a.weight.copy_(torch.cat([down, *k_rope]))
    dst.wkv_b.weight.copy_(up)
    dst.wo.weight.copy_(src.wo)
    return energy


# --------------------------------------------------------------------------------------------
# EG-MLA's gate


def _init_gate(target: Transformer, gate: dict[str, Any], seed: int, source: Transformer,
               calibration: torch.Tensor | None, batch_size: int) -> dict[str, Any]:
    """Draw the gate tables from `seed`; the identity form is then exact (W_UE = 0). The paper
    form starts its gate at 1 and fits its LayerNorm to the MLA K/V (returns the fit's error)."""
    if not gate:
        return {}
    g = torch.Generator().manual_seed(seed)
    tables = {id(b.attn.gate_table): b.attn.gate_table for b in target.layers}
    for table in tables.values():
        table.weight.copy_(torch.randn(table.weight.shape, generator=g))
    for block in target.layers:
        block.attn.w_gate.weight.zero_()
    if gate["gate_form"] == "identity":
        return {}
    for table in tables.values():
        table.weight[:, 0] = 1.0  # g = W_UE e = 1 through the first column, at step 0 only:
    for block in target.layers:  # E's other columns are random, so W_UE's others get a gradient
        block.attn.w_gate.weight[:, 0] = 1.0
    from egmla.upcycle.stats import fit_gate_norms

    return fit_gate_norms(target, source, calibration, batch_size)
