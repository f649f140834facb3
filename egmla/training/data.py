"""LightningDataModules: packed text (embedded corpus or any `datasets` source) and MQAR.

Training data is a deterministic stream (`StepSampler`): micro-batch step s of rank r is a
function of (seed, s, r) alone. A resumed run starts the stream at the restored global step, and
a 2-process run splits each step's global batch, so both see exactly what one uninterrupted
process sees.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
from torch.utils.data import ConcatDataset, DataLoader, Dataset

from egmla.config import ConfigError
from egmla.data.mqar import MQARConfig, MQARDataset
from egmla.data.packing import Indexed, PackedDataset, tokenize_to_cache
from egmla.data.sampler import StepSampler
from egmla.data.sources import load_text_source
from egmla.data.tokenizer import get_tokenizer
from egmla.training.config import DataConfig


class StepLoader(DataLoader):
    """A DataLoader whose length is the whole run's micro-batches, wherever iteration starts.

    Lightning restores its batch counter on resume (say to step k of n) and ends the epoch when
    the counter reaches `len(loader)`; the sampler resumes at k, so the two stay in step.
    """

    def __init__(self, dataset: Dataset, sampler: StepSampler, batch_size: int, total: int,
                 **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **kwargs)
        self.total = total

    def __len__(self) -> int:
        return self.total

    # Lightning asks loaders for state to resume mid-epoch. Ours has none of its own: the
    # position is the trainer's restored global step, read when the loader is built.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class _StepDataModule(L.LightningDataModule):
    """Shared: the resumable training loader; subclasses provide the datasets and declare what
    differs between kinds of data (tokenizer, vocabulary check, validation slices, baselines),
    so the training run never asks which kind it holds."""

    val_slices: list[str] | None = None  # names of the validation sets, if they are reported apart

    def __init__(self, data: DataConfig, seed: int, max_steps: int, indexed: bool = False) -> None:
        super().__init__()
        self.data, self.seed, self.max_steps = data, seed, max_steps
        self.indexed = indexed  # training items carry their window index (distillation)
        self.train_set: Dataset | None = None
        self.val_sets: list[Dataset] = []

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        accumulate = trainer.accumulate_grad_batches
        total = self.max_steps * accumulate  # micro-batches in the whole run
        sampler = StepSampler(
            len(self.train_set),
            global_batch=self.data.batch_size * trainer.world_size,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            seed=self.seed,
            start_step=trainer.global_step * accumulate,
            total_steps=total,
        )
        return StepLoader(self.train_set, sampler, self.data.batch_size, total,
                          num_workers=self.data.num_workers)

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(ds, batch_size=self.data.batch_size, shuffle=False,
                           num_workers=self.data.num_workers) for ds in self.val_sets]

    def load_tokenizer(self):
        """The run's tokenizer, or None for data that is token ids already."""
        return None

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ConfigError if a model with `vocab_size` cannot embed this data's tokens."""

    def baselines(self) -> dict[str, float]:
        """Reference losses for the run's summary (after setup)."""
        return {}


class TextDataModule(_StepDataModule):
    """Tokenized, packed text. Tokenizer training and tokenization are cached on disk and done
    once per node (`prepare_data`), then every rank loads the cache (`setup`)."""

    def __init__(self, data: DataConfig, seed: int, max_steps: int, indexed: bool = False) -> None:
        super().__init__(data, seed, max_steps, indexed)
        self.tokenizer = None
        self.train_tokens = None  # the flat training tokens (setup)

    def _source(self):
        if self.data.kind in ("corpus", "recovery"):
            return load_text_source(self.data.kind, val_fraction=self.data.val_fraction)
        options = {k: v for k, v in vars(self.data.hf).items() if k != "max_tokens"}
        return load_text_source("hf", val_fraction=self.data.val_fraction, **options)

    def load_tokenizer(self):
        """The run's tokenizer, loaded (or trained and cached on disk) once per process."""
        if self.tokenizer is None:
            t = self.data.tokenizer
            self.tokenizer = get_tokenizer(t.kind, vocab_size=t.vocab_size, path=t.path)
        return self.tokenizer

    def _tokens(self):
        tokenizer = self.load_tokenizer()
        source = self._source()
        key = {"data": source.fingerprint, "val_fraction": self.data.val_fraction}
        section = self.data.hf if self.data.kind == "hf" else self.data.recovery
        max_tokens = section.max_tokens if section is not None else None
        train = tokenize_to_cache(source.train, tokenizer, {**key, "split": "train"},
                                  max_tokens=max_tokens, desc="tokenize train")
        val = tokenize_to_cache(source.val, tokenizer, {**key, "split": "val"}, desc="tokenize val")
        return tokenizer, train, val

    def prepare_data(self) -> None:
        self._tokens()

    def check_vocab(self, vocab_size: int) -> None:
        size = len(self.load_tokenizer())
        if size > vocab_size:
            raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the tokenizer's "
                              f"vocabulary ({size})")

    def baselines(self) -> dict[str, float]:
        return {"unigram_val_loss": unigram_loss(self.train_tokens, self.val_sets[0].tokens,
                                                 len(self.load_tokenizer()))}

    def setup(self, stage: str | None = None) -> None:
        _, train, val = self._tokens()
        self.train_tokens = train
        self.train_set = PackedDataset(train, self.data.seq_len)
        if self.indexed:
            self.train_set = Indexed(self.train_set)
        self.val_sets = [PackedDataset(val, self.data.seq_len)]


class MQARDataModule(_StepDataModule):
    """MQAR: a training mixture over `train_kv_pairs`, one validation set per `val_kv_pairs`."""

    def setup(self, stage: str | None = None) -> None:
        m, seq = self.data.mqar, self.data.seq_len
        share = m.train_examples // len(m.train_kv_pairs)
        parts = [MQARDataset(MQARConfig(vocab_size=m.vocab_size, seq_len=seq, num_kv_pairs=k,
                                        power_a=m.power_a, num_examples=share, seed=self.seed + i))
                 for i, k in enumerate(m.train_kv_pairs)]
        self.train_set = ConcatDataset(parts)
        self.val_sets = [
            MQARDataset(MQARConfig(vocab_size=m.vocab_size, seq_len=seq, num_kv_pairs=k,
                                   power_a=m.power_a, num_examples=m.val_examples,
                                   seed=10_000 + self.seed + i))
            for i, k in enumerate(m.val_kv_pairs)
        ]

    @property
    def val_slices(self) -> list[str]:
        return [f"kv{k}" for k in self.data.mqar.val_kv_pairs]

    def check_vocab(self, vocab_size: int) -> None:
        if vocab_size < self.data.mqar.vocab_size:
            raise ConfigError(f"model.vocab_size={vocab_size} < data.mqar.vocab_size="
                              f"{self.data.mqar.vocab_size}")


def unigram_loss(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of the validation tokens under the training unigram
    distribution (add-one smoothed): the loss a model that ignores context would reach."""
    counts = np.bincount(np.asarray(train), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(val)].mean())


def build_datamodule(data: DataConfig, seed: int, max_steps: int,
                     indexed: bool = False) -> _StepDataModule:
    """The data module of `data.kind`; `indexed`: training items are (input_ids, labels,
    window index), as distillation's teacher cache needs (text only)."""
    if data.kind == "mqar":
        if indexed:
            raise ConfigError("distillation needs text data (data.kind corpus, hf or recovery)")
        return MQARDataModule(data, seed, max_steps)
    return TextDataModule(data, seed, max_steps, indexed)
