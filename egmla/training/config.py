"""Typed training configuration: what Hydra composes is checked here, key by key.

Hydra builds a plain dict from `configs/` (model x attention x data x optim x trainer x logger,
plus an experiment); `TrainConfig.from_dict` turns it into dataclasses and fails on a
misspelled key with its dotted path (`trainer: unknown key 'max_step'`) and on a value of the
wrong type with the key and the type its field declares (`optim.lr: expected a float, got
'abc'`), the model section (`model.attention.d_c`) included.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from egmla.config import (
    ATTENTION_REGISTRY, ConfigError, ModelConfig, _check, _check_literals, _strict_kwargs,
)


# A run's seeds: numpy's (train.py seeds it too). Commands that start runs check theirs with
# `seed_arg` when their command line is read, not when a run's turn comes hours later.
TRAIN_SEEDS = range(2**32)
SEED_RULE = "seeds are from 0 to 2**32 - 1"


def seed_arg(text: str) -> int:
    """argparse `type=` of a seed a training run takes (TRAIN_SEEDS)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
    if value not in TRAIN_SEEDS:
        raise argparse.ArgumentTypeError(f"{text}: {SEED_RULE}")
    return value


def build(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass `cls` from `data`, recursing into dataclass-typed fields; strict keys and
    types. `where` is the dotted path of `data` ("" for the top level)."""
    if data is None:
        raise ConfigError(f"{where or 'config'}: missing section")
    kwargs = _strict_kwargs(cls, data, where or "config")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in kwargs:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where or 'config'}: missing required key {f.name!r}")
            continue
        path = f"{where}.{f.name}" if where else f.name
        value, hint = kwargs[f.name], hints[f.name]
        sub = _dataclass_in(hint)
        if sub is None:
            kwargs[f.name] = typed(value, hint, path)
        elif value is not None or type(None) not in typing.get_args(hint):
            kwargs[f.name] = build(sub, value, path)  # null for a required section: named
    obj = cls(**kwargs)
    _check_literals(obj, where or "config")
    return obj


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass in `X` or `X | None`, if any."""
    candidates = typing.get_args(hint) or (hint,)
    return next((c for c in candidates if dataclasses.is_dataclass(c)), None)


# --------------------------------------------------------------------------------------------
# Types of leaf values. Hydra parses `optim.lr=abc` as the string 'abc' and `optim.lr=null` as
# None; both are refused here, before any code does arithmetic on them. Two readings are
# allowed: an int where a float is declared (`optim.lr=1`), and an int where a string is
# declared, taken as its digits (`name=123` -> "123"). A bool is never an int, nor 0/1 a bool.


def typed(value: Any, hint: Any, where: str) -> Any:
    """`value` checked against the annotation `hint` (ints become str for str fields)."""
    if hint is Any or typing.get_origin(hint) is Literal:  # Literals: _check_literals names them
        return value
    arms = _union_arms(hint)
    if arms is not None:
        if value is None and type(None) in arms:
            return None
        for arm in arms:
            try:
                return typed(value, arm, where)
            except ConfigError:
                continue
        raise _type_error(value, hint, where)
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(value, hint, where)
        (item,) = typing.get_args(hint) or (Any,)
        return [typed(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise _type_error(value, hint, where)
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str and number and isinstance(value, int):
        return str(value)  # name=123
    fits = {bool: isinstance(value, bool), int: number and isinstance(value, int),
            float: number, str: isinstance(value, str)}
    if fits.get(hint):
        return value
    raise _type_error(value, hint, where)


def _union_arms(hint: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return None


_NAMES = {int: "an int", float: "a float", bool: "a bool (true or false)", str: "a string",
          dict: "a mapping", type(None): "null"}


def _describe(hint: Any) -> str:
    """'a float', 'an int or null', 'a list (each a float)' ..."""
    arms = _union_arms(hint)
    if arms is not None:
        return " or ".join(_describe(a) for a in sorted(arms, key=lambda a: a is type(None)))
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return f"a list (each {_describe(item)})"
    return _NAMES.get(origin or hint, str(hint))


def _type_error(value: Any, hint: Any, where: str) -> ConfigError:
    shown = "null" if value is None else repr(value)
    return ConfigError(f"{where}: expected {_describe(hint)}, got {shown}")


def typed_model(data: Any) -> Any:
    """The model section with its leaf types checked (`model.d_model`, `model.attention.d_c`).

    Only types: unknown keys, a missing or unknown attention type and the shapes are left to
    `ModelConfig.from_dict`, which names them.
    """
    if not isinstance(data, dict):
        return data
    out = _typed_known_fields(ModelConfig, data, "model", skip=("attention",))
    attention = data.get("attention")
    kind = attention.get("type") if isinstance(attention, dict) else None
    if isinstance(kind, str) and kind in ATTENTION_REGISTRY:
        rest = {k: v for k, v in attention.items() if k != "type"}
        out["attention"] = {"type": kind, **_typed_known_fields(ATTENTION_REGISTRY[kind], rest,
                                                                "model.attention")}
    return out


def _typed_known_fields(cls: type, data: dict[str, Any], where: str,
                        skip: tuple[str, ...] = ()) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)} - set(skip)
    return {k: typed(v, hints[k], f"{where}.{k}") if k in fields else v for k, v in data.items()}


@dataclass
class TokenizerConfig:
    kind: Literal["bpe", "smollm2", "pretrained"] = "bpe"
    vocab_size: int = 4096  # bpe only: trained on the embedded corpus's training split
    path: str | None = None  # pretrained only: a local tokenizer directory or a hub id


@dataclass
class HFDataConfig:
    """Any dataset `datasets.load_dataset` can read: a hub name or local files."""

    path: str = "text"  # a hub name, or a builder such as text / json / parquet
    name: str | None = None
    data_files: Any = None  # str, list or {split: files}; relative to the working directory
    split: str = "train"
    val_split: str | None = None  # a named split; else a held-out fraction of `split`
    text_field: str = "text"
    streaming: bool = False
    revision: str | None = None
    max_tokens: int | None = None  # cap on tokens taken from a (streaming) training split


@dataclass
class MQARDataConfig:
    """Multi-query associative recall (Zoology). Trains on a mixture, reports accuracy by slice."""

    vocab_size: int = 8192
    train_kv_pairs: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 64])
    val_kv_pairs: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 64])
    train_examples: int = 100_000
    val_examples: int = 1_000  # per slice
    power_a: float = 0.01

    def validate(self, seq_len: int) -> None:
        """Every slice the run will build, checked now: before anything is written."""
        from egmla.data.mqar import MQARConfig  # (imports torch) only for an MQAR run

        for name in ("train_kv_pairs", "val_kv_pairs"):
            _check(len(getattr(self, name)) >= 1,
                   f"data.mqar.{name}=[]: needs at least one number of key-value pairs")
        share = self.train_examples // len(self.train_kv_pairs)  # examples per training slice
        _check(share >= 1, f"data.mqar.train_examples={self.train_examples}: fewer than one "
                           f"for each of the {len(self.train_kv_pairs)} train_kv_pairs")
        _check(self.val_examples >= 1, f"data.mqar.val_examples={self.val_examples}: must be >= 1")
        for k in sorted({*self.train_kv_pairs, *self.val_kv_pairs}):
            try:
                MQARConfig(vocab_size=self.vocab_size, seq_len=seq_len, num_kv_pairs=k,
                           power_a=self.power_a)
            except ValueError as err:
                raise ConfigError(f"data.mqar (kv_pairs {k}, data.seq_len {seq_len}): "
                                  f"{err}") from None


