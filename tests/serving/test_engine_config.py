"""The engine's settings: `python -m serve`'s engine flags are derived from `EngineConfig`."""

from __future__ import annotations

import dataclasses

import pytest

from serve.__main__ import build_parser, engine_args
from serve.config import EngineConfig


def test_every_engine_setting_is_a_flag_with_the_fields_default():
    """One flag per field, its default the field's (or the command line's word for None), so a
    default changed in EngineConfig is the server's default too."""
    parsed = engine_args(build_parser().parse_args(["--model", "m"]))
    for f in dataclasses.fields(EngineConfig):
        word = f.metadata.get("none") if f.default is None else None
        assert parsed[f.name] == (word if word is not None else f.default), f.name
    flags = {o for a in build_parser()._actions for o in a.option_strings}
    assert {"--block-size", "--kv-cache-memory", "--num-blocks", "--max-num-seqs",
            "--max-num-batched-tokens", "--no-prefix-caching", "--no-chunked-prefill",
            "--kv-cache-dtype", "--max-model-len", "--seed", "--attention-backend",
            "--enforce-eager", "--no-enforce-eager", "--gpu-memory-utilization"} <= flags


def test_the_flags_parse_into_engine_arguments():
    args = build_parser().parse_args([
        "--model", "m", "--block-size", "32", "--kv-cache-memory", "1GiB", "--no-prefix-caching",
        "--no-chunked-prefill", "--kv-cache-dtype", "bfloat16", "--seed", "-3",
        "--gpu-memory-utilization", "0.5", "--no-enforce-eager"])
    got = engine_args(args)
    assert got["block_size"] == 32 and got["kv_cache_memory"] == 2**30
    assert got["enable_prefix_caching"] is False and got["enable_chunked_prefill"] is False
    assert got["cache_dtype"] == "bfloat16" and got["seed"] == -3
    assert got["gpu_memory_utilization"] == 0.5 and got["enforce_eager"] is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--block-size", "0"])


def test_an_unknown_engine_argument_is_named():
    with pytest.raises(ValueError, match="unknown engine argument.s. block_sise"):
        EngineConfig.from_args(block_sise=8)
