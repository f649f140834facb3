"""egmla models as plain transformers architectures: MHA -> Llama, MLA -> dense DeepSeek-V3.

    config_json = native_config(model.config, dtype=torch.bfloat16)   # -> config.json
    weights = native_state_dict(model.to(torch.bfloat16))             # -> model.safetensors

The inverse of `egmla.imports`: `config_from_llama` / `config_from_deepseek_v3` of the written
config return the exporting ModelConfig (up to `attention.impl`, an egmla compute choice, and
`init_std`), and `state_dict_from_*` of the written weights return its tensors bit for bit. The
directory then loads with `transformers.AutoModelForCausalLM.from_pretrained` (no remote code)
and is served by vLLM's native LlamaForCausalLM / DeepseekV3ForCausalLM. The caller writes the
two files (atomically); the functions here only build them.

Mapping. An MHA/GQA model is a Llama with the same names as the import table; Llama's q/k rows
are already half-split, egmla's RoPE layout. An MLA model is a DeepSeek-V3 whose every layer is
dense (`first_k_dense_replace = n_layers`, so no router or expert is built or expected) and
whose RoPE rows are re-interleaved (`rope_interleave=True`): the exact inverse of the import's
de-interleave. Interleaved is DeepSeek's own checkpoint layout and the only one vLLM's DeepSeek
model computes (it rotates adjacent pairs whatever `rope_interleave` says).

What has no counterpart is refused with NativeExportError naming it, never approximated:

- EG-MLA: its token-ID embedding gate (a per-token table multiplied into the KV path) exists in
  no architecture transformers or vLLM ship. Use `--format hf` (egmla's remote-code export).
- MLA in a converted GQA model's form (no latent norm, grouped K/V heads, several RoPE keys,
  chosen RoPE frequencies, d_nope 0): DeepSeek-V3 holds none of them; the attention config
  names the option (`native_refusal_reason`). Use `--format hf`.
- MLA whose latent norms' eps is not 1e-6: DeepSeek-V3's latent norms (q_a / kv_a_layernorm)
  use eps 1e-6 in transformers whatever rms_norm_eps says. egmla gives them their own
  `attention.latent_norm_eps` (the shipped mla/egmla configs: 1e-6; null: norm_eps), so the
  block norms' norm_eps is written as rms_norm_eps and the latent one must be 1e-6. vLLM's
  DeepSeek model builds the latent norms with rms_norm_eps instead: with norm_eps != 1e-6 it
  computes the latent norms with that eps (docs/export.md says what that changes).
- MHA with d_model not divisible by n_heads: LlamaConfig rejects such a config even when
  head_dim is given.
- An MLP other than SwiGLU or ReGLU: Llama's and DeepSeek-V3's MLP is down(act(gate) * up),
  so `hidden_act` "silu" is SwiGLU and "relu" ReGLU; dReLU and squared ReLU have no such form.

Checked and exact, so not refused: DeepSeek-V3's softmax scale without RoPE scaling is
(qk_nope_head_dim + qk_rope_head_dim) ** -0.5, egmla MLA's; Llama's is head_dim ** -0.5, egmla
MHA's; both RMSNorms and SwiGLU compute what egmla's do.
"""

from __future__ import annotations

from typing import Any

import torch

from egmla.checkpoint import CheckpointError
from egmla.config import FFN_HIDDEN_ACT, ModelConfig
from egmla.dtypes import dtype_name
from egmla.export.hf import rename_to_hf
from egmla.imports import deinterleave_order
from egmla.models.transformer import Transformer
from egmla.weight_names import DEEPSEEK_ATTENTION, LLAMA_ATTENTION


class NativeExportError(CheckpointError):
    """A model has no exact transformers-native form; the message names the feature."""


# --------------------------------------------------------------------------------------------
# Architecture


def native_architecture(config: ModelConfig) -> str:
    """The transformers model_type: "llama" for MHA/GQA, "deepseek_v3" for MLA.

    Raises NativeExportError for EG-MLA and for anything else the architecture cannot hold.
    """
    a = config.attention
    # The variant knows what its architecture holds (MLA: also the latent norms' eps)
    reason = a.native_refusal_reason(config)
    if reason:
        raise NativeExportError(reason)
    arch = a.native_architecture
    if config.ffn not in FFN_HIDDEN_ACT:
        raise NativeExportError(
            f"ffn={config.ffn!r}: Llama's and DeepSeek-V3's MLP is down(act(gate) * up), which "
            f"holds only {sorted(FFN_HIDDEN_ACT)}; use --format hf (egmla's remote-code export)"
        )
    if arch == "llama" and config.d_model % config.n_heads:
        raise NativeExportError(
            f"d_model={config.d_model} is not divisible by n_heads={config.n_heads}: "
            "LlamaConfig refuses that even with an explicit head_dim"
        )
    return arch


# --------------------------------------------------------------------------------------------
# config.json


def _dtype_name(dtype: torch.dtype) -> str:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise NativeExportError(f"dtype={dtype!r}: a native export needs a floating-point dtype")
    return dtype_name(dtype)


