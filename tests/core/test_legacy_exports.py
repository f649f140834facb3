"""Exports written by an earlier egmla (tests/support/legacy.py says which commit) still load,
with the logits they gave then: a change to the model's code that renames a weight, moves a
module or reads a config differently breaks this before it breaks a user's export."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from egmla.checkpoint import load_export
from serve import LLM, SamplingParams
from support.legacy import EXPECTED, EXPORTS, NAMES, logits_of

EXPECTED_LOGITS = safetensors.torch.load_file(str(EXPECTED))


def test_every_kept_export_is_checked():
    assert sorted(p.name for p in EXPORTS.iterdir() if p.is_dir()) == sorted(NAMES)
    assert set(EXPECTED_LOGITS) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_an_earlier_export_loads_and_gives_its_logits(name):
    model = load_export(EXPORTS / name)
    assert next(model.parameters()).dtype == torch.bfloat16
    # float rounding differs across CPUs by a few ulps (tests/core/test_pinned.py); a wrong
    # weight moves the logits by far more
    torch.testing.assert_close(logits_of(model), EXPECTED_LOGITS[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gqa", "egmla-kv-converted-absorbed", "egmla-latent-absorbed"])
def test_an_earlier_export_is_served(name):
    """The paged engine decodes it, greedily, as the model's own full forward does."""
    model = load_export(EXPORTS / name).float()
    prompt = [5, 17, 3, 250, 9]
    out = LLM(model, num_blocks=16, block_size=4).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert list(tokens) == ids[len(prompt):]
