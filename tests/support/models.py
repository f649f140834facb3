"""The attention variants every reference test runs over, and seeded builders."""

from __future__ import annotations

import dataclasses

import torch

from egmla.config import ModelConfig
from egmla.models import Transformer
from egmla.presets import preset


def with_attention(cfg: ModelConfig, **changes) -> ModelConfig:
    return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, **changes))


# tiny-mla (4 heads, d_nope 16, d_rope 8) in a converted model's form: 2 KV heads, each with its
# own RoPE key rotating at 4 of the 12 frequencies of a 24-wide head, chosen per layer
CONVERTED = {"latent_norm": False, "n_kv_heads": 2, "rope_heads": 2,
             "rope_freqs": [[[0, 3, 5, 11], [1, 2, 7, 9]], [[4, 6, 8, 10], [0, 1, 2, 3]]]}

# Every computation the acceptance criteria name, plus grouped gates and a low-rank query.
VARIANTS = {
    "mha": preset("tiny-mha"),
    "gqa": preset("tiny-gqa2"),
    "mqa": preset("tiny-mha", attention={"type": "mha", "n_kv_heads": 1}),
    "mla-naive": with_attention(preset("tiny-mla"), impl="naive"),
    "mla-absorbed": with_attention(preset("tiny-mla"), impl="absorbed"),
    "mla-lowrank-q": with_attention(preset("tiny-mla"), d_q=24),
    "egmla-kv": preset("tiny-egmla"),
    "egmla-kv-rmsnorm-grouped": with_attention(preset("tiny-egmla"), gate_norm="rmsnorm",
                                               gate_group_size=2),
    "egmla-kv-naive": with_attention(preset("tiny-egmla"), impl="naive"),
    "egmla-kv-absorbed": with_attention(preset("tiny-egmla"), impl="absorbed"),
    "egmla-kv-absorbed-rmsnorm-grouped": with_attention(preset("tiny-egmla"), impl="absorbed",
                                                        gate_norm="rmsnorm", gate_group_size=2),
    "egmla-kv-absorbed-nonorm": with_attention(preset("tiny-egmla"), impl="absorbed",
                                               gate_norm="none"),
    "egmla-latent-naive": with_attention(preset("tiny-egmla-latent"), impl="naive"),
    "egmla-latent-absorbed": with_attention(preset("tiny-egmla-latent"), impl="absorbed"),
    "egmla-latent-nonorm": with_attention(preset("tiny-egmla-latent"), gate_norm="none"),
    # the study's controls (egmla/models/attention/controls.py)
    # (absorbed only: naive == absorbed for each is test_models' test_absorbed_equals_naive)
    "egmla-const-gate-absorbed": with_attention(preset("tiny-egmla-const-gate"), impl="absorbed"),
    "egmla-hidden-gate": preset("tiny-egmla-hidden-gate"),
    "mla-value-embed-absorbed": with_attention(preset("tiny-mla-value-embed"), impl="absorbed"),
    # the forms of a GQA model converted by egmla.upcycle: K/V up-projected per KV head, a RoPE
    # key per KV head at frequencies chosen from a wider head's spectrum, no latent norm
    "mla-converted-naive": with_attention(preset("tiny-mla"), impl="naive", **CONVERTED),
    "mla-converted-absorbed": with_attention(preset("tiny-mla"), impl="absorbed", **CONVERTED),
    "mla-nope0-absorbed": with_attention(preset("tiny-mla"), impl="absorbed", d_nope=0,
                                         latent_norm=False, n_kv_heads=1),
    "mla-more-rope-heads-absorbed": with_attention(preset("tiny-mla"), impl="absorbed",
                                                   n_kv_heads=1, rope_heads=2),
    "egmla-kv-converted-absorbed": with_attention(preset("tiny-egmla"), impl="absorbed",
                                                  gate_residual=True, gate_init="random",
                                                  gate_norm="none", **CONVERTED),
    "egmla-kv-grouped-layernorm-absorbed": with_attention(preset("tiny-egmla"), impl="absorbed",
                                                          n_kv_heads=2, rope_heads=2),
    "egmla-latent-converted": with_attention(preset("tiny-egmla-latent"), gate_residual=True,
                                             gate_init="random", gate_norm="none", **CONVERTED),
    # the ReLU-family MLPs of the activation-locality work (ModelConfig.ffn)
    "gqa-reglu": preset("tiny-gqa2", ffn="reglu"),
    "mha-relu2": preset("tiny-mha", ffn="relu2"),
    "mla-drelu-absorbed": with_attention(preset("tiny-mla", ffn="drelu"), impl="absorbed"),
}


def build(cfg: ModelConfig, dtype=torch.float64, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg).to(dtype).eval()


def random_ids(cfg: ModelConfig, B: int, T: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (B, T), generator=g)


def exact_predictor(mlp, order: torch.Tensor | None = None):
    """relu(W x) - relu(-W x) = W x, with W the deciding projection: predicts exactly the
    neurons whose deciding pre-activation is > 0 (a superset of drelu's); with `order`, for the
    MLP's neurons reordered by it (egmla.models.sparse_ffn.permute_neurons)."""
    from egmla.models.sparse_ffn import Predictor

    w = (mlp.w_up if mlp.w_gate is None else mlp.w_gate).weight.detach()
    if order is not None:
        w = w[order]
    eye = torch.eye(w.shape[0], dtype=w.dtype)
    return Predictor(torch.cat([w, -w]), torch.cat([eye, -eye], dim=1),
                     torch.zeros(w.shape[0], dtype=w.dtype))


def decode(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits of a prefill of `prompt` tokens, then one token per step over a cache."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    with torch.no_grad():
        steps = [model(ids[:, :prompt], cache=cache)]
        steps += [model(ids[:, t:t + 1], cache=cache) for t in range(prompt, ids.shape[1])]
    return torch.cat(steps, dim=1)


def tiny_text_export(directory, max_seq_len: int = 256, **changes):
    """A seeded tiny GQA model with the real 512-token BPE tokenizer, saved as an export in
    `directory` (text prompts, stop strings and chat templates work on it)."""
    from egmla.checkpoint import save_export
    from egmla.data.tokenizer import get_tokenizer

    tokenizer = get_tokenizer("bpe", vocab_size=512)
    torch.manual_seed(0)
    model = Transformer(preset("tiny-gqa2", vocab_size=len(tokenizer), max_seq_len=max_seq_len,
                               **changes))
    return save_export(model, directory, tokenizer=tokenizer)
