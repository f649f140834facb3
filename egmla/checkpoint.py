"""A plain export: the directory a trained or imported model is served and shared from.

    my-model/
      config.json          ModelConfig.to_dict() + {"egmla_format_version": 1, "dtype", "extra"}
      model.safetensors    weights; tied and shared tensors (lm_head, EG-MLA gates) stored once
      tokenizer.json ...   optional, written by a Hugging Face tokenizer's save_pretrained

Loading the model needs only torch and safetensors: no transformers, Lightning or Hydra, so a
serving process or a colleague's notebook can rebuild the model from the directory alone.

    >>> save_export(model, "exports/tiny")                       # doctest: +SKIP
    >>> model = load_export("exports/tiny", dtype=torch.bfloat16)  # doctest: +SKIP

Saving is atomic: everything is written into a temporary sibling directory that is renamed into
place at the end, so a crash or an error never leaves a half-written export behind.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError

from egmla import files
from egmla.config import ConfigError, ModelConfig
from egmla.dtypes import dtype_name, parse_dtype
from egmla.models.transformer import Transformer

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Keys of config.json that describe the export rather than the model.
_META_KEYS = ("egmla_format_version", "dtype", "extra")
# Files any Hugging Face tokenizer's save_pretrained writes one of.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class CheckpointError(ValueError):
    """An export directory is missing, incomplete or does not match its config; names the path."""


# --------------------------------------------------------------------------------------------
# Saving


# ---- checkpoint digests ------------------------------------------------------------------------
# A training checkpoint's SHA-256 sits in a sidecar `<name>.sha256` in sha256sum's format
# (egmla/training/checkpoints.py writes both); what reads a checkpoint checks it here.

SIDECAR_SUFFIX = ".sha256"
CHUNK = 8 << 20  # bytes hashed per read


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR_SUFFIX)


def recorded_digests(path: Path) -> set[str] | None:
    """The digests `path`'s sidecar lists; None when it has none."""
    try:
        text = sidecar(path).read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return set()  # unreadable: no digest can match
    return {line.split()[0].lower() for line in text.splitlines() if line.strip()}


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in CHUNK-sized pieces (a 1 GB checkpoint is never held whole)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def save_export(
    model: Transformer,
    directory: str | os.PathLike,
    tokenizer: Any = None,
    extra: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `model` (and `tokenizer`, if given) as an export at `directory`; return its path.

    A directory egmla wrote is replaced; any other non-empty directory is refused unless
    `overwrite`, so a mistyped path cannot wipe unrelated files. `extra` is JSON metadata kept
    in config.json (e.g. where the weights came from).
    """
    if not isinstance(model, Transformer):
        raise CheckpointError(f"save_export needs an egmla Transformer, got {type(model).__name__}")
    directory = check_destination(directory, overwrite)
    dtype = _float_dtype(model)
    meta: dict[str, Any] = {"egmla_format_version": FORMAT_VERSION, "dtype": dtype_name(dtype)}
    if extra is not None:
        meta["extra"] = extra
    config_text = json.dumps({**model.config.to_dict(), **meta}, indent=2)  # fails before writing

    directory.parent.mkdir(parents=True, exist_ok=True)
    with files.atomic_directory(directory, replace_existing=True) as tmp:
        tmp.mkdir()  # (honours the umask, unlike tempfile.mkdtemp's 0700: exports get shared)
        (tmp / CONFIG_FILE).write_text(config_text + "\n")
        safetensors.torch.save_model(model, str(tmp / WEIGHTS_FILE))
        os.chmod(tmp / WEIGHTS_FILE, (tmp / CONFIG_FILE).stat().st_mode & 0o777)  # same umask
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return directory


def check_destination(directory: str | os.PathLike, overwrite: bool = False,
                      writer: str = "egmla") -> Path:
    """`directory` as an absolute path, once an export may be written there: it is new, empty,
    written by egmla (or `overwrite`), and its parent can be written (`files.check_writable`).
    Commands call it before their long work, so that a bad --out fails at once rather than
    after a conversion or an export."""
    directory = Path(os.path.abspath(directory))  # "." or "x/" get a real name and parent
    if directory.exists() and not (overwrite or replaceable(directory)):
        raise CheckpointError(f"{directory}: exists and was not written by {writer}; refusing to "
                              "overwrite it (choose another directory, or pass --overwrite)")
    try:
        files.check_writable(directory.parent)  # the export is made beside it, then renamed
    except OSError as err:
        raise CheckpointError(f"{directory}: cannot be written ({err.strerror or err})") from None
    return directory


def replaceable(directory: Path) -> bool:
    """An empty directory, or one egmla wrote (a plain export, or a `python -m egmla.export`
    directory, whose config.json has an "egmla" entry), may be replaced."""
    if not directory.is_dir():
        return False
    if not any(directory.iterdir()) or is_export(directory):
        return True
    try:
        data = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("egmla"), dict)


def _float_dtype(model: torch.nn.Module) -> torch.dtype:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        raise CheckpointError(f"model parameters have mixed dtypes {sorted(map(str, dtypes))}")
    return dtypes.pop()


# --------------------------------------------------------------------------------------------
# Loading


def is_export(directory: str | os.PathLike) -> bool:
    """True when `directory` holds a config.json written by `save_export` (any format version)."""
    path = Path(directory) / CONFIG_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "egmla_format_version" in data


def read_export_config(directory: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
    """config.json -> (ModelConfig, export metadata: format version, dtype, extra)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such export directory")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; {directory} is not an egmla export")
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, dict) or "egmla_format_version" not in data:
        raise CheckpointError(f"{path}: no 'egmla_format_version' key; not an egmla export")
    version = data["egmla_format_version"]
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: egmla_format_version={version!r}, this egmla reads version {FORMAT_VERSION}"
        )
    meta = {key: data.pop(key) for key in _META_KEYS if key in data}
    try:
        config = ModelConfig.from_dict(data)
    except ConfigError as err:
        raise CheckpointError(f"{path}: {err}") from err
    return config, meta


