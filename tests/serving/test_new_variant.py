"""Adding an attention variant touches its config class, its module and tests only: this file
defines a toy variant (a config class and its module, nothing else) and the library builds it,
round-trips its config by name, and serves it through the paged engine unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from egmla.cache import FieldSpec, LayerSpec, LayerView
from egmla.config import ATTENTION_REGISTRY, AttentionConfig, ModelConfig
from egmla.models import Positions, Rotary, Transformer, apply_rope
from egmla.models.attention import ATTENTION_MODULES, AttentionLayer
from egmla.models.attention.common import attend
from egmla.models.layers import Linear
from serve import LLM, SamplingParams

NAME = "toy_tied_kv"


@pytest.fixture(scope="module")
def toy() -> type[AttentionConfig]:
    """The variant, registered by defining its classes, and dropped from the registry after."""

    @dataclass
    class TiedKVConfig(AttentionConfig):
        """One cached vector per token, rotated, is every head's key and value: head_dim
        elements per token per layer."""

        type: ClassVar[str] = NAME
        head_dim: int = 8

        def layer_params(self, model: ModelConfig) -> int:
            d, H, D = model.d_model, model.n_heads, self.head_dim
            return d * H * D + d * D + H * D * d

    class TiedKV(AttentionLayer):
        config_class = TiedKVConfig

        def __init__(self, config: ModelConfig) -> None:
            super().__init__()
            self.n_heads, self.head_dim = config.n_heads, config.attention.head_dim
            self.wq = Linear(config.d_model, self.n_heads * self.head_dim, bias=False)
            self.wkv = Linear(config.d_model, self.head_dim, bias=False)
            self.wo = Linear(self.n_heads * self.head_dim, config.d_model, bias=False)
            self.rope = Rotary(self.head_dim, config.rope_theta)

        def cache_spec(self) -> LayerSpec:
            return {"kv": FieldSpec((1, self.head_dim))}

        def forward(self, x: torch.Tensor, positions: Positions | torch.Tensor,
                    cache: LayerView | None = None, token_ids: torch.Tensor | None = None
                    ) -> torch.Tensor:
            B, T, _ = x.shape
            positions = Positions.of(positions)
            cos, sin = positions.cos_sin(self.rope, x.dtype)
            q = apply_rope(self.wq(x).view(B, T, self.n_heads, self.head_dim), cos, sin)
            kv = apply_rope(self.wkv(x).view(B, T, 1, self.head_dim), cos, sin)  # (B, T, 1, D)
            key_positions = None
            if cache is not None:
                kv, key_positions = cache.update(kv=kv)["kv"], cache.key_positions  # (B, S, 1, D)
            o = attend(q, kv, kv, self.head_dim**-0.5, positions, key_positions)  # (B, T, H, D)
            return self.wo(o.reshape(B, T, self.n_heads * self.head_dim))

    try:
        yield TiedKVConfig
    finally:
        del ATTENTION_REGISTRY[NAME]


def tiny(attention: AttentionConfig) -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=64,
                       attention=attention)


def test_a_variant_defined_in_one_place_is_built_and_round_trips(toy):
    config = tiny(toy())
    assert ModelConfig.from_dict(config.to_dict()) == config  # its name finds its class
    assert ATTENTION_MODULES[NAME].config_class is toy  # and its class finds its module
    model = Transformer(config)
    assert model.num_params() == config.num_params()
    assert model.cache_spec().elements_per_token() == 2 * 8  # two layers, one vector each


def test_a_variant_defined_in_one_place_serves_greedy_as_its_full_forward(toy):
    torch.manual_seed(0)
    model = Transformer(tiny(toy())).to(torch.float64).eval()
    prompts = [[5, 9, 2, 33, 7, 1, 60, 12, 3], [40, 41], [8, 8, 8, 8, 8]]  # ragged, over blocks

    def greedy(prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        return ids[len(prompt):]

    llm = LLM(model, num_blocks=32, block_size=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [greedy(p, 10) for p in prompts]
