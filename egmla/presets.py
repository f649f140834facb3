"""Named model configurations: the paper's 12-layer d=768 setting, and small ones for CPUs.

The paper (EG-MLA, arXiv 2509.16686; configuration from a secondary summary, see
docs/attention.md): 12 layers, d=768, 12 heads, d_nope = d_rope = d_v = 64, GPT-2 vocabulary;
MLA baseline d_c=256; EG-MLA d_c in {256, 64, 16} with d_e = 256 (`kv` gate), plus the `latent`
gate at d_c 64 for decode-cost comparisons.

    >>> from egmla.presets import preset
    >>> preset("paper-egmla-kv64").attention.d_c
    64
"""

from __future__ import annotations

from typing import Any

from egmla.config import ConfigError, ModelConfig

GPT2_VOCAB = 50257

_PAPER = {"vocab_size": GPT2_VOCAB, "d_model": 768, "n_layers": 12, "n_heads": 12, "d_ff": 2048,
          "max_seq_len": 2048}
_LATENT = {"d_nope": 64, "d_rope": 64, "d_v": 64}
# A tiny model for tests and docs: 2 layers, d=64, 4 heads, 256-token (byte) vocabulary.
_TINY = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 256}
_TINY_LATENT = {"d_nope": 16, "d_rope": 8, "d_v": 16}
# A small model that trains on a 2-core CPU: 4 layers, d=256, 8 heads, 4k BPE vocabulary.
_SMALL = {"vocab_size": 4096, "d_model": 256, "n_layers": 4, "n_heads": 8, "max_seq_len": 512}
_SMALL_LATENT = {"d_nope": 32, "d_rope": 16, "d_v": 32}


def _variants(base: dict[str, Any], latent: dict[str, Any], d_c: int, d_e: int,
              n_kv: int) -> dict[str, dict[str, Any]]:
    return {
        "mha": {**base, "attention": {"type": "mha"}},
        f"gqa{n_kv}": {**base, "attention": {"type": "mha", "n_kv_heads": n_kv}},
        "mla": {**base, "attention": {"type": "mla", "d_c": d_c, **latent}},
        "egmla": {**base, "attention": {"type": "egmla", "d_c": d_c // 4, "d_e": d_e, **latent}},
        "egmla-latent": {**base, "attention": {"type": "egmla", "d_c": d_c // 4, "d_e": d_e,
                                               "gate_position": "latent", **latent}},
        # The study's controls (docs/study.md), at EG-MLA's latent width.
        "mla-narrow": {**base, "attention": {"type": "mla", "d_c": d_c // 4, **latent}},
        "egmla-const-gate": {**base, "attention": {"type": "egmla_const_gate", "d_c": d_c // 4,
                                                   "d_e": d_e, **latent}},
        "egmla-hidden-gate": {**base, "attention": {"type": "egmla_hidden_gate", "d_c": d_c // 4,
                                                    **latent}},
        "mla-value-embed": {**base, "attention": {"type": "mla_value_embed", "d_c": d_c // 4,
                                                  "d_e": d_e, **latent}},
        "mla-kv-embed": {**base, "attention": {"type": "mla_kv_embed", "d_c": d_c // 4,
                                               "d_e": d_e, **latent}},
        "egmla-v-gate": {**base, "attention": {"type": "egmla_v_gate", "d_c": d_c // 4,
                                               "d_e": d_e, **latent}},
    }


PRESETS: dict[str, dict[str, Any]] = {
    "paper-mha": {**_PAPER, "attention": {"type": "mha"}},
    "paper-gqa4": {**_PAPER, "attention": {"type": "mha", "n_kv_heads": 4}},
    "paper-mla": {**_PAPER, "attention": {"type": "mla", "d_c": 256, **_LATENT}},
    **{
        f"paper-egmla-kv{d_c}": {**_PAPER, "attention": {"type": "egmla", "d_c": d_c, "d_e": 256,
                                                         **_LATENT}}
        for d_c in (256, 64, 16)
    },
    # The `latent` gate at the paper's shape (not a configuration the paper reports): d_c 64,
    # so its cache equals paper-egmla-kv64's without token ids; decode is MLA's absorbed one.
    "paper-egmla-latent64": {**_PAPER, "attention": {"type": "egmla", "d_c": 64, "d_e": 256,
                                                     "gate_position": "latent", **_LATENT}},
    **{f"tiny-{k}": v for k, v in _variants(_TINY, _TINY_LATENT, d_c=32, d_e=16, n_kv=2).items()},
    **{f"small-{k}": v for k, v in _variants(_SMALL, _SMALL_LATENT, d_c=128, d_e=64, n_kv=2).items()},
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """Build the named preset; keyword overrides replace top-level keys (validated as usual)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides})