def load_export(
    directory: str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Transformer:
    """Rebuild the model saved at `directory`, in eval mode.

    `dtype` defaults to the dtype the weights were saved in; `device` to the CPU.
    """
    directory = Path(directory)
    config, meta = read_export_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing; the export at {directory} has no weights")
    if dtype is None:
        try:
            dtype = parse_dtype(meta.get("dtype", "float32"))
        except ValueError:
            raise CheckpointError(f"{directory / CONFIG_FILE}: unknown dtype {meta.get('dtype')!r}") from None
    device = torch.device(device or "cpu")
    try:  # tensors on the file's mapped pages, copied into the model's own memory below (a
        # file rewritten in place later cannot change, or truncated crash, a model loaded from it)
        state = safetensors.torch.load_file(str(weights), device=str(device))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{weights}: not a readable safetensors file ({err})") from err
    try:
        model = Transformer.from_state_dict(config, state)
    except ValueError as err:
        raise CheckpointError(f"{weights}: does not match {directory / CONFIG_FILE}: {err}") from None
    return model.to(dtype).eval()


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, on the CPU; CheckpointError names a bad file."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return safetensors.torch.load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from err


def read_metadata(path: Path) -> dict[str, str]:
    """The metadata of a safetensors file ({} when it has none); CheckpointError names a bad file."""
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from err


def tokenizer_or_none(directory: str | os.PathLike) -> Any:
    """The tokenizer saved in `directory`, or None when there is none."""
    try:
        return load_tokenizer(directory)
    except CheckpointError:
        return None


def load_tokenizer(directory: str | os.PathLike) -> Any:
    """The Hugging Face tokenizer saved with an export (needs `transformers`)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such export directory")
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise CheckpointError(
            f"{directory}: no tokenizer files (looked for {', '.join(_TOKENIZER_FILES)}); "
            "pass tokenizer= to save_export to include one"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise CheckpointError(
            "loading a tokenizer needs transformers: pip install 'egmla[hf]'"
        ) from err
    from transformers.utils import logging

    # trust_remote_code=False: an export with modeling code (--format hf) has a plain tokenizer,
    # and transformers would otherwise stop to ask whether to run that code. Reading the config
    # of a model type it does not know makes transformers log a warning meant for models.
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
    finally:
        logging.set_verbosity(level)