@dataclass
class RecoveryDataConfig:
    """The recovery mixture (egmla.data.recovery): Python's standard library and READMEs."""

    max_tokens: int | None = None  # cap on the training split's tokens (a sample of both kinds)


@dataclass
class DataConfig:
    kind: Literal["corpus", "hf", "mqar", "recovery"] = "corpus"
    seq_len: int = 256
    batch_size: int = 16  # per device, per micro-batch
    val_fraction: float = 0.05  # held-out fraction where a source has no validation split
    num_workers: int = 0
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    hf: HFDataConfig | None = None
    mqar: MQARDataConfig | None = None
    recovery: RecoveryDataConfig | None = None

    def validate(self) -> None:
        _check(self.seq_len >= 2, f"data.seq_len={self.seq_len}: must be >= 2")
        _check(self.batch_size >= 1, f"data.batch_size={self.batch_size}: must be >= 1")
        _check(0 < self.val_fraction < 1, f"data.val_fraction={self.val_fraction}: must be in (0, 1)")
        _check(self.kind != "hf" or self.hf is not None, "data.kind='hf' needs a data.hf section")
        _check(self.kind != "mqar" or self.mqar is not None,
               "data.kind='mqar' needs a data.mqar section")
        if self.kind == "mqar":
            self.mqar.validate(self.seq_len)


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    weight_decay: float = 0.1  # not applied to norms, biases or embeddings (incl. gate tables)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly

    def validate(self) -> None:
        _check(self.lr > 0, f"optim.lr={self.lr}: must be > 0")
        _check(0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio={self.min_lr_ratio}: in [0, 1]")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps}: must be >= 0")
        _check(0 < self.decay_fraction <= 1, f"optim.decay_fraction={self.decay_fraction}: in (0, 1]")
        _check(len(self.betas) == 2, f"optim.betas={self.betas}: needs two values")


