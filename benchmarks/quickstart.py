"""The README's first command on a fresh clone: wall time, validation loss, unigram baseline.

Clones this repository's HEAD into a temporary directory (so uncommitted changes are not
measured), runs exactly the README's command there with an empty EGMLA_CACHE (the BPE is trained
and the corpus tokenized in the run; pip's download cache stays warm), and records the run's
summary. With --keep-run DIR the trained run directory is copied to DIR (for the export round
trip: `benchmarks/export_roundtrip.py --run DIR`), whole or not at all; DIR may be new, empty,
or a copy an earlier run of this benchmark kept (it holds KEPT_BY), which is replaced; any other
existing DIR (a run of your own, say runs/quickstart after the README's command) is refused
when the arguments are read.

    python benchmarks/quickstart.py --keep-run runs/quickstart-kept

Writes benchmarks/results/quickstart.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from egmla.files import atomic_directory, output_prefix, write_json  # noqa: E402
from egmla.provenance import provenance  # noqa: E402

COMMAND = "bash scripts/setup.sh && .venv/bin/python train.py experiment=quickstart"
KEPT_BY = ".kept-by-benchmarks-quickstart.json"  # marks a --keep-run copy this script made


def keep_run_refusal(path: Path) -> str | None:
    """Why --keep-run `path` may not be replaced (None: it may): only a new path, an empty
    directory or a copy this benchmark kept (KEPT_BY inside) is; never a run of your own."""
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_dir() and not path.is_symlink() and (
            not any(path.iterdir()) or (path / KEPT_BY).is_file()):
        return None
    return (f"--keep-run {path}: exists and was not kept by this benchmark; refusing to replace "
            "it (give a new or empty directory)")


def keep(run: Path, target: Path, sha: str) -> None:
    """A copy of `run` at `target`, marked as kept by this benchmark: whole or not at all."""
    with atomic_directory(target, replace_existing=True) as tmp:
        shutil.copytree(run, tmp)
        write_json(tmp / KEPT_BY, {"kept_by": "benchmarks/quickstart.py", "run_git_sha": sha})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=output_prefix, default=ROOT / "benchmarks/results/quickstart.json")
    p.add_argument("--keep-run", type=output_prefix,
                   help="copy the trained runs/quickstart here (a new or empty directory, or one "
                        "this benchmark kept before)")
    args = p.parse_args(argv)
    if args.keep_run and (refusal := keep_run_refusal(args.keep_run)):
        p.error(refusal)
    readme = (ROOT / "README.md").read_text()
    if COMMAND not in readme:
        print(f"error: the README no longer has the command {COMMAND!r}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="egmla-quickstart-") as tmp:
        clone = Path(tmp) / "egmla"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True,
                             text=True, check=True).stdout.strip()
        env = {**os.environ, "EGMLA_CACHE": str(Path(tmp) / "cache"), "WANDB_MODE": "offline"}
        started = time.perf_counter()
        result = subprocess.run(["bash", "-c", COMMAND], cwd=clone, env=env)
        wall = time.perf_counter() - started
        if result.returncode != 0:
            print(f"error: the quickstart exited {result.returncode}", file=sys.stderr)
            return 1
        run = clone / "runs" / "quickstart"
        summary = json.loads((run / "summary.json").read_text())
        info = json.loads((run / "run_info.json").read_text())
        config = json.loads((run / "config.json").read_text())
        kept = None
        if args.keep_run:
            kept = keep_run_refusal(args.keep_run)  # again: it may have been made meanwhile
            if kept is None:
                keep(run, args.keep_run, sha)
    record = {
        "command": COMMAND,
        "where": "fresh git clone, new .venv (pip's download cache warm), empty EGMLA_CACHE "
                 "(BPE trained and corpus tokenized in the run)",
        "wall_seconds_total": round(wall, 1),
        "fit_seconds": summary["fit_seconds"],
        "global_step": summary["global_step"],
        "tokens_trained": summary["global_step"] * config["data"]["seq_len"]
        * config["data"]["batch_size"] * config["trainer"]["accumulate_grad_batches"],
        "val_loss_nats_per_token": summary["val_loss"],
        "unigram_val_loss_nats_per_token": summary.get("unigram_val_loss"),
        "params": info.get("params"),
        "params_without_gate_tables": info.get("params_without_gate_tables"),
        "kv_bytes_per_token_bf16": info.get("kv_bytes_per_token_bf16"),
        "run_git_sha": sha,
        "provenance": provenance(),
    }
    write_json(args.out, record, indent=2)
    print(json.dumps({k: v for k, v in record.items() if k != "provenance"}, indent=2))
    if kept is not None:
        print(f"error: {kept}; the run was not kept", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
