"""The weight names egmla shares with transformers, used in both directions: by the importers
(egmla.imports: Llama and DeepSeek-V3 into egmla) and by the exporter (egmla.export: egmla into
transformers' layouts), so the two cannot drift apart.

`rename_weights` maps a transformers state dict to egmla's names and checks every key and shape
against the model the config builds; `build_model` loads the result.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from egmla.checkpoint import CheckpointError
from egmla.config import ModelConfig
from egmla.models.transformer import Transformer


class ConversionError(CheckpointError):
    """A pretrained model cannot be converted exactly; the message names the feature or key."""


TOP_LEVEL = {
    "model.embed_tokens.weight": "tok_emb.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "mlp.w_gate.weight",
    "mlp.up_proj.weight": "mlp.w_up.weight",
    "mlp.down_proj.weight": "mlp.w_down.weight",
}
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")


LLAMA_ATTENTION = {f"self_attn.{p}_proj.weight": f"attn.w{p}.weight" for p in "qkvo"}
DEEPSEEK_ATTENTION = {
    "self_attn.q_proj.weight": "attn.wq.weight",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_layernorm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn.wkv_a.weight",
    "self_attn.kv_a_layernorm.weight": "attn.kv_norm.weight",
    "self_attn.kv_b_proj.weight": "attn.wkv_b.weight",
    "self_attn.o_proj.weight": "attn.wo.weight",
}


def rename_weights(
    hf_state_dict: dict[str, torch.Tensor],
    config: ModelConfig,
    attention: dict[str, str],
    skip_layer: Callable[[int, str], bool] = lambda i, rest: False,
    shared: dict[str, list[str]] | None = None,
) -> dict[str, torch.Tensor]:
    """Map HF names to ours and check the result against the model `config` builds.

    `shared` maps an HF key to the several egmla keys that hold the same tensor (a gate table
    used by a group of layers). Every HF key must be used (or deliberately skipped) and every
    egmla key filled, with the right shape; otherwise ConversionError names the key.
    """
    block = {**BLOCK, **attention}
    shared = shared or {}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in hf_state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):  # a non-persistent buffer in older checkpoints
            continue
        match = _LAYER_KEY.fullmatch(key)
        if key in TOP_LEVEL:
            out[TOP_LEVEL[key]] = tensor
        elif key in shared:
            out.update(dict.fromkeys(shared[key], tensor))
        elif match and skip_layer(int(match.group(1)), match.group(2)):
            continue
        elif match and match.group(2) in block:
            out[f"layers.{match.group(1)}.{block[match.group(2)]}"] = tensor
        else:
            raise ConversionError(f"unexpected weight {key!r}: no egmla counterpart")
    if config.tie_embeddings:
        out["lm_head.weight"] = out.get("tok_emb.weight")  # tied: one tensor under both names

    with torch.device("meta"):
        expected = Transformer(config).state_dict()
    missing = sorted(k for k in expected if out.get(k) is None)
    if missing:
        raise ConversionError(f"weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for key, tensor in out.items():
        if key not in expected:
            raise ConversionError(f"weight {key!r} does not exist in the egmla model")
        if tensor.shape != expected[key].shape:
            raise ConversionError(f"{key}: shape {tuple(tensor.shape)} from the checkpoint, "
                                  f"{tuple(expected[key].shape)} expected from the config")
    return out


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> Transformer:
    """A model holding `state_dict`, in its dtype and on its device, in eval mode."""
    return Transformer.from_state_dict(config, state_dict).to(state_dict["tok_emb.weight"].dtype).eval()


def gguf_rope_rows(n: int, heads: int) -> torch.Tensor:
    """The row order that puts a GGUF file's Q or K projection (n rows, `heads` heads) back in
    Llama's half-split layout: llama.cpp's converter interleaves each head's two RoPE halves,
    so row j of a head's first half is stored at 2j and row D/2 + j at 2j + 1."""
    return torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)
