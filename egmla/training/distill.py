"""Recovery by distillation: a student (a converted model) learns a teacher's next-token
distribution (docs/upcycling.md).

    loss = KL(p_teacher || q_student) per token  [+ ce_weight * cross-entropy on the data]

With `top_k` = K > 0 the teacher's distribution is kept as its K most likely tokens plus one
bucket for the rest of the vocabulary (mass 1 - sum of the K), and the student's is coarsened
the same way, so the loss is the exact KL of those two (K + 1)-outcome distributions: never
more than the full KL (coarsening cannot increase a divergence), equal to it at K = vocab. The
teacher's top-K log-probabilities depend only on the token sequence, so they are computed once
per training window, in float32, and kept on disk (TeacherTopK): every arm that trains on the
same windows, and every resumed run, reads them instead of running the teacher again.

Before the KL stage, `transfer_steps` steps of layer-wise attention transfer (LoLCATs, arXiv
2410.10254): each student attention layer is fit, in parallel, to the teacher's attention
output on the teacher's own inputs to that layer (normalized MSE), a cheap way to put each
converted layer back near its original before the end-to-end stage.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from egmla.models import Transformer
from egmla.paths import cache_dir
from egmla.training.config import DistillConfig
from egmla.training.module import IGNORE_INDEX, LanguageModel


def topk_kl(student_logits: torch.Tensor, teacher_logp: torch.Tensor,
            teacher_idx: torch.Tensor) -> torch.Tensor:
    """Per-token KL between the teacher's top-K + rest distribution and the student's coarsened
    the same way. student_logits (..., V); teacher_logp, teacher_idx (..., K) -> (...)."""
    logits = student_logits.float()
    log_z = logits.logsumexp(-1)  # (...)
    log_q = logits.gather(-1, teacher_idx) - log_z[..., None]  # (..., K)
    p = teacher_logp.float().exp()
    kl = (p * (teacher_logp.float() - log_q)).sum(-1)
    if teacher_idx.shape[-1] == logits.shape[-1]:
        return kl  # no rest bucket (1 - sum p is rounding, not mass)
    log_q_rest = logits.scatter(-1, teacher_idx, float("-inf")).logsumexp(-1) - log_z
    p_rest = (1.0 - p.sum(-1)).clamp_min(0.0)
    rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-30).log() - log_q_rest),
                       torch.zeros_like(p_rest))
    return kl + rest


def full_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Per-token KL(teacher || student) over the whole vocabulary: (..., V) -> (...)."""
    log_p = teacher_logits.float().log_softmax(-1)
    log_q = student_logits.float().log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


