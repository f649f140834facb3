"""Typed model configuration.

A model is a `ModelConfig` holding one attention config from the registry (`mha`, `mla`,
`egmla`). Configs are plain dataclasses: `from_dict` is strict (an unknown or misspelled key
raises `ConfigError` naming it), `to_dict` returns JSON-ready data, and both round-trip. Shapes
are checked when a config is constructed, so an impossible model fails before any tensor exists.

    >>> cfg = ModelConfig.from_dict({"vocab_size": 256, "d_model": 64, "n_layers": 2,
    ...                              "n_heads": 4, "attention": {"type": "mla", "d_c": 32}})
    >>> cfg.attention.d_c
    32
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _strict_kwargs(cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
    """Reject keys `cls` does not declare, naming the first bad one and the allowed ones."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    allowed = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {unknown[0]!r}; allowed keys: {', '.join(sorted(allowed))}"
        )
    return dict(data)


def _norm_params(kind: str, width: int) -> int:
    """Parameters of a `layernorm` (gain and bias), `rmsnorm` (gain) or `none` over `width`."""
    return {"layernorm": 2 * width, "rmsnorm": width, "none": 0}[kind]


def _check_literals(obj: Any, where: str) -> None:
    """Check every `Literal[...]`-typed field holds one of its allowed values."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        hint = hints[f.name]
        if typing.get_origin(hint) is Literal:
            value = getattr(obj, f.name)
            choices = typing.get_args(hint)
            _check(value in choices, f"{where}.{f.name}={value!r}: must be one of {list(choices)}")


# --------------------------------------------------------------------------------------------
# Attention variants


# Every attention config class by its `type`: a subclass that sets `type` registers itself when
# it is defined (AttentionConfig.__init_subclass__), so a new variant adds its class and no list.
# Its module (egmla.models.attention) names the config class it computes.
ATTENTION_REGISTRY: dict[str, type[AttentionConfig]] = {}


@dataclass
class AttentionConfig:
    """Base of the attention configs. `type` is the registry name, set by each subclass.

    A variant declares here what other code would otherwise have to ask it by type: its
    parameter counts, the label comparisons use, and how it exports (`native_architecture`, the
    transformers architecture a native export targets, or None with `native_refusal` saying
    why, and `native_refusal_reason` for a config of a native type that architecture still
    cannot hold; `hf_layout`, the weight-name families of the remote-code export)."""

    type: ClassVar[str] = ""
    native_architecture: ClassVar[str | None] = None
    native_refusal: ClassVar[str] = ""
    hf_layout: ClassVar[tuple[str, ...]] = ()  # empty: no transformers export (hf_refusal says why)
    hf_refusal: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("type")
        if not name:
            return  # a base shared by variants, or a variant refined without a name of its own
        taken = ATTENTION_REGISTRY.get(name)
        if taken is not None:
            raise ConfigError(f"attention type {name!r} of {cls.__module__}.{cls.__qualname__} is "
                              f"taken by {taken.__module__}.{taken.__qualname__}")
        ATTENTION_REGISTRY[name] = cls

    def validate(self, model: ModelConfig) -> None:
        _check_literals(self, f"attention[{self.type}]")

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **dataclasses.asdict(self)}

    def layer_params(self, model: ModelConfig) -> int:
        """Parameters of one attention layer, without per-token lookup tables."""
        raise NotImplementedError

    def table_groups(self, model: ModelConfig) -> list[range]:
        """The layers sharing each per-token lookup table (EG-MLA's gate tables); none here."""
        return []

    def table_width(self) -> int:
        """Width of each per-token lookup table (a vocab x width embedding)."""
        return 0

    def label(self, model: ModelConfig) -> str:
        """The variant's name in comparisons (mha, gqa, mqa, mla, egmla-kv, ...)."""
        return self.type

    def as_reference(self) -> AttentionConfig:
        """This attention computed the plain way (what exported modeling code runs)."""
        return self

    def native_refusal_reason(self, model: ModelConfig) -> str | None:
        """Why this config has no native export, in one line, or None when it has one."""
        if self.native_architecture is None:
            return self.native_refusal or (f"attention type {self.type!r} has no native "
                                           "transformers architecture")
        return None


@dataclass
class MHAConfig(AttentionConfig):
    """Multi-head attention; `n_kv_heads` < `n_heads` gives GQA, `n_kv_heads=1` MQA.

    Caches K and V: 2 * n_kv_heads * head_dim elements per token per layer.
    """

    type: ClassVar[str] = "mha"
    native_architecture: ClassVar[str | None] = "llama"
    hf_layout: ClassVar[tuple[str, ...]] = ("llama",)
    n_kv_heads: int | None = None  # None: same as the model's n_heads (plain MHA)
    head_dim: int | None = None  # None: d_model // n_heads

    def layer_params(self, model: ModelConfig) -> int:
        d, h, hd, kv = model.d_model, model.n_heads, self.head_size(model), self.kv_heads(model)
        return d * h * hd + 2 * d * kv * hd + h * hd * d

    def label(self, model: ModelConfig) -> str:
        kv_heads = self.kv_heads(model)
        return "mha" if kv_heads == model.n_heads else "mqa" if kv_heads == 1 else "gqa"

    def kv_heads(self, model: ModelConfig) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else model.n_heads

    def head_size(self, model: ModelConfig) -> int:
        return self.head_dim if self.head_dim is not None else model.d_model // model.n_heads

    def validate(self, model: ModelConfig) -> None:
        super().validate(model)
        n_kv = self.kv_heads(model)
        _check(n_kv >= 1, f"attention.n_kv_heads={n_kv}: must be >= 1")
        _check(
            model.n_heads % n_kv == 0,
            f"attention.n_kv_heads={n_kv} must divide n_heads={model.n_heads}",
        )
        if self.head_dim is None:
            _check(
                model.d_model % model.n_heads == 0,
                f"d_model={model.d_model} is not divisible by n_heads={model.n_heads}; "
                "set attention.head_dim explicitly",
            )
        hd = self.head_size(model)
        _check(hd >= 2 and hd % 2 == 0, f"attention.head_dim={hd}: must be even (RoPE) and >= 2")


# transformers' DeepSeek-V3 builds its latent norms (kv_a_layernorm, q_a_layernorm) with this eps,
# not config.rms_norm_eps; DeepSeek's own checkpoints set rms_norm_eps to it as well.
DEEPSEEK_LATENT_NORM_EPS = 1e-6


@dataclass
class MLAConfig(AttentionConfig):
    """Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, section 2.1).

    Caches the normed latent c (d_c) and the shared RoPE key (d_rope): d_c + d_rope elements per
    token per layer. `impl` chooses the computation: `naive` up-projects K/V from the latent and
    runs SDPA; `absorbed` folds W_UK into the query and attends over the latent itself; `auto`
    uses naive without a cache or for multi-token prefill and absorbed for cached decode.
    """

    type: ClassVar[str] = "mla"
    native_architecture: ClassVar[str | None] = "deepseek_v3"
    hf_layout: ClassVar[tuple[str, ...]] = ("deepseek",)
    d_c: int = 256  # KV latent width (DeepSeek's kv_lora_rank)
    d_q: int | None = None  # query latent width (q_lora_rank); None: full-rank query
    d_nope: int = 64  # per-head query/key width without RoPE
    d_rope: int = 64  # decoupled RoPE width (per-head query part and the shared key)
    d_v: int = 64  # per-head value width
    impl: Literal["auto", "naive", "absorbed"] = "auto"
    # eps of the latent RMSNorms (on c, and on the low-rank query when d_q is set); None: the
    # model's norm_eps, as every config written before this field computes. The shipped
    # mla/egmla configs set DeepSeek's 1e-6, which transformers' DeepSeek-V3 fixes for these two
    # norms whatever rms_norm_eps says, so such a model exports natively (docs/training.md).
    latent_norm_eps: float | None = None
    # The forms a converted GQA/MHA model takes (egmla.upcycle; docs/attention.md, "Converted
    # models"). The defaults are DeepSeek's MLA.
    latent_norm: bool = True  # RMSNorm on c; false: c = W_DKV h as it is
    n_kv_heads: int | None = None  # up-projected K/V heads, each shared by n_heads / n_kv_heads
    #                                query heads (one W_UK, W_UV per KV head); None: n_heads
    rope_heads: int = 1  # RoPE keys cached per token, each shared by n_heads / rope_heads query
    #                      heads; 1: DeepSeek's one key shared by all heads
    # Per layer, per RoPE key: the d_rope / 2 frequencies it rotates at, as indices j into the
    # spectrum theta^(-2j / (d_nope + d_rope)) of a head of width d_nope + d_rope (a converted
    # model keeps some of its original head's frequencies); None: theta^(-2j / d_rope), j < d_rope/2
    rope_freqs: list[list[list[int]]] | None = None

    def validate(self, model: ModelConfig) -> None:
        super().validate(model)
        for name in ("d_c", "d_v"):
            _check(getattr(self, name) >= 1, f"attention.{name}={getattr(self, name)}: must be >= 1")
        _check(self.d_nope >= 0, f"attention.d_nope={self.d_nope}: must be >= 0")
        _check(
            self.d_rope >= 2 and self.d_rope % 2 == 0,
            f"attention.d_rope={self.d_rope}: must be even (RoPE) and >= 2",
        )
        _check(self.d_q is None or self.d_q >= 1, f"attention.d_q={self.d_q}: must be >= 1 or null")
        eps = self.latent_norm_eps
        _check(eps is None or (isinstance(eps, (int, float)) and not isinstance(eps, bool)
                               and 0 < eps < math.inf),
               f"attention.latent_norm_eps={eps!r}: must be a positive finite number, or null "
               "(the model's norm_eps)")
        for name, heads in (("n_kv_heads", self.kv_heads(model)), ("rope_heads", self.rope_heads)):
            _check(isinstance(heads, int) and heads >= 1 and model.n_heads % heads == 0,
                   f"attention.{name}={heads}: must be >= 1 and divide n_heads={model.n_heads}")
        if self.rope_freqs is not None:
            self._validate_rope_freqs(model)

    def _validate_rope_freqs(self, model: ModelConfig) -> None:
        spectrum = (self.d_nope + self.d_rope) // 2
        where = "attention.rope_freqs"
        _check(isinstance(self.rope_freqs, list) and len(self.rope_freqs) == model.n_layers,
               f"{where}: needs one entry per layer ({model.n_layers})")
        for i, layer in enumerate(self.rope_freqs):
            _check(isinstance(layer, list) and len(layer) == self.rope_heads,
                   f"{where}[{i}]: needs one list per RoPE key (rope_heads={self.rope_heads})")
            for h, freqs in enumerate(layer):
                ok = (isinstance(freqs, list) and len(freqs) == self.d_rope // 2
                      and len(set(freqs)) == len(freqs)
                      and all(isinstance(j, int) and not isinstance(j, bool) and 0 <= j < spectrum
                              for j in freqs))
                _check(ok, f"{where}[{i}][{h}]={freqs!r}: needs d_rope/2={self.d_rope // 2} "
                       f"distinct frequency indices in [0, {spectrum})")

    def kv_heads(self, model: ModelConfig) -> int:
        """Up-projected K/V heads (n_kv_heads, or n_heads when None)."""
        return self.n_kv_heads if self.n_kv_heads is not None else model.n_heads

    def latent_eps(self, model: ModelConfig) -> float:
        """The eps the latent norms compute with: latent_norm_eps, or the model's norm_eps."""
        return self.latent_norm_eps if self.latent_norm_eps is not None else model.norm_eps

    def layer_freqs(self, layer: int) -> tuple[tuple[int, ...], ...] | None:
        """Layer `layer`'s RoPE frequency indices per RoPE key, or None (the standard ones)."""
        if self.rope_freqs is None:
            return None
        return tuple(tuple(freqs) for freqs in self.rope_freqs[layer])

    def native_refusal_reason(self, model: ModelConfig) -> str | None:
        """DeepSeek-V3 holds DeepSeek's MLA only: each converted form is refused, named."""
        reason = super().native_refusal_reason(model)  # a type with no native form says so first
        if reason:
            return reason
        refused = [
            (not self.latent_norm, "latent_norm=False",
             "DeepSeek-V3 always applies an RMSNorm (kv_a_layernorm) to the latent"),
            (self.kv_heads(model) != model.n_heads, f"n_kv_heads={self.n_kv_heads}",
             "DeepSeek-V3 up-projects one key and value per query head"),
            (self.rope_heads != 1, f"rope_heads={self.rope_heads}",
             "DeepSeek-V3 caches one RoPE key shared by every head"),
            (self.rope_freqs is not None, "rope_freqs (set)",
             "DeepSeek-V3 rotates at the standard frequencies theta^(-2i / qk_rope_head_dim)"),
            (self.d_nope == 0, "d_nope=0",
             "no DeepSeek-V3 has qk_nope_head_dim 0, and its readers are not known to accept it"),
        ]
        for is_refused, option, why in refused:
            if is_refused:
                return (f"attention.{option}: {why}; this converted form exports with "
                        "--format hf (remote code) only")
        if self.latent_eps(model) != DEEPSEEK_LATENT_NORM_EPS:
            # A null comes from a config that does not name the key (the study's small_*.yaml,
            # a run from before it existed): Hydra adds a key with "+".
            if self.latent_norm_eps is None:
                setting, plus = f"null (so norm_eps={model.norm_eps:g} applies)", "+"
            else:
                setting, plus = f"{self.latent_norm_eps:g}", ""
            return (f"attention.latent_norm_eps={setting}: transformers' DeepSeek-V3 computes its "
                    f"latent norms (kv_a_layernorm, q_a_layernorm) with eps "
                    f"{DEEPSEEK_LATENT_NORM_EPS:g} whatever rms_norm_eps says; train with "
                    f"{plus}model.attention.latent_norm_eps={DEEPSEEK_LATENT_NORM_EPS:g} (as "
                    "mla.yaml sets it), or export with --format hf")
        return None

    def layer_params(self, model: ModelConfig) -> int:
        d, h, g = model.d_model, model.n_heads, self.kv_heads(model)
        q_width = h * (self.d_nope + self.d_rope)
        q = d * q_width if self.d_q is None else d * self.d_q + self.d_q + self.d_q * q_width
        kv = (d * (self.d_c + self.rope_heads * self.d_rope) + self.d_c * self.latent_norm
              + self.d_c * g * (self.d_nope + self.d_v))
        return q + kv + h * self.d_v * d

    def as_reference(self) -> MLAConfig:
        return dataclasses.replace(self, impl="naive")


@dataclass
class EGMLAConfig(MLAConfig):
    """MLA with a token-ID embedding gate (EG-MLA, arXiv 2509.16686).

    Each group of `gate_group_size` consecutive layers shares a table E (vocab x d_e); the layer
    up-projects g = W_UE E[token] and multiplies it into the KV path, then applies `gate_norm`.
    `gate_position: kv` gates the up-projected K/V (u = W_UKV c; K,V = Norm(u * g)); the cache
    holds the latent, the token ids and (unless `impl: naive`) the norm's per-token statistics.
    `naive` rebuilds K/V from the latent and the ids at every step; `absorbed` uses the cached
    statistics to attend over the latent directly (exact, no K/V rebuilt); `auto` picks the
    cheaper of the two per step. `gate_position: latent` gates the latent (c' = Norm(c * g))
    before it is cached, so decode is MLA's absorbed decode and token ids need not be cached.
    See docs/attention.md.
    """

    type: ClassVar[str] = "egmla"
    native_architecture: ClassVar[str | None] = None
    native_refusal: ClassVar[str] = (
        "EG-MLA has no native export: its embedding gate (a token-id table multiplied into the KV "
        "path) has no counterpart in any architecture transformers or vLLM ship; use --format hf "
        "(remote code) instead")
    hf_layout: ClassVar[tuple[str, ...]] = ("deepseek", "gate")
    d_e: int = 256
    gate_position: Literal["kv", "latent"] = "kv"
    gate_norm: Literal["layernorm", "rmsnorm", "none"] = "layernorm"
    gate_group_size: int = 1  # consecutive layers sharing one gate table
    # How the gate starts (docs/attention.md; benchmarks/results/gate_init.md): `small` (default,
    # the lowest loss measured) E and W_UE ~ N(0, init_std^2); `random` E ~ N(0, 1),
    # W_UE ~ N(0, 1/d_e), a unit-scale gate; `matched` that gate with, under `kv`, the gate norm's
    # gain set so the normed K/V start at MLA's scale (init_std * sqrt(d_c)).
    # `identity`: E ~ N(0, 1) and W_UE = 0, so that with `gate_residual` the gate starts as 1
    # (a converted MLA's logits at step 0; egmla.upcycle).
    gate_init: Literal["small", "random", "matched", "identity"] = "small"
    # g = 1 + W_UE E[id] instead of W_UE E[id]: with W_UE = 0 the gate is the identity, and W_UE
    # still receives a gradient (through E's rows), so the gate can leave it.
    gate_residual: bool = False

    def validate(self, model: ModelConfig) -> None:
        super().validate(model)
        _check(self.d_e >= 1, f"attention.d_e={self.d_e}: must be >= 1")
        _check(self.gate_init != "identity" or self.gate_residual,
               "attention.gate_init='identity' needs gate_residual=true (W_UE = 0 makes the "
               "gate W_UE E[id] zero, not one)")
        _check(
            self.gate_group_size >= 1 and model.n_layers % self.gate_group_size == 0,
            f"attention.gate_group_size={self.gate_group_size} must be >= 1 and divide "
            f"n_layers={model.n_layers}",
        )

    def n_gate_tables(self, model: ModelConfig) -> int:
        return model.n_layers // self.gate_group_size

    def layer_params(self, model: ModelConfig) -> int:
        gated = self.gated_width(model)
        return super().layer_params(model) + self.d_e * gated + _norm_params(self.gate_norm, gated)

    def table_groups(self, model: ModelConfig) -> list[range]:
        size = self.gate_group_size
        return [range(g * size, (g + 1) * size) for g in range(self.n_gate_tables(model))]

    def table_width(self) -> int:
        return self.d_e

    def label(self, model: ModelConfig) -> str:
        return f"egmla-{self.gate_position}"

    def gated_width(self, model: ModelConfig) -> int:
        """Width of the gate g: n_kv_heads * (d_nope + d_v) under `kv`, d_c under `latent`."""
        if self.gate_position == "kv":
            return self.kv_heads(model) * (self.d_nope + self.d_v)
        return self.d_c


# ---- the study's control arms (docs/study.md): what a gain of EG-MLA's is made of -------------

_CONTROL_REFUSAL = ("{name} is a study control with no exported modeling code (neither native "
                    "nor transformers remote code); evaluate it in egmla (the lm-eval adapter, "
                    "serve) instead")


@dataclass
class EGMLAConstGateConfig(EGMLAConfig):
    """EG-MLA with every token sharing one gate row: the same computation, init and norm as the
    token-id gate, with no token identity (g = W_UE e for one learned e of width d_e). The
    control for `gate_position: kv`: no token ids are cached, so its KV bytes are MLA's at the
    same d_c plus the norm statistics of the absorbed decode."""

    type: ClassVar[str] = "egmla_const_gate"
    native_refusal: ClassVar[str] = _CONTROL_REFUSAL.format(name="egmla_const_gate")
    hf_layout: ClassVar[tuple[str, ...]] = ()
    hf_refusal: ClassVar[str] = _CONTROL_REFUSAL.format(name="egmla_const_gate")

    def table_groups(self, model: ModelConfig) -> list[range]:
        return []  # the one row is a parameter of each layer, counted in layer_params

    def layer_params(self, model: ModelConfig) -> int:
        return super().layer_params(model) + self.d_e  # the shared row e

    def label(self, model: ModelConfig) -> str:
        return f"egmla-{self.gate_position}-const"


@dataclass
class EGMLAHiddenGateConfig(EGMLAConfig):
    """EG-MLA `latent` gated from the hidden state instead of the token id: c' = Norm(c *
    sigmoid(W_G h)) with W_G (d_model -> d_c), the same norm, and c' cached, so its KV bytes equal
    `egmla` latent's. The control for `gate_position: latent` (gating, without token identity)."""

    type: ClassVar[str] = "egmla_hidden_gate"
    native_refusal: ClassVar[str] = _CONTROL_REFUSAL.format(name="egmla_hidden_gate")
    hf_layout: ClassVar[tuple[str, ...]] = ()
    hf_refusal: ClassVar[str] = _CONTROL_REFUSAL.format(name="egmla_hidden_gate")
    gate_position: Literal["latent"] = "latent"  # d_e, gate_group_size and gate_init are unused

    def table_groups(self, model: ModelConfig) -> list[range]:
        return []

    def table_width(self) -> int:
        return 0

    def layer_params(self, model: ModelConfig) -> int:
        return (MLAConfig.layer_params(self, model) + model.d_model * self.d_c
                + _norm_params(self.gate_norm, self.d_c))

    def label(self, model: ModelConfig) -> str:
        return "egmla-latent-hidden"


@dataclass
class MLAValueEmbedConfig(MLAConfig):
    """MLA plus a per-layer token-id embedding added to the values: v = W_UV c + W_VE E[id] with E
    (vocab x d_e) per layer and W_VE (d_e -> H * d_v). Token identity in the values without
    multiplication: the control that separates EG-MLA's lookup from its gating. The cache holds
    MLA's fields and the token ids (once per sequence); decode stays absorbed (the attended
    embedding is up-projected once per query)."""

    type: ClassVar[str] = "mla_value_embed"
    native_architecture: ClassVar[str | None] = None
    native_refusal: ClassVar[str] = _CONTROL_REFUSAL.format(name="mla_value_embed")
    hf_layout: ClassVar[tuple[str, ...]] = ()
    hf_refusal: ClassVar[str] = _CONTROL_REFUSAL.format(name="mla_value_embed")
    d_e: int = 64

    def validate(self, model: ModelConfig) -> None:
        super().validate(model)
        _check(self.d_e >= 1, f"attention.d_e={self.d_e}: must be >= 1")
        _check(self.kv_heads(model) == model.n_heads and self.rope_heads == 1,
               "attention[mla_value_embed]: takes one up-projection per query head and one "
               "shared RoPE key (n_kv_heads null, rope_heads 1)")

    def layer_params(self, model: ModelConfig) -> int:
        return super().layer_params(model) + self.d_e * model.n_heads * self.d_v

    def table_groups(self, model: ModelConfig) -> list[range]:
        return [range(i, i + 1) for i in range(model.n_layers)]

    def table_width(self) -> int:
        return self.d_e

    def label(self, model: ModelConfig) -> str:
        return "mla-value-embed"


@dataclass
class MLAKVEmbedConfig(MLAValueEmbedConfig):
    """MLA plus a per-layer token-id embedding added to the keys and the values: k_j = W_UK c_j +
    W_KE E[id_j], v_j = W_UV c_j + W_VE E[id_j]. Token identity where EG-MLA `kv` puts it (K and
    V), added instead of multiplied: with `egmla_v_gate`, the control that separates adding from
    multiplying (`mla_value_embed` touches V only)."""

    type: ClassVar[str] = "mla_kv_embed"
    native_refusal: ClassVar[str] = _CONTROL_REFUSAL.format(name="mla_kv_embed")
    hf_refusal: ClassVar[str] = _CONTROL_REFUSAL.format(name="mla_kv_embed")

    def validate(self, model: ModelConfig) -> None:
        super().validate(model)
        _check(self.d_nope >= 1, "attention[mla_kv_embed]: needs d_nope >= 1 (the keys' part "
               "that the embedding is added to)")

    def layer_params(self, model: ModelConfig) -> int:
        return super().layer_params(model) + self.d_e * model.n_heads * self.d_nope

    def label(self, model: ModelConfig) -> str:
        return "mla-kv-embed"


@dataclass
class EGMLAValueGateConfig(EGMLAConfig):
    """EG-MLA `kv` with the token-id gate on the values only: [k; v] = [W_UK c; Norm(W_UV c *
    g)], g = W_UE E[id] of width n_kv_heads * d_v. Multiplying where `mla_value_embed` adds (V
    only): with `mla_kv_embed`, the control that separates multiplying from adding. It runs the
    rebuild only (`impl: naive`): no absorbed form is written for it."""

    type: ClassVar[str] = "egmla_v_gate"
    native_refusal: ClassVar[str] = _CONTROL_REFUSAL.format(name="egmla_v_gate")
    hf_layout: ClassVar[tuple[str, ...]] = ()
    hf_refusal: ClassVar[str] = _CONTROL_REFUSAL.format(name="egmla_v_gate")
    gate_position: Literal["kv"] = "kv"
    impl: Literal["naive"] = "naive"

    def validate(self, model: ModelConfig) -> None:
        super().validate(model)
        _check(self.impl == "naive", f"attention[egmla_v_gate].impl={self.impl!r}: this control "
               "runs the rebuild only (impl: naive)")
        _check(self.gate_position == "kv", "attention[egmla_v_gate]: gates the values "
               f"(gate_position kv), not {self.gate_position!r}")

    def gated_width(self, model: ModelConfig) -> int:
        return self.kv_heads(model) * self.d_v

    def label(self, model: ModelConfig) -> str:
        return "egmla-v-gate"


def attention_from_dict(data: dict[str, Any]) -> AttentionConfig:
    if not isinstance(data, dict) or "type" not in data:
        raise ConfigError(
            f"attention: needs a 'type' key, one of {sorted(ATTENTION_REGISTRY)}; got {data!r}"
        )
    kind = data["type"]
    if kind not in ATTENTION_REGISTRY:
        raise ConfigError(f"attention.type={kind!r}: must be one of {sorted(ATTENTION_REGISTRY)}")
    cls = ATTENTION_REGISTRY[kind]
    kwargs = _strict_kwargs(cls, {k: v for k, v in data.items() if k != "type"}, f"attention[{kind}]")
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------
# Model

# ModelConfig.ffn -> the `hidden_act` of a gated Llama / DeepSeek-V3 MLP, down(act(gate) * up),
# that computes it; dReLU and squared ReLU have no such form (egmla.export.native refuses them).
FFN_HIDDEN_ACT = {"swiglu": "silu", "reglu": "relu"}


@dataclass
class ModelConfig:
    """A decoder-only transformer: pre-norm blocks of attention and an MLP (`ffn`: SwiGLU, or a
    ReLU-family activation whose sparsity the activation-locality work uses;
    egmla.models.layers.FeedForward gives the formulas)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    attention: AttentionConfig = field(default_factory=MHAConfig)
    d_ff: int | None = None  # MLP width; None: 8/3 d_model rounded up to 64 (relu2: 1.5x that)
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    # Token ids, used by `generate` and imported tokenizers; optional.
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # The MLP's activation. The default widths give every activation the same parameters: relu2
    # has no gate matrix, so its default d_ff is 1.5x the gated ones'.
    ffn: Literal["swiglu", "reglu", "drelu", "relu2"] = "swiglu"

    def __post_init__(self) -> None:
        if isinstance(self.attention, dict):
            self.attention = attention_from_dict(self.attention)
        if self.d_ff is None and isinstance(self.d_model, int):
            self.d_ff = 64 * -(-(8 * self.d_model // 3) // 64)
            if self.ffn == "relu2":
                self.d_ff = 3 * self.d_ff // 2
        self.validate()

    @property
    def ffn_matrices(self) -> int:
        """d_model x d_ff matrices per MLP: 3 (gate, up, down), or 2 for relu2 (no gate)."""
        return 2 if self.ffn == "relu2" else 3

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            _check(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{name}={value!r}: must be a positive integer",
            )
        _check_literals(self, "model")
        _check(self.rope_theta > 0, f"rope_theta={self.rope_theta}: must be > 0")
        _check(self.norm_eps > 0, f"norm_eps={self.norm_eps}: must be > 0")
        _check(
            isinstance(self.attention, AttentionConfig),
            f"attention: expected an attention config, got {type(self.attention).__name__}",
        )
        self.attention.validate(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        kwargs = _strict_kwargs(cls, data, "model")
        if "attention" in kwargs:
            kwargs["attention"] = attention_from_dict(kwargs["attention"])
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
            and f.name not in kwargs
        ]
        if missing:
            raise ConfigError(f"model: missing required key {missing[0]!r}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["attention"] = self.attention.to_dict()
        return out

    # ---- analytic sizes ---------------------------------------------------------------------

    def num_params(self, include_gate_tables: bool = True) -> int:
        """Parameter count computed from the config (checked against the built module)."""
        d, V, L, a = self.d_model, self.vocab_size, self.n_layers, self.attention
        per_layer = 2 * d + self.ffn_matrices * d * self.d_ff + a.layer_params(self)  # 2 norms + MLP
        total = V * d + L * per_layer + d + (0 if self.tie_embeddings else V * d)
        if include_gate_tables:
            total += len(a.table_groups(self)) * V * a.table_width()
        return total
