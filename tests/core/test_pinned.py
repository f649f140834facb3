"""Every variant's logits and first training losses, pinned bit for bit to values computed before
the seams redesign (issue 16), so a refactor that moves code cannot move numbers.

The pins (tests/core/pinned_variants.json) were written at commit 35a39ab by running this file
(now `PYTHONPATH=tests python tests/core/test_pinned.py --write`; the file moved, the pins did
not change). Rewrite them only for a change that is meant to change the numbers, and say so in
its commit. Computed in float32 on one thread (reduction order fixed) on
this project's CPU (AVX-512); another instruction set may round differently.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from egmla.models import Transformer
from support.models import VARIANTS

PINS = Path(__file__).with_name("pinned_variants.json")


def fingerprint(cfg) -> dict:
    """Logits of a fixed batch and the losses of 3 AdamW steps, from seed 0, float32, 1 thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = Transformer(cfg)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
        with torch.no_grad():
            logits = model.eval()(ids)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model.train()
        losses = []
        for _ in range(3):
            out = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), ids[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item().hex())
    finally:
        torch.set_num_threads(threads)
    return {"logits_sha256": hashlib.sha256(logits.numpy().tobytes()).hexdigest(),
            "logits_first": [v.hex() for v in logits.flatten()[:4].tolist()],
            "losses": losses, "num_params": model.num_params()}


PINNED = sorted(json.loads(PINS.read_text())["variants"])  # variants added later have no pins


@pytest.mark.parametrize("name", PINNED)
def test_logits_and_losses_equal_the_pins(name):
    pinned = json.loads(PINS.read_text())["variants"][name]
    assert fingerprint(VARIANTS[name]) == pinned


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    from egmla.provenance import provenance

    data = {"written_at": provenance()["git"], "variants": {
        name: fingerprint(cfg) for name, cfg in sorted(VARIANTS.items())}}
    PINS.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {len(data['variants'])} pins to {PINS}")
