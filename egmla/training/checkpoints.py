"""Training checkpoints that are written whole and say when their bytes changed.

`ChecksummedCheckpointIO` writes what Lightning hands it with torch.save into a temporary file
beside the target, hashing the bytes as they are written (SHA-256, no second pass over the file),
fsyncs it and renames it into place, so a crash mid-save leaves the previous checkpoint (and a
temporary file, which the next save removes). The digest goes into a sidecar `<name>.sha256` in
sha256sum's format (`sha256sum -c last.ckpt.sha256` checks it by hand). While a checkpoint is
replaced, its sidecar lists the old and the new digest, so a crash between the renames leaves a
pair that still verifies:

    1. .last.ckpt.<id>.tmp   written and fsynced; its digest N computed while writing
    2. last.ckpt.sha256      N and O, the digest of the last.ckpt still in place  (atomic)
    3. last.ckpt             <- .last.ckpt.<id>.tmp                                (rename)
    4. last.ckpt.sha256      N                                                      (atomic)

`verify_checkpoint` is what a resume runs before it writes anything: the file's digest (read in
8 MiB chunks) must be listed in its sidecar, and the file must load (memory-mapped, tensor data
left unread) as a Lightning training checkpoint. A checkpoint without a sidecar was saved before
checksums were recorded: it loads unverified (run.py prints a one-line note), and its run's next
save writes one.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from egmla import files
from egmla.checkpoint import SIDECAR_SUFFIX, file_sha256, recorded_digests, sidecar
from egmla.training.rundir import RunError, write_atomic

# What Lightning's fit needs to resume (a weights-only save has no optimizer_states).
TRAINING_KEYS = ("state_dict", "optimizer_states", "loops", "global_step")


class _HashingWriter:
    """A file that hashes what is written to it: torch.save writes its zip archive front to
    back through `write`, so the digest is the file's without reading it again."""

    def __init__(self, f) -> None:
        self.f, self.hash = f, hashlib.sha256()

    def write(self, data) -> int:
        self.hash.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _write_sidecar(path: Path, digests: list[str]) -> None:
    write_atomic(sidecar(path), "".join(f"{d}  {path.name}\n" for d in digests))


def save_checkpoint(checkpoint: dict[str, Any], path: Path) -> str:
    """torch.save `checkpoint` to `path` atomically, with its sidecar; return the digest.

    The sidecar names the new digest beside the old ones before the rename and only the new one
    after it, so a crash at any point leaves a checkpoint that its sidecar vouches for."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for pattern in (f".{path.name}.tmp-*", f".{path.name}.*.tmp"):  # left by a killed save
        for stale in path.parent.glob(pattern):  # (the second: names before egmla.files)
            stale.unlink(missing_ok=True)
    with files.atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(checkpoint, writer)
            f.flush()
            os.fsync(f.fileno())
        digest = writer.hash.hexdigest()
        old = recorded_digests(path) if path.exists() else None
        _write_sidecar(path, [digest, *sorted((old or set()) - {digest})])
    _write_sidecar(path, [digest])
    files.fsync_path(path.parent)
    return digest


class ChecksummedCheckpointIO(TorchCheckpointIO):
    """Lightning's CheckpointIO with atomic saves and a SHA-256 sidecar per checkpoint."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("ChecksummedCheckpointIO.save_checkpoint takes no storage_options")
        save_checkpoint(checkpoint, Path(path))

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        sidecar(Path(path)).unlink(missing_ok=True)


def damaged(path: Path, problem: str) -> RunError:
    """The error for a last.ckpt a run cannot resume from: what is wrong, and what to do."""
    return RunError(
        f"{path}: {problem}; the run cannot resume from it. Put back a good copy with its "
        f"{SIDECAR_SUFFIX} (a best-step*.ckpt of this run and its {SIDECAR_SUFFIX} will do), "
        f"or move {path.name} and {sidecar(path).name} out of {path.parent.name}/ to start the "
        "run over from step 0")


def _first_sentence(err: Exception) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text.split(". ")[0].rstrip(".")


def verify_checkpoint(path: Path) -> tuple[dict[str, Any], bool]:
    """Check that `path` is the training checkpoint that was saved there; return it (tensors
    memory-mapped, their data unread) and whether its bytes were checked against a digest.
    Raise RunError (see `damaged`) if it is empty, truncated, not a training checkpoint, or its
    digest is not the one its sidecar recorded."""
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            raise damaged(path, "is empty")
        if not zipfile.is_zipfile(path):  # torch.save's archive ends with its directory
            raise damaged(path, "is truncated or not a checkpoint (no zip directory at its end)")
        digests = recorded_digests(path)
        if digests is not None and file_sha256(path) not in digests:
            raise damaged(path, f"its bytes changed after it was saved (their SHA-256 is not "
                                f"the one {sidecar(path).name} recorded)")
    except OSError as err:
        raise damaged(path, f"cannot be read ({err.strerror})") from err
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any reason torch gives is a damaged file here
        raise damaged(path, f"cannot be loaded ({type(err).__name__}: "
                            f"{_first_sentence(err)})") from err
    missing = [k for k in TRAINING_KEYS if not isinstance(checkpoint, dict) or k not in checkpoint]
    if missing:
        raise damaged(path, f"is not a training checkpoint (no {missing[0]!r})")
    return checkpoint, digests is not None


def check_weights_match(path: Path, checkpoint: dict[str, Any], module: torch.nn.Module) -> None:
    """Raise RunError unless the checkpoint holds weights of the module's names and shapes."""
    found = {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items()}
    wanted = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    for key in sorted(found.keys() | wanted.keys()):
        if found.get(key) != wanted.get(key):
            there = "absent" if key not in found else f"shape {found[key]}"
            here = "absent" if key not in wanted else f"shape {wanted[key]}"
            raise damaged(path, f"holds weights of another model ({key}: {there} there, "
                                f"{here} in this run's model)")
