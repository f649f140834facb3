"""The plan: which runs a phase needs given the runs recorded so far. The learning-rate grid
grows from its own results (a best rate at an edge adds the next doubling), and the phases
after `lr` run at the rates it chooses."""

from __future__ import annotations

import math
from typing import Any

from studies.gating.arms import arm_overrides
from studies.gating.protocol import (ABLATIONS, ARM, BASE, BASE_STEPS, LATER_ARMS, LONG_ARMS,
                                     LONG_FACTOR, MQAR_BASE, MQAR_FAIR_STEPS, MQAR_STEPS, MQAR_VAL_EVERY,
                                     PHASES, VAL_EVERY, Run, Setup, StudyError)


def lr_grid(losses: dict[float, float], setup: Setup = Setup()) -> tuple[list[float], float | None]:
    """The learning rates one arm needs given its losses so far (lr -> final validation loss),
    and the best of them once the grid is settled (every point has run and the best is not at
    an edge that may still grow), else None. A loss that is not finite (a diverged run) counts
    as the worst."""
    grid = sorted(setup.lrs)
    low, high = grid[0] / 2 ** setup.lr_extensions, grid[-1] * 2 ** setup.lr_extensions

    def loss(lr: float) -> float:
        value = losses[lr]
        return value if value is not None and math.isfinite(value) else math.inf

    while all(lr in losses for lr in grid):
        best = min(grid, key=lambda lr: (loss(lr), lr))
        if best == grid[-1] and best * 2 <= high:
            grid.append(best * 2)
        elif best == grid[0] and len(grid) > 1 and best / 2 >= low:
            grid.insert(0, best / 2)
        else:
            return grid, best
    return grid, None


def _lr_losses(records: list[dict[str, Any]], arm: str, phase: str = "lr") -> dict[float, float]:
    """An arm's grid so far: learning rate -> validation loss of its `phase` runs (the lr phase,
    or the MQAR grid, mqar_lr)."""
    return {r["lr"]: selection_loss(r) for r in records if r["phase"] == phase and r["arm"] == arm}


def selection_loss(r: dict[str, Any]) -> float:
    """The loss a run had when its phase used it: for a run trained again for its export (on
    another machine its loss differs, by up to about 0.01 after 300 steps), the loss recorded
    before. So a remake does not reopen a learning rate chosen against runs not remade."""
    return r["remade"]["recorded_val_loss"] if "remade" in r else r["val_loss"]


def plan(phase: str, records: list[dict[str, Any]], setup: Setup = Setup(),
         ready_only: bool = False) -> list[Run]:
    """The runs of `phase` given the runs recorded so far: the LR grid grows from its results,
    and the phases after `lr` need the learning rates it chooses (StudyError names the arms
    still without one; `ready_only`: plan the arms that have theirs and leave the rest, as a
    summary of the record does while an added arm's grid has not run yet)."""
    steps, arms, first = setup.steps(BASE_STEPS), setup.arms, setup.seeds[0]

    def ready(need: list[str], rates: dict[str, float], source: str) -> list[str]:
        missing = [a for a in need if a not in rates]
        if missing and not ready_only:
            raise StudyError(f"phase {phase!r} needs the learning rates the {source} phase "
                             f"chooses; not yet chosen for: {', '.join(missing)}")
        return [a for a in need if a in rates]

    def run(phase, arm, lr, seed, steps, base=tuple(BASE), val_every=VAL_EVERY) -> Run:
        attention = ARM[arm].attention if arm in ARM else ABLATIONS[arm][0]
        return Run(phase, arm, attention, lr, seed, steps, arm_overrides(arm, base), base,
                   setup.extra, val_every)

    if phase == "lr":
        return [run("lr", arm, lr, first, steps) for arm in arms
                for lr in lr_grid(_lr_losses(records, arm), setup)[0]]
    mqar_steps = setup.steps(MQAR_FAIR_STEPS)
    if phase == "mqar_lr":  # each arm's own grid on MQAR, selected by its validation loss
        return [run("mqar_lr", arm, lr, first, mqar_steps, MQAR_BASE, MQAR_VAL_EVERY) for arm in arms
                for lr in lr_grid(_lr_losses(records, arm, "mqar_lr"), setup)[0]]
    if phase == "mqar_seeds":
        on_mqar = choose_lrs(records, setup, "mqar_lr")
        return [run("mqar_seeds", arm, on_mqar[arm], seed, mqar_steps, MQAR_BASE,
                    MQAR_VAL_EVERY)
                for seed in setup.seeds[1:] for arm in ready(list(arms), on_mqar, "mqar_lr")]
    chosen = choose_lrs(records, setup)
    if phase in ("seeds", "long"):
        at_rate = ready([a for a in arms if phase == "seeds" or a in LONG_ARMS], chosen, "lr")
    elif not ready(["egmla_kv"], chosen, "lr"):  # the phases at egmla_kv's rate
        return []
    if phase == "seeds":
        return [run("seeds", arm, chosen[arm], seed, steps)
                for seed in setup.seeds[1:] for arm in at_rate]
    if phase == "long":
        return [run("long", arm, chosen[arm], first, steps * LONG_FACTOR)
                for arm in LONG_ARMS if arm in at_rate]
    if phase == "ablations":
        return [run("ablations", name, chosen["egmla_kv"], seed, steps)
                for seed in setup.seeds for name in ABLATIONS]
    if phase == "mqar":
        return [run("mqar", arm, chosen["egmla_kv"], seed, setup.steps(MQAR_STEPS), MQAR_BASE)
                for seed in setup.seeds for arm in arms if arm not in LATER_ARMS]
    raise StudyError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")


def choose_lrs(records: list[dict[str, Any]], setup: Setup = Setup(),
               phase: str = "lr") -> dict[str, float]:
    """Each arm's best learning rate on the first seed, once its grid (of `phase`: lr, or
    mqar_lr for MQAR) is settled."""
    best = {arm: lr_grid(_lr_losses(records, arm, phase), setup)[1] for arm in ARM}
    return {arm: lr for arm, lr in best.items() if lr is not None}


def eval_runs(records: list[dict[str, Any]], setup: Setup) -> list[Run]:
    """The runs lm-eval scores: every arm's seeds at its chosen learning rate."""
    chosen = choose_lrs(records, setup)
    if any(arm not in chosen for arm in setup.arms):
        return []
    at_lr = [r for r in plan("lr", records, setup) if r.lr == chosen[r.arm]]
    return at_lr + plan("seeds", records, setup)
