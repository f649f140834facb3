"""Compose configs/ exactly as train.py does, without running anything (tests, benchmarks,
notebooks): `compose_config(["experiment=quickstart", "model/attention=small_mla"])`; and
`check_plain_overrides`, train.py's answer to a misspelled key given without Hydra's `+`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# Hydra's flags that choose another primary config: the check below composes train.yaml only.
OTHER_CONFIG_FLAGS = ("-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir")


def compose_config(overrides: list[str], config_dir: Path = CONFIGS) -> dict[str, Any]:
    """The plain dict `train.py` hands to `egmla.training.run.train` for these overrides."""
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def check_plain_overrides(argv: list[str]) -> None:
    """Raise the typed config's ValueError ("optim: unknown key 'lrr'; allowed keys: ...") for
    a plain override of a key the config does not have (`optim.lrr=1e-3`).

    Hydra refuses such an override while composing, before train.py runs, with a hint to add
    the key with `+`; train.py's config would then refuse the key anyway. So the command line
    is composed here first (a sweep's first value of each swept key; hydra's own keys left
    out): where Hydra finds a key missing, the override is tried again with `+`, and the typed
    config's complaint about the composed result is raised. Anything else (no override, a
    composition that succeeds or fails in another way, a key the typed config accepts) is left
    to Hydra, which says it as before."""
    from hydra.errors import ConfigCompositionException
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    from egmla.training.config import TrainConfig

    arguments = [a for a in argv if "=" in a and not a.startswith("-")]
    if any(a.split("=", 1)[0] in OTHER_CONFIG_FLAGS for a in argv) or not arguments:
        return
    try:
        parsed = OverridesParser.create().parse_overrides(arguments)
        overrides = [o for o in parsed if not o.key_or_group.startswith("hydra")]
        first = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}"
                 if o.is_sweep_override() else o.input_line for o in overrides]
    except Exception:  # noqa: BLE001 - a syntax Hydra itself will report, or a sweep without values
        return
    for _ in range(len(first)):
        try:
            raw = compose_config(first)
        except ConfigCompositionException as error:
            cause = error.__cause__
            if not isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
                return
            key = str(getattr(cause, "full_key", ""))
            index = next((i for i, o in enumerate(overrides) if not first[i].startswith(("+", "~"))
                          and (o.key_or_group == key or o.key_or_group.startswith(key + "."))),
                         None)
            if not key or index is None:
                return
            first[index] = "+" + first[index]  # added: the typed config judges the key
            continue
        except Exception:  # noqa: BLE001 - whatever else Hydra refuses, it says itself
            return
        TrainConfig.from_dict(raw)  # raises ValueError naming the key and the allowed keys
        return
