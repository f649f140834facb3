"""Checkpoint export for the wider ecosystem: `python -m egmla.export --checkpoint X --out DIR`.

Formats:

    hf       transformers format with our modeling code, for all three variants: loads with
             AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True), runs lm-eval's
             `hf` model, and generates with a cache of what egmla caches (the latent for MLA).
    native   an architecture transformers and vLLM implement themselves, no remote code:
             MHA -> Llama, MLA -> dense DeepSeek-V3. EG-MLA has none and is refused.
    egmla    egmla's plain export (config.json + model.safetensors), e.g. from a Lightning .ckpt.

`--checkpoint` takes a training run directory (its export/, else checkpoints/last.ckpt), a
Lightning .ckpt, an egmla export, a transformers-format directory (ours or a Llama), or a known
model name such as SmolLM2-135M-Instruct. Every format reads back with `load_pretrained`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from egmla.checkpoint import (
    CheckpointError,
    check_destination,
    file_sha256,
    is_export,
    recorded_digests,
    save_export,
    sidecar,
    tokenizer_or_none,
)
from egmla.config import ConfigError, ModelConfig
from egmla.models.transformer import Transformer

FORMATS = ("hf", "native", "egmla")


@dataclass
class Source:
    """A model to export and where it came from."""

    model: Transformer
    tokenizer: Any
    description: str  # what --checkpoint resolved to, for the metadata and the summary


# --------------------------------------------------------------------------------------------
# Reading: run directory, Lightning checkpoint, export, transformers directory, known name


def load_source(checkpoint: str | os.PathLike, dtype: torch.dtype | None = None) -> Source:
    """Resolve `--checkpoint` to a model, its tokenizer (or None) and a description."""
    from egmla.imports import load_pretrained

    path = Path(checkpoint)
    if path.is_file():
        if path.suffix != ".ckpt":
            raise CheckpointError(f"{path}: a file, but not a Lightning checkpoint (.ckpt)")
        # A .ckpt carries no tokenizer: the run's export has it, if the run got that far.
        model, tokenizer = load_lightning(path), tokenizer_or_none(path.parent.parent / "export")
        return Source(_cast(model, dtype), tokenizer, f"lightning checkpoint {path}")
    if path.is_dir() and is_export(path / "export"):
        path = path / "export"  # a training run (load_pretrained would resolve it too)
    elif path.is_dir() and (path / "checkpoints" / "last.ckpt").is_file():
        return load_source(path / "checkpoints" / "last.ckpt", dtype)  # stopped before exporting
    if not path.exists() and path.parent != Path(".") and path.parent.is_dir():
        raise CheckpointError(f"{path}: no such file or directory")  # not a hub id "org/name"
    model, tokenizer = load_pretrained(path if path.is_dir() else str(checkpoint), dtype=dtype)
    return Source(model, tokenizer, str(path) if path.is_dir() else f"known model {checkpoint}")


def load_lightning(path: Path) -> Transformer:
    """The egmla model inside a Lightning checkpoint written by `train.py` (no Lightning needed).
    Its bytes are checked against the SHA-256 its sidecar recorded, where it has one."""
    try:
        digests = recorded_digests(path)
        if digests is not None and file_sha256(path) not in digests:
            raise CheckpointError(
                f"{path}: its bytes changed after it was saved (their SHA-256 is not the one "
                f"{sidecar(path).name} recorded); export a good copy (a best-step*.ckpt of the "
                "run, with its .sha256) instead")
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror})") from err
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: pickle, zip and torch errors vary
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(err).__name__}: {err})") from err
    model_dict = (ckpt.get("hyper_parameters") or {}).get("model") if isinstance(ckpt, dict) else None
    if not isinstance(model_dict, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"{path}: no egmla model in it (hyper_parameters.model missing)")
    try:
        config = ModelConfig.from_dict(model_dict)
    except ConfigError as err:
        raise CheckpointError(
            f"{path}: its model config does not load ({err}); was it written by a newer egmla?"
        ) from err
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()
             if k.startswith("model.")}
    try:
        model = Transformer.from_state_dict(config, state)
    except ValueError as err:  # a tensor missing, unexpected or of another shape
        raise CheckpointError(f"{path}: does not match its model config: {err}") from None
    return model.to(next(iter(state.values())).dtype).eval()


def _cast(model: Transformer, dtype: torch.dtype | None) -> Transformer:
    return model if dtype is None else model.to(dtype)


# --------------------------------------------------------------------------------------------
# Writing


def export(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    format: str = "hf",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Export `checkpoint` to `out` in `format`; return the directory written.

    Nothing is written unless the whole export succeeds. An existing `out` is replaced only
    when it is empty, was written by this command, or `overwrite` is set.
    """
    if format not in FORMATS:
        raise CheckpointError(f"format={format!r}: must be one of {', '.join(FORMATS)}")
    out = check_destination(out, overwrite, writer="egmla.export")
    source = load_source(checkpoint, dtype)
    meta = _metadata(source)
    if format == "egmla":
        return save_export(source.model, out, tokenizer=source.tokenizer, extra=meta,
                           overwrite=True)  # checked above
    if format == "hf":
        from egmla.export.hf import save_hf

        return save_hf(source.model, out, tokenizer=source.tokenizer, meta=meta)
    return save_native(source.model, out, tokenizer=source.tokenizer, meta=meta)


def save_native(model: Transformer, out: Path, tokenizer: Any = None,
                meta: dict[str, Any] | None = None) -> Path:
    """Write a Llama (MHA) or dense DeepSeek-V3 (MLA) transformers directory, no remote code."""
    from egmla.export.hf import write_transformers_dir
    from egmla.export.native import native_config, native_state_dict

    dtype = next(model.parameters()).dtype
    config = {**native_config(model.config, dtype), "egmla": {"format": "native", **(meta or {})}}
    # native_state_dict refuses what the architecture cannot hold, before anything is written
    return write_transformers_dir(out, config, native_state_dict(model), tokenizer)


def _metadata(source: Source) -> dict[str, Any]:
    from egmla.provenance import git_info, versions

    return {"source": source.description, "git": git_info(),
            "versions": versions(("egmla", "torch", "transformers", "safetensors"))}
