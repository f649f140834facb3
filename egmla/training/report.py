"""What a finished run tells its user: where the export is, how good it got, what it writes."""

from __future__ import annotations

from typing import Any

import torch

from egmla.checkpoint import load_export, load_tokenizer
from egmla.generate import generate


def sample_from_export(export_dir: str, prompt: str, max_new_tokens: int = 60, seed: int = 0) -> str:
    """Load the plain export (no Lightning, no Hydra) and continue `prompt` (top-k sampling)."""
    model = load_export(export_dir)
    tokenizer = load_tokenizer(export_dir)
    ids = torch.tensor([tokenizer.encode(prompt)])
    room = model.config.max_seq_len - ids.shape[1]  # the model's context bounds the sample
    if room < 1:
        return f"(prompt of {ids.shape[1]} tokens fills the {model.config.max_seq_len}-token context)"
    out = generate(model, ids, min(max_new_tokens, room), temperature=0.8, top_k=40,
                   eos_token_id=tokenizer.eos_token_id,
                   generator=torch.Generator().manual_seed(seed))
    return tokenizer.decode(out[0].tolist(), skip_special_tokens=True)


def print_summary(summary: dict[str, Any], prompt: str | None) -> None:
    total = summary.get("fit_seconds_all_starts")
    took = f"{summary['fit_seconds']} s"
    if total is not None and total != summary["fit_seconds"]:  # resumed: say both
        took = f"{total} s over all starts ({summary['fit_seconds']} s this start)"
    print(f"\nrun {summary['name']}: {summary['global_step']} steps in {took} -> {summary['run_dir']}")
    line = f"validation loss {summary['val_loss']:.3f} nats/token"
    if "unigram_val_loss" in summary:
        line += f" (unigram baseline {summary['unigram_val_loss']:.3f})"
    print(line)
    for name, acc in summary.get("mqar_accuracy", {}).items():
        print(f"MQAR accuracy {name}: {acc:.3f}")
    if summary.get("export"):
        print(f"export: {summary['export']}  (load with egmla.checkpoint.load_export)")
        if prompt:
            print(f"sample:\n{sample_from_export(summary['export'], prompt)}")
