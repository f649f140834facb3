"""Attention variants behind one interface (`AttentionLayer`): `forward(x, positions,
cache=None, token_ids=None)`, `cache_spec()`, and how their layers are built, initialized and
counted.

One registry: the config classes by type name (egmla.config.ATTENTION_REGISTRY, filled as they
are defined). A variant's module names its config class (`config_class`), and the model finds
the module from the config (`attention_module`). Adding a variant: its config class (a subclass
of egmla.config.AttentionConfig with its `type`), its module (a subclass of AttentionLayer with
`config_class`, in a file of this package, which imports every one of its modules), and tests.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator, Mapping

from egmla.config import ATTENTION_REGISTRY, AttentionConfig, ModelConfig
from egmla.models.attention.common import AttentionLayer
from egmla.models.attention.controls import EGMLAConstGate, EGMLAHiddenGate, MLAValueEmbed
from egmla.models.attention.egmla import EGMLA, EGMLALatent
from egmla.models.attention.mha import MHA
from egmla.models.attention.mla import MLA

for _module in pkgutil.iter_modules(__path__):  # a variant's module needs no line here
    importlib.import_module(f"{__name__}.{_module.name}")
del _module


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def attention_module(config: AttentionConfig | type[AttentionConfig]) -> type[AttentionLayer]:
    """The module class that computes an attention config (or config class): the AttentionLayer
    subclass whose own `config_class` it is."""
    kind = config if isinstance(config, type) else type(config)
    found = {sub for sub in _subclasses(AttentionLayer) if sub.__dict__.get("config_class") is kind}
    if len(found) != 1:
        raise LookupError(
            f"attention type {kind.type!r} ({kind.__qualname__}) needs exactly one module, an "
            f"AttentionLayer subclass with config_class = {kind.__qualname__}; found "
            f"{sorted(c.__qualname__ for c in found) or 'none'}")
    return found.pop()


class _Modules(Mapping[str, type[AttentionLayer]]):
    """Type name -> module class, derived from the config registry (never a list of its own)."""

    def __getitem__(self, name: str) -> type[AttentionLayer]:
        return attention_module(ATTENTION_REGISTRY[name])

    def __iter__(self) -> Iterator[str]:
        return iter(ATTENTION_REGISTRY)

    def __len__(self) -> int:
        return len(ATTENTION_REGISTRY)


ATTENTION_MODULES: Mapping[str, type[AttentionLayer]] = _Modules()


def build_attention(config: ModelConfig) -> list[AttentionLayer]:
    """The model's attention layers, built by the module of `config.attention`."""
    return attention_module(config.attention).build_layers(config)


__all__ = ["ATTENTION_MODULES", "EGMLA", "MHA", "MLA", "AttentionLayer", "EGMLAConstGate",
           "EGMLAHiddenGate", "EGMLALatent", "MLAValueEmbed", "attention_module",
           "build_attention"]