class TeacherTopK:
    """The teacher's top-K log-probabilities and token ids for each training window, on disk.

    Three memory-mapped arrays under `directory`: logp (N, T, K) float32, ids (N, T, K) int32,
    done (N,) uint8. A window is computed the first time a batch needs it; its row is flushed
    before it is marked done, so a crash never leaves a half-written row marked as done.
    """

    def __init__(self, directory: Path, windows: int, seq_len: int, k: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        shape = (windows, seq_len, k)
        self.logp = _memmap(directory / "logp.npy", np.float32, shape)
        self.ids = _memmap(directory / "ids.npy", np.int32, shape)
        self.done = _memmap(directory / "done.npy", np.uint8, (windows,))
        self.k = k

    def lookup(self, index: torch.Tensor, input_ids: torch.Tensor, teacher: Transformer
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp, ids) (B, T, K) of the windows `index` (B,), computing the missing ones."""
        rows = index.cpu().numpy()
        missing = [i for i, r in enumerate(rows) if not self.done[r]]
        if missing:
            logp, ids = teacher_topk(teacher, input_ids[missing], self.k)
            for j, i in enumerate(missing):
                self.logp[rows[i]] = logp[j].cpu().numpy()
                self.ids[rows[i]] = ids[j].cpu().numpy()
            self.logp.flush()
            self.ids.flush()
            self.done[rows[missing]] = 1
            self.done.flush()
        device = input_ids.device
        return (torch.from_numpy(np.asarray(self.logp[rows])).to(device),
                torch.from_numpy(np.asarray(self.ids[rows]).astype(np.int64)).to(device))

    def coverage(self) -> float:
        return float(np.asarray(self.done).mean())


def _memmap(path: Path, dtype, shape: tuple[int, ...]) -> np.ndarray:
    if path.is_file():
        array = np.load(path, mmap_mode="r+")
        if array.shape == shape and array.dtype == dtype:
            return array
        path.unlink()  # another shape: a cache key collision cannot happen, so a stale file
    return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)


@torch.no_grad()
def teacher_topk(teacher: Transformer, input_ids: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k next-token log-probabilities, in float32: (B, T, k) each."""
    with torch.autocast(input_ids.device.type, enabled=False):
        logp = teacher(input_ids).float().log_softmax(-1)
    values, ids = logp.topk(k, dim=-1)
    return values, ids


def weights_fingerprint(model: nn.Module) -> str:
    """sha256 over a model's parameters' bytes and names (the teacher's identity)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class DistillationModel(LanguageModel):
    """LanguageModel whose training loss is distillation from `distill["teacher"]` (see the
    module docstring); validation stays the plain next-token loss on held-out data."""

    def __init__(self, model: dict[str, Any], optim: dict[str, Any], max_steps: int,
                 distill: dict[str, Any], compile: bool = False,
                 val_slices: list[str] | None = None) -> None:
        super().__init__(model, optim, max_steps, compile, val_slices)
        self.distill = DistillConfig(**distill)
        self._teacher: list[Transformer] = []  # a list: not a submodule, never in a checkpoint
        self._topk: TeacherTopK | None = None
        if self.distill.train == "attention":
            for name, p in self.model.named_parameters():
                p.requires_grad_(".attn." in name)

    def attach_teacher(self, teacher: Transformer, topk: TeacherTopK | None) -> None:
        """The frozen teacher (and its top-K cache), given by the run before fitting."""
        teacher.eval().requires_grad_(False)
        self._teacher = [teacher]
        self._topk = topk

    @property
    def teacher(self) -> Transformer:
        if not self._teacher:
            raise RuntimeError("no teacher attached: DistillationModel.attach_teacher first")
        return self._teacher[0]

    def on_fit_start(self) -> None:
        self.teacher.to(self.device)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        input_ids, labels, index = batch
        if self.global_step < self.distill.transfer_steps:
            loss = self.transfer_loss(input_ids)
            self.log("train/transfer_loss", loss, prog_bar=True)
            return loss
        logits = self.model(input_ids)  # (B, T, V)
        if self.distill.top_k:
            if self._topk is not None:
                logp, ids = self._topk.lookup(index, input_ids, self.teacher)
            else:
                logp, ids = teacher_topk(self.teacher, input_ids, self.distill.top_k)
            kl = topk_kl(logits, logp, ids)
        else:
            with torch.no_grad(), torch.autocast(input_ids.device.type, enabled=False):
                teacher_logits = self.teacher(input_ids)
            kl = full_kl(logits, teacher_logits)
        kl = kl.mean()
        loss = kl
        self.log("train/kl", kl, prog_bar=True)
        if self.distill.ce_weight:
            ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                 ignore_index=IGNORE_INDEX)
            loss = loss + self.distill.ce_weight * ce
            self.log("train/loss", ce)
        return loss

    def transfer_loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Mean over layers of || attn_s(x_t) - attn_t(x_t) ||^2 / || attn_t(x_t) ||^2, x_t the
        teacher's input to that layer's attention."""
        captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        hooks = [block.attn.register_forward_hook(
            lambda _m, args, out, i=i: captured.__setitem__(i, (args[0], out)))
            for i, block in enumerate(self.teacher.layers)]
        try:
            with torch.no_grad():
                self.teacher(input_ids)
        finally:
            for hook in hooks:
                hook.remove()
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        losses = []
        for i, block in enumerate(self.model.layers):
            x, target = captured[i]
            out = block.attn(x, positions, None, input_ids)
            losses.append((out.float() - target.float()).square().mean()
                          / target.float().square().mean().clamp_min(1e-12))
        return torch.stack(losses).mean()

    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        super().validation_step(batch[:2], batch_idx, dataloader_idx)


def teacher_cache(teacher: Transformer, tokens: np.ndarray, windows: int, seq_len: int, k: int
                  ) -> TeacherTopK:
    """The TeacherTopK for `teacher` on the windows of `tokens`, under egmla's cache
    directory, keyed by the teacher's weights, the tokens, the window length and k."""
    key = json.dumps({"teacher": weights_fingerprint(teacher),
                      "tokens": hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest(),
                      "seq_len": seq_len, "k": k}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return TeacherTopK(cache_dir() / "teacher_topk" / digest, windows, seq_len, k)
