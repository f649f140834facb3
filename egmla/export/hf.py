"""egmla <-> a transformers-format directory with our modeling code (`trust_remote_code`).

    my-model-hf/
      config.json                model_type "egmla", auto_map, the model's fields, "egmla" metadata
      configuration_egmla.py     EgmlaConfig            (copied from egmla/export/hf_code/)
      modeling_egmla.py          EgmlaForCausalLM, EgmlaCache
      model.safetensors          weights under transformers' names (Llama's for MHA, DeepSeek's for
                                 MLA, plus the EG-MLA gate); a tied lm_head is stored once
      generation_config.json     bos / eos
      tokenizer files            when the source has a tokenizer

Anyone can then run

    AutoModelForCausalLM.from_pretrained("my-model-hf", trust_remote_code=True)

with only torch and transformers installed. egmla reads the directory back without transformers
and without running its code (`load_hf`), so `load_pretrained` and the serving engine accept it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from egmla import files
from egmla.cache import CacheSpec
from egmla.checkpoint import CheckpointError, read_weights
from egmla.config import ConfigError, ModelConfig
from egmla.weight_names import BLOCK, DEEPSEEK_ATTENTION, LLAMA_ATTENTION, TOP_LEVEL, build_model, rename_weights
from egmla.models.transformer import Transformer, cache_spec_for

FORMAT = "hf"
FORMAT_VERSION = 1
CODE_DIR = Path(__file__).parent / "hf_code"
CODE_FILES = ("configuration_egmla.py", "modeling_egmla.py")
AUTO_MAP = {
    "AutoConfig": "configuration_egmla.EgmlaConfig",
    "AutoModel": "modeling_egmla.EgmlaModel",
    "AutoModelForCausalLM": "modeling_egmla.EgmlaForCausalLM",
}
# egmla ModelConfig field -> transformers config field.
FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "d_ff": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "init_std": "initializer_range",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
}
# EG-MLA's per-layer gate pieces, transformers name -> egmla name.
_GATE = {
    "self_attn.gate_embed_proj.weight": "attn.w_gate.weight",
    "self_attn.gate_norm.weight": "attn.gate_norm.weight",
    "self_attn.gate_norm.bias": "attn.gate_norm.bias",
}


# The weight-name families a variant's `hf_layout` lists, merged in that order.
_LAYOUTS = {"llama": LLAMA_ATTENTION, "deepseek": DEEPSEEK_ATTENTION, "gate": _GATE}


def _attention_keys(config: ModelConfig) -> dict[str, str]:
    """transformers name -> egmla name of every per-layer attention weight of this variant."""
    a = config.attention
    if not a.hf_layout:
        raise ValueError(a.hf_refusal or f"attention type {a.type!r} has no transformers export")
    return {k: v for part in a.hf_layout for k, v in _LAYOUTS[part].items()}


def _gate_tables(config: ModelConfig) -> dict[str, list[str]]:
    """transformers gate table -> the egmla keys of every layer of its group (one tensor)."""
    return {
        f"model.gate_embeddings.{g}.weight": [f"layers.{i}.attn.gate_table.weight" for i in layers]
        for g, layers in enumerate(config.attention.table_groups(config))
    }


# --------------------------------------------------------------------------------------------
# egmla -> transformers


def hf_config(config: ModelConfig, dtype: torch.dtype, meta: dict[str, Any]) -> dict[str, Any]:
    """The config.json of a transformers-format export of a model with `config`."""
    return {
        "architectures": ["EgmlaForCausalLM"],
        "model_type": "egmla",
        "auto_map": AUTO_MAP,
        **{hf: getattr(config, ours) for ours, hf in FIELDS.items()},
        "attention": config.attention.to_dict(),
        "ffn": config.ffn,
        "dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
        "egmla": {"format": FORMAT, "format_version": FORMAT_VERSION, **meta},
    }


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """transformers name -> tensor; every shared tensor (gate table, tied head) stored once."""
    config = model.config
    return rename_to_hf(model, _attention_keys(config), _gate_tables(config),
                        keep_tied_head=False)


def rename_to_hf(
    model: Transformer,
    attention: dict[str, str],
    shared: dict[str, list[str]] | None = None,
    keep_tied_head: bool = False,
) -> dict[str, torch.Tensor]:
    """The model's weights under transformers' names, ready for safetensors' save_file.

    `attention` maps transformers' per-layer attention names to ours (the import tables);
    `shared` maps a transformers name to the egmla names of one shared tensor, stored once. A
    tied lm_head is left out (transformers ties it back) unless `keep_tied_head`, which stores
    a copy. Tensors are detached and contiguous, and none shares memory with another.
    """
    config = model.config
    to_hf = {ours: hf for hf, ours in TOP_LEVEL.items()}
    for hf, ours in (shared or {}).items():
        to_hf.update(dict.fromkeys(ours, hf))
    block = {ours: hf for hf, ours in {**BLOCK, **attention}.items()}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and config.tie_embeddings:
            if keep_tied_head:
                out[to_hf[key]] = tensor.detach().clone()
            continue
        if key in to_hf:
            name = to_hf[key]
        else:
            layer, _, rest = key.removeprefix("layers.").partition(".")
            if rest not in block:
                raise CheckpointError(f"weight {key!r} has no transformers name in this format")
            name = f"model.layers.{layer}.{block[rest]}"
        out.setdefault(name, tensor.detach().contiguous())  # a shared table: stored once
    return out


def transformers_cache_spec(config: ModelConfig) -> CacheSpec:
    """What the exported modeling code's cache holds per token: egmla's cache for the rebuild
    computation (`impl: naive`). The modeling code rebuilds EG-MLA `kv` K/V from the latent and
    the ids at each step, so it keeps none of the norm statistics egmla's absorbed decode caches."""
    return cache_spec_for(dataclasses.replace(config, attention=config.attention.as_reference()))