@dataclass
class TrainerConfig:
    accelerator: str = "cpu"
    devices: Any = 1  # an int, a list of ids or "auto"
    num_nodes: int = 1
    strategy: str = "auto"  # auto | ddp | fsdp | ddp_spawn ...
    # Lightning's (32-true, bf16-mixed, ...) or auto: bf16-mixed where the device computes bf16
    # natively (a CUDA GPU that supports it, a CPU with AVX512-BF16 or AMX), else 32-true
    precision: str = "32-true"
    max_steps: int = 1000
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = 1.0
    val_every_n_steps: int = 200
    limit_val_batches: int | float = 50  # the periodic validations
    # The final validation after training: None covers the whole held-out split (the number the
    # summary and the studies report); a smaller int or fraction only for quick runs.
    final_val_batches: int | float | None = None
    log_every_n_steps: int = 10
    checkpoint_every_n_steps: int = 200
    compile: bool = False
    deterministic: bool = False
    peak_tflops: float | None = None  # per device, for the MFU estimate; None: known GPUs only

    def validate(self) -> None:
        _check(self.max_steps >= 1, f"trainer.max_steps={self.max_steps}: must be >= 1")
        _check(self.accumulate_grad_batches >= 1,
               f"trainer.accumulate_grad_batches={self.accumulate_grad_batches}: must be >= 1")
        for name in ("val_every_n_steps", "log_every_n_steps", "checkpoint_every_n_steps"):
            _check(getattr(self, name) >= 1, f"trainer.{name}={getattr(self, name)}: must be >= 1")
        final = self.final_val_batches
        _check(final is None or final > 0, f"trainer.final_val_batches={final}: must be > 0 "
               "(a batch count, or a fraction of the split) or null (the whole split)")


@dataclass
class WandbConfig:
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"  # auto: online iff a key exists
    project: str = "egmla"
    entity: str | None = None
    group: str | None = None  # a -m sweep sets it to the sweep (train.py) unless given
    name: str | None = None  # None: the run's name; a -m sweep's jobs add their overrides
    tags: list[str] = field(default_factory=list)


@dataclass
class DistillConfig:
    """Recovery by distillation from a teacher (egmla.training.distill; docs/upcycling.md).

    The loss is KL(teacher || student) per token: over the teacher's `top_k` most likely tokens
    and the rest of the vocabulary as one bucket (exact for the teacher's distribution coarsened
    so; 0: the whole vocabulary). The teacher's top-k log-probabilities are computed once per
    training sequence and cached on disk, so every arm trained on the same tokens reuses them.
    `transfer_steps` first: that many steps of layer-wise attention transfer (each attention
    layer fit to the teacher layer's output on the teacher's inputs, LoLCATs' first stage),
    counted in trainer.max_steps, then the KL stage."""

    teacher: str = "SmolLM2-135M-Instruct"  # a known name, an export or a transformers directory
    top_k: int = 64
    ce_weight: float = 0.0  # + ce_weight * next-token cross-entropy on the data
    train: Literal["all", "attention"] = "all"  # which parameters learn
    transfer_steps: int = 0
    teacher_cache: bool = True  # cache the teacher's top-k on disk (top_k > 0)

    def validate(self) -> None:
        _check(self.top_k >= 0, f"distill.top_k={self.top_k}: must be >= 0 (0: full vocabulary)")
        _check(self.ce_weight >= 0, f"distill.ce_weight={self.ce_weight}: must be >= 0")
        _check(self.transfer_steps >= 0,
               f"distill.transfer_steps={self.transfer_steps}: must be >= 0")


@dataclass
class TrainConfig:
    name: str
    model: dict[str, Any] | None = None  # validated into ModelConfig by `model_config()`
    # An export directory to start from (its config is the model's: `model` must then be
    # absent), e.g. a model converted by `python -m egmla.upcycle`.
    init: str | None = None
    distill: DistillConfig | None = None
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    seed: int = 0
    export: bool = True  # write run_dir/export/ after training
    export_steps: list[int] = field(default_factory=list)  # also run_dir/exports/step<N>/
    sample_prompt: str | None = "ROMEO:"  # printed with a short sample after training

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        cfg = build(cls, data)
        cfg.model_config()  # strict check of the model section now, not at first use
        cfg.data.validate()
        cfg.optim.validate()
        cfg.trainer.validate()
        _check(cfg.seed in TRAIN_SEEDS, f"seed={cfg.seed}: {SEED_RULE} (numpy's, which the run "
               "seeds too)")
        if cfg.distill is not None:
            cfg.distill.validate()
            _check(cfg.distill.transfer_steps < cfg.trainer.max_steps,
                   f"distill.transfer_steps={cfg.distill.transfer_steps}: must be below "
                   f"trainer.max_steps={cfg.trainer.max_steps}")
        return cfg

    def model_config(self) -> ModelConfig:
        if self.init is not None:
            _check(self.init != "???", "init: missing; pass init=<export directory> (python -m "
                   "egmla.upcycle writes one)")
            _check(not self.model, "init= and a model section both given: the run's model is "
                   "the init export's (drop the model section, e.g. override /model: null)")
            from egmla.checkpoint import CheckpointError, read_export_config  # torch: when needed

            try:
                return read_export_config(self.init)[0]
            except CheckpointError as err:
                raise ConfigError(f"init={self.init!r}: {err}") from None
        _check(bool(self.model), "model: missing section (or give init=<export directory>)")
        model = typed_model(self.model)  # its own paths: "model.attention.d_c: expected ..."
        try:
            return ModelConfig.from_dict(model)
        except ConfigError as err:
            raise ConfigError(f"model: {err}".replace("model: model:", "model:")) from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
