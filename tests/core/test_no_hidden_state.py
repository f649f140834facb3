"""The model keeps no hidden state (issue 40): a forward writes no module global anywhere in
egmla/models/, and importing egmla installs no process-wide torch hook. Per-forward values
(RoPE angles, masks) travel as arguments (egmla.models.positions.Positions)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import egmla.models
from egmla.presets import preset
from support.models import VARIANTS, build, random_ids

ROOT = Path(__file__).resolve().parents[2]


def model_modules() -> list:
    """Every module of egmla.models, imported."""
    found = [egmla.models]
    for info in pkgutil.walk_packages(egmla.models.__path__, "egmla.models."):
        found.append(importlib.import_module(info.name))
    return found


def snapshot(value: object) -> object:
    """What can change in a module-level value without rebinding it: a container's items, a
    memoized function's cache, a class's attributes (compared by identity)."""
    if isinstance(value, (dict, list, set)):
        items = value.items() if isinstance(value, dict) else enumerate(value) \
            if isinstance(value, list) else ((id(v), v) for v in value)
        return type(value), {k: id(v) for k, v in items}
    if hasattr(value, "cache_info"):  # functools.cache / lru_cache
        return value.cache_info()
    if isinstance(value, type):
        return {k: id(v) for k, v in vars(value).items()}
    return None


def module_state(modules: list) -> dict[str, object]:
    return {f"{m.__name__}.{name}": (id(value), snapshot(value))
            for m in modules for name, value in vars(m).items()}


def forwards(name: str) -> None:
    """The ways a model runs: training forward, and prefill + decode through a cache."""
    cfg = VARIANTS[name]
    model, ids = build(cfg), random_ids(cfg, 2, 8)
    model(ids).sum().backward()
    with torch.no_grad():
        cache = model.new_cache(batch_size=2, max_len=8)
        model(ids[:, :6], cache=cache)
        model(ids[:, 6:7], cache=cache)
    with torch.inference_mode():
        model.eval()(ids)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_forward_writes_no_module_global_in_egmla_models(name):
    modules = model_modules()
    forwards(name)  # first use: whatever is made lazily on a first call shows here too
    before = module_state(modules)
    forwards(name)
    after = module_state(modules)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"module globals written during a forward: {changed}"


def test_the_checker_sees_a_module_global_written():
    from egmla.models.attention import common

    before = module_state([common])
    common._written_by_a_test = 1
    try:
        assert module_state([common]) != before
    finally:
        del common._written_by_a_test


def test_importing_egmla_installs_no_torch_hook():
    """torch's process-wide module hooks (registration, forward, backward) stay empty after
    importing the library and every model module, in a fresh interpreter."""
    code = """
import importlib, pkgutil
import torch.nn.modules.module as m
import egmla, egmla.cache, egmla.kernels, egmla.models, egmla.generate, egmla.checkpoint
for info in pkgutil.walk_packages(egmla.models.__path__, "egmla.models."):
    importlib.import_module(info.name)
print({n: len(v) for n, v in vars(m).items() if n.startswith("_global_") and isinstance(v, dict)})
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    registries = ast.literal_eval(out)
    assert registries and not any(registries.values()), registries


def test_a_model_keeps_nothing_between_forwards_but_its_kernel_weights():
    """A forward leaves the model's attributes as it found them (the decode kernel's kept
    weights, Block.kernel_weights, are the one cache, and they are explicit)."""
    model = build(preset("tiny-mla"))
    ids = random_ids(preset("tiny-mla"), 1, 5)

    def attributes():
        return {(name, k): id(v) for name, mod in model.named_modules()
                for k, v in vars(mod).items() if not k.startswith("_")}

    with torch.no_grad():
        model(ids)
        before = attributes()
        model(ids)
    assert attributes() == before
