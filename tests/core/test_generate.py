"""`generate` over the contiguous cache against a full-recompute reference."""

from __future__ import annotations

import pytest
import torch

from egmla.generate import generate, sample_next
from egmla.models import Transformer
from egmla.presets import preset


def reference_greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """No cache: recompute the whole sequence for every new token."""
    for _ in range(n):
        nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat((ids, nxt), dim=1)
    return ids


@pytest.mark.parametrize("name", ["tiny-mha", "tiny-gqa2", "tiny-mla", "tiny-egmla", "tiny-egmla-latent"])
def test_greedy_equals_full_recompute(name):
    torch.manual_seed(0)
    model = Transformer(preset(name)).double().eval()
    prompt = torch.randint(0, 256, (3, 7))
    with torch.no_grad():
        assert torch.equal(generate(model, prompt, 12), reference_greedy(model, prompt, 12))


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    torch.manual_seed(0)
    model = Transformer(preset("tiny-mla")).eval()
    prompt = torch.randint(0, 256, (2, 5))

    def sample(seed, **kw):
        return generate(model, prompt, 10, temperature=1.0,
                        generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(sample(1), sample(1))
    assert not torch.equal(sample(1), sample(2))
    assert torch.equal(sample(3, top_k=1), generate(model, prompt, 10))


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, 1.0, top_p=0.8, generator=g).item() for _ in range(300)}
    assert draws == {0, 1}  # 0.5 + 0.3 covers 0.8: the tail is never drawn


def test_eos_stops_and_pads():
    torch.manual_seed(0)
    model = Transformer(preset("tiny-mha")).eval()
    prompt = torch.randint(0, 256, (1, 4))
    first = generate(model, prompt, 1)[0, -1].item()
    out = generate(model, prompt, 20, eos_token_id=first)
    assert out.shape == (1, 5) and out[0, -1].item() == first


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 300}, "exceeds max_seq_len=256"),
        ({"max_new_tokens": -1}, "max_new_tokens=-1"),
        ({"max_new_tokens": 2, "temperature": -0.5}, "temperature=-0.5"),
        ({"max_new_tokens": 2, "temperature": 1.0, "top_p": 1.5}, "top_p=1.5"),
        ({"max_new_tokens": 2, "temperature": 1.0, "top_k": 0}, "top_k=0"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    model = Transformer(preset("tiny-mha")).eval()
    with pytest.raises(ValueError, match=message):
        generate(model, torch.zeros(1, 3, dtype=torch.long), **kwargs)