def _common_config(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The fields Llama and DeepSeek-V3 share, spelled as transformers 5.x writes them."""
    rope_theta = float(config.rope_theta)
    dtype_name = _dtype_name(dtype)
    out: dict[str, Any] = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "max_position_embeddings": config.max_seq_len,
        "hidden_act": FFN_HIDDEN_ACT[config.ffn],
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        # Written even when None: both configs have non-None defaults (Llama 1/2, DeepSeek 0/1)
        # that would otherwise name tokens this model never declared.
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "pretraining_tp": 1,
        # transformers >= 5 reads RoPE from rope_parameters only and writes dtype. The 4.x
        # spellings (rope_theta, torch_dtype) are written too so that older readers (e.g. a
        # vLLM pinned to transformers 4.x) do not fall back to rope_theta=10000 or float32;
        # 5.x pops them on load without keeping a second copy.
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rope_theta": rope_theta,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }
    # Only initializes fresh weights, never read back (init_std does not round-trip); Llama's
    # config refuses values outside [0, 1], so an out-of-range init_std leaves the default.
    if 0.0 <= config.init_std <= 1.0:
        out["initializer_range"] = config.init_std
    return out


def native_config(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of the native export of `config`, weights stored in `dtype`."""
    arch = native_architecture(config)
    out = _common_config(config, dtype)
    a = config.attention
    if arch == "llama":
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            **out,
            "num_key_value_heads": a.kv_heads(config),
            "head_dim": a.head_size(config),
            "mlp_bias": False,
        }
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        **out,
        "num_key_value_heads": config.n_heads,  # MLA up-projects one key per head
        "kv_lora_rank": a.d_c,
        "q_lora_rank": a.d_q,
        "qk_nope_head_dim": a.d_nope,
        "qk_rope_head_dim": a.d_rope,
        "v_head_dim": a.d_v,
        # Derived by DeepseekV3Config itself; written because transformers 5.x writes them.
        "qk_head_dim": a.d_nope + a.d_rope,
        "head_dim": a.d_rope,
        "rope_interleave": True,
        # Every layer dense: layers from first_k_dense_replace on would be mixture-of-experts.
        "first_k_dense_replace": config.n_layers,
        "num_nextn_predict_layers": 0,  # no multi-token-prediction module
        # The MoE fields below configure layers that do not exist; they are a valid one-expert
        # setup so any reader that checks them accepts them. routed_scaling_factor must be 1:
        # vLLM divides dense-layer outputs (and the residual) by it in float16, which changes
        # the numerics through the norms' eps unless the factor is 1.
        "n_routed_experts": 1,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "n_group": 1,
        "topk_group": 1,
        "moe_intermediate_size": config.d_ff,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "output_router_logits": False,
    }


# --------------------------------------------------------------------------------------------
# model.safetensors

def interleave_order(d_rope: int) -> torch.Tensor:
    """[0, r/2, 1, r/2 + 1, ...]: half-split RoPE rows back in interleaved order.

    The inverse permutation of `deinterleave_order`: w[deinterleave_order][interleave_order] == w.
    """
    return torch.argsort(deinterleave_order(d_rope))


def _interleave_query(w: torch.Tensor, n_heads: int, d_nope: int, d_rope: int) -> torch.Tensor:
    """Reorder the RoPE rows of each head of a query projection (H * (n + r), in)."""
    w = w.reshape(n_heads, d_nope + d_rope, -1)  # (H, n + r, in)
    nope, rope = w.split([d_nope, d_rope], dim=1)
    rope = rope[:, interleave_order(d_rope)]
    return torch.cat((nope, rope), dim=1).reshape(n_heads * (d_nope + d_rope), -1)


def _interleave_rope_rows(weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Undo state_dict_from_deepseek_v3's de-interleave, in place on the HF-named `weights`."""
    a = config.attention
    kv_order = torch.cat((torch.arange(a.d_c), a.d_c + interleave_order(a.d_rope)))
    for i in range(config.n_layers):
        prefix = f"model.layers.{i}.self_attn"
        q = f"{prefix}.q_proj.weight" if a.d_q is None else f"{prefix}.q_b_proj.weight"
        weights[q] = _interleave_query(weights[q], config.n_heads, a.d_nope, a.d_rope)
        kv = f"{prefix}.kv_a_proj_with_mqa.weight"  # (d_c + r, d): latent rows, then RoPE key's
        weights[kv] = weights[kv][kv_order]


def native_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under Llama / DeepSeek-V3 names, ready for safetensors.save_file.

    Every tensor is detached and contiguous, and none shares memory with another (safetensors
    refuses shared tensors); only shared ones are copied. With tied embeddings a Llama export
    omits lm_head.weight, as transformers writes it and as vLLM's Llama expects (both tie it
    back on load). A DeepSeek-V3 export keeps a copy: vLLM's DeepSeek model never ties and
    would find lm_head.weight missing; transformers loads it tied either way.
    """
    config = model.config
    arch = native_architecture(config)
    attention = LLAMA_ATTENTION if arch == "llama" else DEEPSEEK_ATTENTION
    out = rename_to_hf(model, attention, keep_tied_head=arch == "deepseek_v3")
    if arch == "deepseek_v3":
        _interleave_rope_rows(out, config)  # indexing makes new tensors: nothing shared
    return out
