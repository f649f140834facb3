"""transformers configuration of an egmla model (MHA, MLA or EG-MLA attention).

This file is copied into every directory written by `python -m egmla.export --format hf` and
loaded by `AutoConfig.from_pretrained(directory, trust_remote_code=True)`. It needs only
transformers and torch, not egmla.

`ffn` names the MLP: "swiglu" (down(silu(gate) * up)), "reglu" (relu(gate) * up), "drelu"
(relu(gate) * relu(up)) or "relu2" (relu(up) ** 2, no gate_proj).

`attention` holds egmla's attention config verbatim, a dict with a `type`:

    {"type": "mha", "n_kv_heads": 3, "head_dim": 64}
    {"type": "mla", "d_c": 256, "d_q": null, "d_nope": 64, "d_rope": 64, "d_v": 64, ...}
    {"type": "egmla", ... MLA's keys ..., "d_e": 256, "gate_position": "kv",
     "gate_norm": "layernorm", "gate_group_size": 1, "gate_residual": false, ...}

MLA and EG-MLA may also hold the forms of a model converted from GQA, each absent or at its
default in DeepSeek's MLA: "latent_norm" (false: no RMSNorm on the latent), "n_kv_heads" (K/V
heads up-projected from the latent, each shared by n_heads / n_kv_heads query heads),
"rope_heads" (RoPE keys per token, likewise shared), "rope_freqs" (per layer, per RoPE key, the
d_rope / 2 frequency indices j: pair i rotates at rope_theta^(-2 j / (d_nope + d_rope))), and
"d_nope": 0. EG-MLA's "gate_residual" makes the gate 1 + W_UE E[id].
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

ATTENTION_TYPES = ("mha", "mla", "egmla")
FFN_TYPES = ("swiglu", "reglu", "drelu", "relu2")


class EgmlaConfig(PretrainedConfig):
    model_type = "egmla"

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 64,
        intermediate_size: int = 192,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        attention: dict[str, Any] | None = None,
        ffn: str = "swiglu",
        max_position_embeddings: int = 2048,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> None:
        attention = dict(attention or {"type": "mha"})
        if attention.get("type") not in ATTENTION_TYPES:
            raise ValueError(
                f"attention.type={attention.get('type')!r}: must be one of {list(ATTENTION_TYPES)}"
            )
        if ffn not in FFN_TYPES:
            raise ValueError(f"ffn={ffn!r}: must be one of {list(FFN_TYPES)}")
        self.ffn = ffn
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.attention = attention
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
