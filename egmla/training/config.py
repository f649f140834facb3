"""Typed training configuration: what Hydra composes is checked here, key by key.

Hydra builds a plain dict from `configs/` (model x attention x data x optim x trainer x logger,
plus an experiment); `TrainConfig.from_dict` turns it into dataclasses and fails on a
misspelled key with its dotted path, e.g. `trainer: unknown key 'max_step'`.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from egmla.config import ConfigError, ModelConfig, _check, _check_literals, _strict_kwargs


def build(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from `data`, recursing into dataclass-typed fields; strict keys."""
    if data is None:
        raise ConfigError(f"{where}: missing section")
    kwargs = _strict_kwargs(cls, data, where)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in kwargs:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where}: missing required key {f.name!r}")
            continue
        sub = _dataclass_in(hints[f.name])
        if sub is not None and kwargs[f.name] is not None:
            kwargs[f.name] = build(sub, kwargs[f.name], f"{where}.{f.name}")
    obj = cls(**kwargs)
    _check_literals(obj, where)
    return obj


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass in `X` or `X | None`, if any."""
    candidates = typing.get_args(hint) or (hint,)
    return next((c for c in candidates if dataclasses.is_dataclass(c)), None)


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


@dataclass
class DataConfig:
    kind: Literal["corpus", "hf", "mqar"] = "corpus"
    seq_len: int = 256
    batch_size: int = 16  # per device, per micro-batch
    val_fraction: float = 0.05  # held-out fraction where a source has no validation split
    num_workers: int = 0
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    hf: HFDataConfig | None = None
    mqar: MQARDataConfig | None = None

    def validate(self) -> None:
        _check(self.seq_len >= 2, f"data.seq_len={self.seq_len}: must be >= 2")
        _check(self.batch_size >= 1, f"data.batch_size={self.batch_size}: must be >= 1")
        _check(0 < self.val_fraction < 1, f"data.val_fraction={self.val_fraction}: must be in (0, 1)")
        _check(self.kind != "hf" or self.hf is not None, "data.kind='hf' needs a data.hf section")
        _check(self.kind != "mqar" or self.mqar is not None,
               "data.kind='mqar' needs a data.mqar section")


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
    precision: str = "32-true"  # bf16-mixed on GPUs
    max_steps: int = 1000
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = 1.0
    val_every_n_steps: int = 200
    limit_val_batches: int | float = 50
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


@dataclass
class WandbConfig:
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"  # auto: online iff a key exists
    project: str = "egmla"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    name: str
    model: dict[str, Any]  # validated into ModelConfig by `model_config()`
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    seed: int = 0
    export: bool = True  # write run_dir/export/ after training
    sample_prompt: str | None = "ROMEO:"  # printed with a short sample after training

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        cfg = build(cls, data, "config")
        cfg.model_config()  # strict check of the model section now, not at first use
        cfg.data.validate()
        cfg.optim.validate()
        cfg.trainer.validate()
        return cfg

    def model_config(self) -> ModelConfig:
        try:
            return ModelConfig.from_dict(self.model)
        except ConfigError as err:
            raise ConfigError(f"model: {err}".replace("model: model:", "model:")) from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