def save_hf(
    model: Transformer,
    directory: str | os.PathLike,
    tokenizer: Any = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write `model` (and `tokenizer`) as a transformers-format directory, atomically."""
    dtype = next(model.parameters()).dtype
    return write_transformers_dir(directory, hf_config(model.config, dtype, meta or {}),
                                  hf_state_dict(model), tokenizer,
                                  code=tuple(CODE_DIR / name for name in CODE_FILES))


def write_transformers_dir(
    directory: str | os.PathLike,
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    tokenizer: Any = None,
    code: tuple[Path, ...] = (),
) -> Path:
    """config.json, generation_config.json (bos / eos), model.safetensors, the `code` files and
    the tokenizer's files, written into place at once: the layout transformers reads."""
    directory = Path(os.path.abspath(directory))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id")
                  if config.get(k) is not None}
    directory.parent.mkdir(parents=True, exist_ok=True)
    with files.atomic_directory(directory, replace_existing=True) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        safetensors.torch.save_file(weights, str(tmp / "model.safetensors"),
                                    metadata={"format": "pt"})
        for path in code:
            shutil.copyfile(path, tmp / path.name)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return directory


# --------------------------------------------------------------------------------------------
# transformers -> egmla


def is_hf_export(directory: str | os.PathLike) -> bool:
    """True when `directory` holds a config.json with model_type "egmla" (written by save_hf)."""
    try:
        data = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("model_type") == "egmla"


def read_hf_config(directory: str | os.PathLike) -> ModelConfig:
    """The egmla ModelConfig of a transformers-format export; refuses newer formats."""
    path = Path(directory) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read ({err})") from err
    version = (data.get("egmla") or {}).get("format_version", FORMAT_VERSION)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: egmla format_version={version!r} was written by a newer egmla; this one "
            f"reads version {FORMAT_VERSION} (upgrade egmla)"
        )
    missing = [hf for hf in (*FIELDS.values(), "attention") if hf not in data]
    if missing:
        raise CheckpointError(f"{path}: missing key {missing[0]!r}")
    try:
        return ModelConfig.from_dict(
            {ours: data[hf] for ours, hf in FIELDS.items()} | {"attention": data["attention"]}
            | {"ffn": data.get("ffn", "swiglu")}  # exports written before `ffn` are SwiGLU
        )
    except ConfigError as err:
        raise CheckpointError(f"{path}: {err}") from err


def load_hf(directory: str | os.PathLike, dtype: torch.dtype | None = None) -> Transformer:
    """Rebuild the egmla model from a transformers-format export, without transformers.

    The directory's Python files are never imported: egmla reads config.json and the weights.
    """
    directory = Path(directory)
    config = read_hf_config(directory)
    weights = read_weights(directory / "model.safetensors")
    state = rename_weights(weights, config, _attention_keys(config), shared=_gate_tables(config))
    model = build_model(config, state)
    return model if dtype is None else model.to(dtype)

