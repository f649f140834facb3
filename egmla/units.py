"""Sizes written the way people write them (standard library only): a command line's
`--kv-cache-memory 512MiB` or `--hot-budget 2GiB`, read as bytes.

    parse_bytes("512MiB") == 536870912;  parse_bytes("1.5G") == 1610612736
    parse_bytes("2GB") == 2000000000;    parse_bytes("100000") == 100000

Binary units (k, m, g, KiB, MiB, GiB) are powers of 1024; decimal ones (kB, MB, GB) powers
of 1000; a bare number is bytes. A bad size raises argparse.ArgumentTypeError, so the function
is an argparse `type=` as it stands.
"""

from __future__ import annotations

import argparse
import re

UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
         "g": 2**30, "gb": 10**9, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1.5G', '100000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 512MiB, 2GiB or 1000000")
    value = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return value
