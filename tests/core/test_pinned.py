"""Every variant's logits and first training losses, pinned to values computed before the seams
redesign (issue 16), so a refactor that moves code cannot move numbers.

The pins (tests/core/pinned_variants.json, "variants") were written at commit 35a39ab by running
this file (now `PYTHONPATH=tests python tests/core/test_pinned.py --write`; the file moved, the
pins did not change). Rewrite them only for a change that is meant to change the numbers, and
say so in its commit. Computed in float32 on one thread (reduction order fixed).

Float rounding is the same from run to run on one machine but not across CPUs: the math
libraries take other code paths on another vendor or instruction set (measured: an AMD EPYC with
AVX-512 and AVX512-BF16 gives the same logits and losses within 1 ulp, not bit for bit). So the
pins hold twice: on every machine, the first logits within a few float32 ulps and the three
losses within 5e-5 relative (a change that means anything moves them by far more); and on a
platform (CPU vendor,
PyTorch's CPU capability, native bf16, torch version) that has pins of its own ("platforms",
written with `--write-platform` from the same commit's code), bit for bit, every logit.
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
    """Logits of a fixed batch and the losses of 3 AdamW steps, from seed 0, float32, 1 thread,
    through PyTorch's matmul: egmla's CPU kernel, which an inference forward of up to
    `kernels.MAX_ROWS` rows takes (a tuning that moved from 16 to 64 fp32 rows), sums in another
    order; test_kernels checks it against F.linear."""
    from egmla import kernels

    threads, max_rows = torch.get_num_threads(), dict(kernels.MAX_ROWS)
    torch.set_num_threads(1)
    kernels.MAX_ROWS.update(dict.fromkeys(max_rows, 0))
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
        kernels.MAX_ROWS.update(max_rows)
    return {"logits_sha256": hashlib.sha256(logits.numpy().tobytes()).hexdigest(),
            "logits_first": [v.hex() for v in logits.flatten()[:4].tolist()],
            "losses": losses, "num_params": model.num_params()}


PINNED = sorted(json.loads(PINS.read_text())["variants"])  # variants added later have no pins
# How far another CPU's rounding may move a pinned value: logits by a few float32 ulps; the
# losses of the training steps further (measured: 52 ulps, 6e-6 relative, at the third step of
# gqa: AdamW's normalized update turns the last bits of a small gradient into a full-size step).
# A change that means anything moves them by far more.
LOGIT_ULPS, LOSS_RELATIVE = 8, 5e-5


def platform() -> str:
    """What decides float rounding here: the CPU vendor, PyTorch's CPU capability, native bf16
    (a flag that marks a newer core generation), the torch version."""
    from egmla import kernels

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        vendor = next(line.split(":")[1].strip() for line in cpuinfo.splitlines()
                      if line.startswith("vendor_id"))
    except (OSError, StopIteration):
        vendor = "unknown"
    bf16 = "bf16" if kernels.native_bf16() else "no-bf16"
    return f"{vendor} {torch.backends.cpu.get_cpu_capability()} {bf16} torch-{torch.__version__}"


def close(a: str, b: str, relative: float) -> bool:
    x, y = float.fromhex(a), float.fromhex(b)
    return abs(x - y) <= relative * max(abs(x), abs(y))


@pytest.mark.parametrize("name", PINNED)
def test_logits_and_losses_equal_the_pins(name):
    pins = json.loads(PINS.read_text())
    got, pinned = fingerprint(VARIANTS[name]), pins["variants"][name]
    assert got["num_params"] == pinned["num_params"]
    eps = torch.finfo(torch.float32).eps
    for key, relative in (("logits_first", LOGIT_ULPS * eps), ("losses", LOSS_RELATIVE)):
        assert all(close(a, b, relative) for a, b in zip(got[key], pinned[key], strict=True)), (
            key, got[key], pinned[key])  # on any machine: within rounding
    exact = pins.get("platforms", {}).get(platform())
    if exact is not None:  # a platform with pins of its own: bit for bit, every logit
        assert got == exact["variants"][name]


if __name__ == "__main__" and sys.argv[1:] in (["--write"], ["--write-platform"]):
    from egmla.provenance import provenance

    variants = {name: fingerprint(cfg) for name, cfg in sorted(VARIANTS.items())}
    data = json.loads(PINS.read_text()) if PINS.is_file() else {}
    if sys.argv[1:] == ["--write"]:
        data.update({"written_at": provenance()["git"], "variants": variants})
    else:
        data.setdefault("platforms", {})[platform()] = {"written_at": provenance()["git"],
                                                        "variants": variants}
    PINS.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {len(variants)} pins ({sys.argv[1]}) to {PINS}")
