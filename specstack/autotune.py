"""Choosing γ per level from this machine's measured forward costs and the stack's measured acceptance.

TriForce (Sun et al., 2024, Section 4.3) picks γ1 and γ2 by maximising the expected speedup of the
hierarchy; Sequoia (Chen et al., 2024) does the same for tree sizes against a hardware cost model.
:func:`tune` does it for chains of any depth:

1. a short calibration generation with the stack's current γ measures each verifying level's
   per-token acceptance α_i (``LevelStats.token_acceptance_rate``) and the drafter's cost per token;
2. each verifying level's forward is timed at T = 1 … γ_max + 1 tokens over a cache as long as the
   one it will hold (random keys and values: the cost does not depend on them);
3. every γ combination is scored with :class:`specstack.speedup.StackCost` (the one place the
   predicted speedup is computed) and the best one is set on the stack's levels.

Acceptance is assumed independent of γ (the i.i.d. model behind Leviathan et al.'s Eq. 1). Token
trees keep their planned shape: a level verifying a tree keeps its γ (the tree's depth), and only the
levels verifying chains are tuned.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import attrs
import torch

from .drafters import ModelLevel
from .errors import SpecstackError
from .speedup import LevelCost, StackCost
from .stack import SpeculationStack, SpeculativeLevel
from .types import DraftKind

MODEL_FREE_DRAFT_COST = 1e-6  # seconds per drafted token of a drafter without a model (n-gram lookup)


@attrs.frozen(kw_only=True)
class Tuning:
    """The chosen γ per verifying level (bottom first) and what the choice was made from."""

    gammas: tuple[int, ...]
    before: tuple[int, ...]  # the γ the calibration ran with
    acceptances: tuple[float, ...]  # α_i measured in the calibration run
    draft_cost: float  # t_0, seconds per drafted token of level 0
    verify_costs: tuple[dict[int, float], ...]  # per verifying level: T -> seconds of a T-token forward
    predicted_speedup: float
    calibration_tokens: int

    def describe(self) -> str:
        gammas = ", ".join(f"γ{i + 1}={g}" for i, g in enumerate(self.gammas))
        accept = ", ".join(f"{a:.2f}" for a in self.acceptances)
        return f"gamma=auto chose {gammas} (acceptance {accept} over {self.calibration_tokens} calibration tokens; predicted {self.predicted_speedup:.2f}x)"

    def as_dict(self) -> dict:
        return {"gammas": list(self.gammas), "before": list(self.before), "acceptances": list(self.acceptances),
                "predicted_speedup": self.predicted_speedup, "calibration_tokens": self.calibration_tokens}


def auto_options(options: Sequence[str]) -> tuple[list[str], bool]:
    """Split ``-o`` options into the others and whether any γ option (``gamma``, ``gamma1``, …) asked for ``auto``."""
    auto = [o for o in options if o.partition("=")[0].replace("-", "_").startswith("gamma") and o.partition("=")[2] == "auto"]
    return [o for o in options if o not in auto], bool(auto)


def verifying_levels(stack: SpeculationStack) -> list[SpeculativeLevel]:
    """The stack's verifying levels, bottom first."""
    levels, drafter = [], stack.top
    while isinstance(drafter, SpeculativeLevel):
        levels.append(drafter)
        drafter = drafter.drafter
    return levels[::-1]


def best_gammas(draft_cost: float, verify_costs: Sequence[dict[int, float]], acceptances: Sequence[float],
                autoregressive_cost: float, max_gamma: int, fixed: Sequence[int | None] = ()) -> tuple[tuple[int, ...], float]:
    """The γ per level (each 1 … ``max_gamma``, or ``fixed[i]`` where that is given) that maximises the
    predicted speedup, and that speedup."""
    fixed = tuple(fixed) or (None,) * len(verify_costs)
    choices = [range(1, max_gamma + 1) if g is None else (g,) for g in fixed]
    best: tuple[tuple[int, ...], float] | None = None
    for gammas in itertools.product(*choices):
        levels = [LevelCost(acceptance=a, gamma=g, verify_cost=costs[g + 1]) for a, g, costs in zip(acceptances, gammas, verify_costs)]
        speedup = StackCost(draft_cost=draft_cost, levels=levels, autoregressive_cost=autoregressive_cost).speedup
        if best is None or speedup > best[1] + 1e-12:
            best = (gammas, speedup)
    return best


def tune(stack: SpeculationStack, prompt: Sequence[int], *, calibration_tokens: int = 32, max_gamma: int = 8,
         repeats: int = 3, seed: int = 0, prefill_progress=None, reuse_cache: bool = False) -> Tuning:
    """Calibrate on ``prompt``, then set the best γ on every verifying level of ``stack`` (see the module
    docstring); ``prefill_progress(done, total)`` follows the calibration run's prefill, which keeps
    what the caches hold of ``prompt`` with ``reuse_cache`` (see ``SpeculationStack.generate``)."""
    levels = verifying_levels(stack)
    if not levels:
        raise SpecstackError("gamma=auto needs a stack with at least one verifying level; 'autoregressive' has none")
    before = tuple(level.gamma for level in levels)
    calibration = stack.generate(prompt, calibration_tokens, seed=seed, prefill_progress=prefill_progress, reuse_cache=reuse_cache)
    stats = calibration.levels  # bottom first: level 0, then one per verifying level
    acceptances = tuple(s.token_acceptance_rate for s in stats[1:])
    draft_cost = _draft_cost(levels[0].drafter, stats[0])
    fixed = tuple(level.gamma if level.drafter.draft_kind is not DraftKind.CHAIN else None for level in levels)  # a tree's depth stays
    most = max([max_gamma, *(g for g in fixed if g is not None)]) + 1
    costs = tuple(_verify_costs(level, len(prompt), most, repeats, seed) for level in levels)
    gammas, speedup = best_gammas(draft_cost, costs, acceptances, costs[-1][1], max_gamma, fixed)
    for level, gamma in zip(levels, gammas):
        level.gamma = gamma
    return Tuning(gammas=gammas, before=before, acceptances=acceptances, draft_cost=draft_cost, verify_costs=costs,
                  predicted_speedup=speedup, calibration_tokens=len(calibration.tokens))


def _draft_cost(drafter, stats) -> float:
    """Seconds per drafted token of level 0: its mean forward time, or a token's worth of bookkeeping
    for a drafter without a model."""
    if isinstance(drafter, ModelLevel) and stats.forward_calls:
        return stats.forward_seconds / stats.forward_calls
    return MODEL_FREE_DRAFT_COST


def _verify_costs(level: SpeculativeLevel, context: int, most: int, repeats: int, seed: int) -> dict[int, float]:
    """T -> seconds of the level's forward of T chain tokens over a cache as long as it holds in decoding."""
    from .bench.floor import fill, time_forward

    lm = level.lm
    cached = max(1, min(context, lm.capacity - most))
    store = lm.model.new_cache(cached + most, relative_positions=lm.policy.relative_positions)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    fill(store, cached, generator)
    return {t: time_forward(lm.model, store, cached=cached, tokens=t, tree=False, repeats=repeats, generator=generator)
            for t in range(1, most + 1)}
