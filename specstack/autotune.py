"""Choosing γ per level from this machine's measured forward costs and the stack's measured acceptance.

TriForce (Sun et al., 2024, Section 4.3) picks γ1 and γ2 by maximising the expected speedup of the
hierarchy; Sequoia (Chen et al., 2024) does the same for tree sizes against a hardware cost model.
:func:`tune` does it for chains of any depth:

1. a short calibration generation with the stack's current γ measures each verifying level's
   per-token acceptance α_i (``LevelStats.token_acceptance_rate``), its rounds' time outside forwards
   (``LevelStats.bookkeeping_seconds``: sampling, verification), a gathering level's re-gathers per emitted
   token (``LevelStats.gather_seconds``) and the drafter's cost per token (a drafting model's forward and its own
   sampling, its ``bookkeeping_seconds`` a drafted token);
2. after it, the target decodes a few tokens autoregressively in place (:func:`_autoregressive_overhead`): the
   time such a step spends outside its forward (sampling) is added to autoregressive decoding's
   cost, as a round's bookkeeping is to the stack's;
3. each verifying level's forward is timed at T = 1 … γ_max + 1 tokens over a cache as long as the
   one it will hold (random keys and values: the cost does not depend on them), and level 0's drafter is
   told the first level's costs (``Drafter.price``): one that then chooses each draft's length itself
   (prompt lookup) gets γ_max as the first level's γ, a cap; one drafting trees (Medusa heads, lookup
   trees) chooses each draft's nodes, its depth capped at γ_max or at the tree's own depth if deeper (a
   lookup tree then drafts as deep as prompt lookup's chains may);
4. every γ combination is scored with :class:`specstack.speedup.StackCost` (the one place the
   predicted speedup is computed) and the best one is set on the stack's levels.

Acceptance is assumed independent of γ (the i.i.d. model behind Leviathan et al.'s Eq. 1). Token
trees keep their planned shape: a level verifying a tree keeps its γ (the tree's depth; where level 0 is
priced and chooses its nodes, that depth's cap, at least γ_max), and only the levels verifying chains are
tuned. A tree level is priced from its calibration rounds instead of the chain formula (:class:`TreeRound`): the tokens a round emitted, and a tree forward as wide as its
forwards were, timed.

Acceptance also changes along a generation (a greedy text that falls into a repeated sentence is
drafted almost perfectly), so a choice made from the first tokens can be wrong for the rest.
:class:`Retuner` re-chooses γ during decoding from the acceptance of the rounds just run, with the
costs measured once by :func:`tune` (``gamma=adaptive``). Each round's γ is fixed from earlier rounds
before its draft is drawn, and verification is exact for any γ, so the output distribution stays the
target's (Leviathan et al., 2023, Theorem 1, round by round).
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping, Sequence

import attrs
import torch

from .drafters import ModelDrafter, ModelLevel
from .errors import SpecstackError
from .speedup import LevelCost, MeasuredLevelCost, StackCost, at_least_one
from .stack import SpeculationStack, SpeculativeLevel
from .types import DraftKind, LevelStats, TokenSequence

MODEL_FREE_DRAFT_COST = 1e-6  # seconds per drafted token of a drafter without a model (n-gram lookup)
AUTOREGRESSIVE_STEPS = 8  # autoregressive steps timed after the calibration, for the time a step spends outside its forward


@attrs.frozen(kw_only=True)
class TreeRound:
    """A level verifying a token tree, as its calibration rounds measured it: the tree's depth (its γ,
    kept), the tokens a round emitted on average, and the tokens its forwards fed on average (the
    tree's nodes and the token before them), the width its forward is timed at."""

    depth: int
    emitted: float
    width: int

    @classmethod
    def measured(cls, stats: LevelStats, depth: int) -> "TreeRound":
        """From a level's calibration counters (``LevelStats``); a level that ran no round is priced as
        a chain of its depth that emits one token a round."""
        if not stats.rounds or not stats.forward_calls:
            return cls(depth=depth, emitted=1.0, width=depth + 1)
        return cls(depth=depth, emitted=stats.emitted / stats.rounds, width=round(stats.forward_tokens / stats.forward_calls))  # every forward feeds a token at least

    def cost(self, verify_costs: dict[int, float], round_overhead: float = 0.0) -> MeasuredLevelCost:
        return MeasuredLevelCost(emitted=self.emitted, drafts=self.depth, verify_cost=verify_costs[self.width], round_overhead=round_overhead)


@attrs.frozen(kw_only=True)
class Tuning:
    """The chosen γ per verifying level (bottom first) and what the choice was made from."""

    gammas: tuple[int, ...]
    before: tuple[int, ...]  # the γ the calibration ran with
    acceptances: tuple[float, ...]  # α_i measured in the calibration run
    draft_cost: float  # t_0, seconds per drafted token of level 0
    verify_costs: tuple[dict[int, float], ...]  # per verifying level: T -> seconds of a T-token forward (a tree's for a tree level)
    predicted_speedup: float
    calibration_tokens: int
    max_gamma: int  # the longest chain γ priced (verify_costs hold forwards up to max_gamma + 1 tokens)
    fixed: tuple[TreeRound | None, ...]  # per verifying level: a tree, kept and priced as measured; None: a chain, tuned
    priced: bool = False  # level 0 was told the first level's costs and chooses each draft's length (Drafter.price)
    overheads: tuple[float, ...] = ()  # per verifying level: seconds a round spends outside forwards (LevelStats.bookkeeping_seconds a round); () none
    gather_cost: float = 0.0  # seconds of re-gathers per emitted token (LevelStats.gather_seconds over the tokens)
    autoregressive_overhead: float = 0.0  # seconds an autoregressive step spends outside its forward (_autoregressive_overhead)

    @property
    def autoregressive_cost(self) -> float:
        """Seconds of an autoregressive step: the target's one-token forward and its step's own work."""
        return self.verify_costs[-1][1] + self.autoregressive_overhead

    def choose(self, acceptances: Sequence[float]) -> tuple[tuple[int, ...], float]:
        """The best γ per level for ``acceptances`` at the measured costs, and its predicted speedup (for drafts
        of the full γ). Where level 0 chooses what to draft itself (a chain's length, a tree's nodes), the first level's γ
        is a cap: max_gamma for a chain's length; for a tree's depth, max_gamma or the tree's own depth if deeper."""
        gammas, speedup = best_gammas(self.draft_cost, self.verify_costs, acceptances, self.autoregressive_cost, self.max_gamma, self.fixed,
                                      self.overheads, self.gather_cost)
        return ((max(self.max_gamma, gammas[0]), *gammas[1:]) if self.priced else gammas), speedup

    def describe(self) -> str:
        """One line: the choice and what it was made from (for a tree level, what its rounds emitted and how wide
        its forwards were); where even the best choice is predicted slower than autoregressive decoding, that no γ is."""
        gammas = ", ".join(f"γ{i + 1}={g}" for i, g in enumerate(self.gammas))
        accept = ", ".join(f"{a:.2f}" for a in self.acceptances)
        trees = "".join(f"; γ{i + 1}{'' if self.priced and i == 0 else ' kept'}: a tree emitting {tree.emitted:.2f} tokens a round, "
                        f"forwards of {tree.width} tokens" for i, tree in enumerate(self.fixed) if tree is not None)
        tree = self.fixed[0] is not None
        priced = ("; level 0 chooses each draft's " + ("nodes, γ1 their depth's cap," if tree else "length, γ1 its cap,") + " from the measured costs") if self.priced else ""
        unpriced = " from the calibration's unpriced rounds" if tree else " had every draft been the formula's best γ1"
        predicted = f"{self.predicted_speedup:.2f}x" + (unpriced if self.priced else "")
        idle = "".join(f"; γ{i + 1}=0: level {i + 1} decodes alone, level {i} idles" for i, g in enumerate(self.gammas) if g == 0)
        bookkeeping = f", a round's bookkeeping {', '.join(f'{1e3 * o:.1f}' for o in self.overheads)} ms" if self.overheads else ""
        bookkeeping += f", re-gathers {1e3 * self.gather_cost:.2f} ms a token" if self.gather_cost else ""
        bookkeeping += f", an autoregressive step's own {1e3 * self.autoregressive_overhead:.2f} ms" if self.autoregressive_overhead else ""
        chosen = f"gamma=auto chose {gammas} (acceptance {accept} over {self.calibration_tokens} calibration tokens{bookkeeping}{trees}{priced}{idle}; predicted {predicted})"
        if self.predicted_speedup >= 1.0 or self.priced:  # a priced drafter drafts only what pays: the formula does not bound it
            return chosen
        return f"{chosen}; no γ up to {self.max_gamma} is predicted to beat autoregressive decoding at this acceptance and these forward costs"

    def apply(self, stack: SpeculationStack) -> None:
        """Set the chosen γ on ``stack``'s verifying levels (a generation after a retuned one starts from the choice again)."""
        _set_gammas(verifying_levels(stack), self.gammas)

    def as_dict(self) -> dict:
        """The choice and every measured term it was priced from, in seconds (``forward_costs``: per verifying level,
        [T, seconds of a T-token forward] pairs), so that a record's prediction can be recomputed."""
        return {"gammas": list(self.gammas), "before": list(self.before), "acceptances": list(self.acceptances),
                "predicted_speedup": self.predicted_speedup, "calibration_tokens": self.calibration_tokens,
                "draft_cost": self.draft_cost, "round_overheads": list(self.overheads), "gather_cost": self.gather_cost,
                "autoregressive_cost": self.autoregressive_cost, "autoregressive_overhead": self.autoregressive_overhead,
                "forward_costs": [sorted(costs.items()) for costs in self.verify_costs]}


TUNINGS = ("auto", "adaptive")  # gamma=auto: tuned once before decoding; gamma=adaptive: then re-tuned during it


def _asked(key: str, value: Any) -> str | None:
    """The tuning a γ option (``gamma``, ``gamma1``, …) asks for, if its value is one of TUNINGS."""
    return value if key.replace("-", "_").startswith("gamma") and value in TUNINGS else None


def _mode(asked: set) -> str | None:
    return next((mode for mode in reversed(TUNINGS) if mode in asked), None)


def auto_options(options: Sequence[str]) -> tuple[list[str], str | None]:
    """Split ``-o`` options into the others and the tuning that γ options (``gamma``, ``gamma1``, …)
    ask for: ``"adaptive"`` if any says so, else ``"auto"`` if any says so, else None."""
    asked = [_asked(*option.split("=", 1)) if "=" in option else None for option in options]
    return [o for o, mode in zip(options, asked) if mode is None], _mode(set(asked) - {None})


def tuning_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """:func:`auto_options` for options already parsed (a bench spec's ``triforce:gamma=auto``)."""
    asked = {key: _asked(key, value) for key, value in options.items()}
    return {k: v for k, v in options.items() if asked[k] is None}, _mode(set(asked.values()) - {None})


def tuned(stack: SpeculationStack, prompt: Sequence[int], mode: str, **calibration) -> tuple[Tuning, "Retuner | None"]:
    """``mode`` ``"auto"``: :func:`tune` ``stack`` on ``prompt``; ``"adaptive"``: that, and a
    :class:`Retuner` to pass to the generation that follows (``after_round=``)."""
    if mode not in TUNINGS:
        raise SpecstackError(f"gamma={mode!r} is not allowed; use an integer >= 1, auto or adaptive")
    tuning = tune(stack, prompt, **calibration)
    return tuning, Retuner.follow(stack, tuning) if mode == "adaptive" else None


def described(tuning: Tuning, retuner: "Retuner | None" = None) -> str:
    """What the tuner chose, and what a retuner changed during decoding (the demo's and the bench's line)."""
    return tuning.describe() if retuner is None else f"{tuning.describe()}; {retuner.describe()}"


def tunable_levels(stack: SpeculationStack) -> list[SpeculativeLevel]:
    """The levels :func:`tune` sets γ on: the verifying ones, of which a stack to tune needs one."""
    levels = verifying_levels(stack)
    if not levels:
        raise SpecstackError("gamma=auto needs a stack with at least one verifying level; 'autoregressive' has none")
    return levels


def verifying_levels(stack: SpeculationStack) -> list[SpeculativeLevel]:
    """The stack's verifying levels, bottom first."""
    levels, drafter = [], stack.top
    while isinstance(drafter, SpeculativeLevel):
        levels.append(drafter)
        drafter = drafter.drafter
    return levels[::-1]


def best_gammas(draft_cost: float, verify_costs: Sequence[dict[int, float]], acceptances: Sequence[float], autoregressive_cost: float,
                max_gamma: int, fixed: Sequence[TreeRound | None] = (), overheads: Sequence[float] = (), gather_cost: float = 0.0) -> tuple[tuple[int, ...], float]:
    """The γ per level (each 1 … ``max_gamma``, 0 too below the top; a tree's depth where ``fixed[i]`` gives its measured
    rounds) that maximises the predicted speedup, and that speedup. A level below the top is priced by
    what it supplies the level above (:meth:`specstack.speedup.LevelCost.supply`), so a γ longer than
    the one above it predicts the same as that one (it is never drafted as such) and the shorter wins;
    it may also get γ 0, drafting nothing and decoding alone, where its drafter costs more than it saves.
    ``overheads[i]``: seconds each round of level i spends outside forwards (none where not given); ``gather_cost``:
    seconds each emitted token costs in re-gathers."""
    fixed = tuple(fixed) or (None,) * len(verify_costs)
    overheads = tuple(overheads) or (0.0,) * len(verify_costs)
    lowest = [0] * (len(fixed) - 1) + [1]  # below the top a level may draft nothing and decode alone (γ 0)
    choices = [range(low, max_gamma + 1) if tree is None else (tree.depth,) for low, tree in zip(lowest, fixed)]
    best: tuple[tuple[int, ...], float] | None = None
    for gammas in itertools.product(*choices):
        levels = [LevelCost(acceptance=a, gamma=g, verify_cost=costs[g + 1], forward_costs=costs, round_overhead=o) if tree is None else tree.cost(costs, o)
                  for a, g, costs, tree, o in zip(acceptances, gammas, verify_costs, fixed, overheads)]
        speedup = StackCost(draft_cost=draft_cost, levels=levels, autoregressive_cost=autoregressive_cost, token_overhead=gather_cost).speedup
        if best is None or speedup > best[1] + 1e-12:
            best = (gammas, speedup)
    return best


def tune(stack: SpeculationStack, prompt: Sequence[int], *, calibration_tokens: int = 32, max_gamma: int = 8,
         repeats: int = 5, seed: int = 0, prefill_progress=None, reuse_cache: bool = False) -> Tuning:
    """Calibrate on ``prompt``, then set the best γ on every verifying level of ``stack`` (see the module
    docstring); ``prefill_progress(done, total)`` follows the calibration run's prefill, which keeps
    what the caches hold of ``prompt`` with ``reuse_cache`` (see ``SpeculationStack.generate``)."""
    levels = tunable_levels(stack)
    before = tuple(level.gamma for level in levels)
    _set_gammas(levels, [max(gamma, 1) for gamma in before])  # a level at γ 0 drafts nothing: calibrate it at 1, so its acceptance is measured
    first_step = _FirstStep(stack)
    calibration = stack.generate(prompt, calibration_tokens, seed=seed, prefill_progress=prefill_progress, reuse_cache=reuse_cache, after_round=first_step)
    stats = calibration.levels  # bottom first: level 0, then one per verifying level
    acceptances = tuple(s.token_acceptance_rate for s in stats[1:])
    draft_cost = _draft_cost(levels[0].drafter, stats[0])
    fixed = tuple(TreeRound.measured(s, level.gamma) if _verifies_trees(level) else None  # a tree's shape stays
                  for level, s in zip(levels, stats[1:]))
    since, tokens = first_step.counters_since(), len(calibration.tokens) - first_step.emitted  # the rounds after the first step
    overheads = tuple(s.bookkeeping_seconds / s.rounds if s.rounds else 0.0 for s in since[1:])
    gather_cost = sum(s.gather_seconds for s in since) / tokens if tokens > 0 else 0.0
    autoregressive_overhead = _autoregressive_overhead(stack, [*prompt, *calibration.tokens], AUTOREGRESSIVE_STEPS)
    costs = tuple(_verify_costs(level, len(prompt), _widths(tree, max_gamma, priced=i == 0), repeats, seed)
                  for i, (level, tree) in enumerate(zip(levels, fixed)))
    priced = levels[0].drafter.price([costs[0][t] + overheads[0] for t in range(1, max_gamma + 2)])  # a round's: its forward and its bookkeeping
    tuning = Tuning(gammas=before, before=before, acceptances=acceptances, draft_cost=draft_cost, verify_costs=costs, predicted_speedup=0.0,
                    calibration_tokens=len(calibration.tokens), max_gamma=max_gamma, fixed=fixed, priced=priced, overheads=overheads,
                    gather_cost=gather_cost, autoregressive_overhead=autoregressive_overhead)
    gammas, speedup = tuning.choose(acceptances)
    _set_gammas(levels, gammas)
    return attrs.evolve(tuning, gammas=gammas, predicted_speedup=speedup)


@attrs.define(eq=False)
class _FirstStep:
    """An ``after_round`` callback that keeps every level's counters after the stack's first step (the top level's
    first γ tokens), so that a round's bookkeeping and the re-gathers are measured without one-time work there (a new
    stack's first gather computes the mean key of every chunk of the context). At 7,500 tokens that made no
    measurable difference (retrieval-flat, a new stack's first 32 tokens: 9.1 ms a round after the first step, 8.0 over
    all its rounds, re-gathers then counted in); the guard is for one-time work that is large against a short
    calibration (test_autotune.py)."""

    stack: SpeculationStack
    first: list[LevelStats] | None = None
    emitted: int = 0  # tokens emitted by the first step

    def __call__(self, emitted: int) -> None:
        if self.first is None:
            self.first, self.emitted = [attrs.evolve(stats) for stats in self.stack.top.level_stats()], emitted

    def counters_since(self) -> list[LevelStats]:
        """Each level's counts (bottom first) since the first step; none where no step was taken."""
        now = self.stack.top.level_stats()
        return [after.since(before) for after, before in zip(now, self.first or now)]


def _autoregressive_overhead(stack: SpeculationStack, text: Sequence[int], steps: int) -> float:
    """Seconds an autoregressive step spends outside its forward, measured in place after ``text`` (the prompt and
    the calibration's tokens): the top level's model drafting ``steps`` tokens for itself over its cache, which is
    autoregressive decoding's own path (:class:`~specstack.drafters.ModelDrafter`, the whole of the autoregressive
    stack), as many as fit the model's window (none: 0). The top level's counters are left as they were; the next
    generation rolls its cache back."""
    top = stack.top
    steps = min(steps, top.lm.model.max_length - len(text))  # inside the model's window
    if steps < 1:
        return 0.0
    saved, top.lm.stats = top.lm.stats, LevelStats(name=top.lm.stats.name)  # the steps count apart from the level's counters
    try:
        decoder = ModelDrafter(lm=top.lm, sampling=top.sampling, generator=top.generator)  # no stop tokens: every step is taken
        sequence = TokenSequence(text)
        decoder.propose(sequence.view(len(sequence)), steps)
        return top.lm.stats.bookkeeping_seconds / steps  # the decoder counts its time outside forwards as bookkeeping
    finally:
        top.lm.stats = saved


def _set_gammas(levels: Sequence[SpeculativeLevel], gammas: Sequence[int]) -> None:
    for level, gamma in zip(levels, gammas):
        level.gamma = gamma


def _weight(instance, attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0 <= value < 1):
        raise SpecstackError(f"{attribute.name} {value!r} is not allowed; use a weight in [0, 1)")


@attrs.define(eq=False, kw_only=True)
class Retuner:
    """Re-chooses γ during one generation: ``SpeculationStack.generate(..., after_round=retuner)``.

    Every ``every`` emitted tokens it estimates each verifying level's acceptance α_i from the tokens
    its verifier examined since the last choice, plus ``memory`` times what it counted before (an
    exponentially weighted count that starts from the calibration's α with the weight of ``every``
    examined tokens), and sets :meth:`Tuning.choose`'s γ on the levels. ``history`` records each
    change as (tokens emitted, γ per level). Start one per generation with :meth:`follow`."""

    tuning: Tuning
    levels: tuple[SpeculativeLevel, ...] = attrs.field(converter=tuple)
    every: int = attrs.field(default=16, validator=at_least_one)
    memory: float = attrs.field(default=0.5, validator=_weight)
    history: list[tuple[int, tuple[int, ...]]] = attrs.field(factory=list)
    _weighted: list[tuple[float, float]] = attrs.field(init=False)  # per level: (accepted, examined)
    _counted: list[tuple[int, int]] = attrs.field(init=False)  # per level: the counters at the last choice
    _next: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._weighted = [(a * self.every, float(self.every)) for a in self.tuning.acceptances]
        self._counted = [_examined(level) for level in self.levels]
        self._next = self.every

    @classmethod
    def follow(cls, stack: SpeculationStack, tuning: Tuning, *, every: int = 16, memory: float = 0.5) -> "Retuner":
        """A retuner for ``stack``'s next generation, from the costs and acceptance ``tuning`` measured."""
        levels = verifying_levels(stack)
        if len(levels) != len(tuning.gammas):
            raise SpecstackError(f"this tuning has {len(tuning.gammas)} verifying levels but the stack has {len(levels)}")
        return cls(tuning=tuning, levels=levels, every=every, memory=memory)

    def describe(self) -> str:
        if not self.history:
            return "gamma=adaptive kept them during decoding"
        changes = "; ".join(f"{', '.join(map(str, gammas))} at token {emitted}" for emitted, gammas in self.history)
        return f"gamma=adaptive re-chose them {len(self.history)} time{'s' * (len(self.history) != 1)} during decoding: {changes}"

    def __call__(self, emitted: int) -> None:
        """After a top-level round that brought the generation to ``emitted`` tokens."""
        if emitted < self._next:
            return
        self._next = emitted + self.every
        gammas, _ = self.tuning.choose(self._update())
        if gammas != tuple(level.gamma for level in self.levels):
            _set_gammas(self.levels, gammas)
            self.history.append((emitted, gammas))

    def _update(self) -> tuple[float, ...]:
        """Fold each level's counts since the last choice into its weighted ones; α_i per level."""
        for i, level in enumerate(self.levels):
            now = _examined(level)
            accepted, examined = now[0] - self._counted[i][0], now[1] - self._counted[i][1]
            self._counted[i] = now
            if examined:  # a level that examined nothing since keeps its estimate
                weighted = self._weighted[i]
                self._weighted[i] = (self.memory * weighted[0] + accepted, self.memory * weighted[1] + examined)
        return tuple(accepted / examined for accepted, examined in self._weighted)


def _examined(level: SpeculativeLevel) -> tuple[int, int]:
    """A level's accepted and examined drafted tokens so far."""
    return level.lm.stats.accepted, level.lm.stats.examined


def _draft_cost(drafter, stats) -> float:
    """Seconds per drafted token of level 0: its mean forward time and its sampling a token, or a token's worth of
    bookkeeping for a drafter without a model (whose drafting the level above counts, a round at a time)."""
    if isinstance(drafter, ModelLevel) and stats.forward_calls:
        return stats.forward_seconds / stats.forward_calls + (stats.bookkeeping_seconds / stats.drafted if stats.drafted else 0.0)
    return MODEL_FREE_DRAFT_COST


def _verifies_trees(level: SpeculativeLevel) -> bool:
    """Whether ``level``'s drafter drafts token trees (their shape kept, priced as measured) rather than chains."""
    return level.drafter.draft_kind is not DraftKind.CHAIN


def _widths(tree: TreeRound | None, max_gamma: int, priced: bool = False) -> tuple[int, ...]:
    """The forward widths a level is timed at: a chain level's, and the first level's (whose costs its drafter
    is told), 1 … max_gamma + 1 tokens; another tree level's single token (the autoregressive step, where it is
    the top); a tree level's measured tree width too."""
    chain = range(1, max_gamma + 2) if tree is None or priced else (1,)
    return tuple(sorted({*chain, *((tree.width,) if tree is not None else ())}))


def _verify_costs(level: SpeculativeLevel, context: int, widths: Sequence[int], repeats: int, seed: int) -> dict[int, float]:
    """T -> seconds of the level's forward of T tokens over a cache as long as it holds in decoding:
    a tree of T tokens where the level verifies trees, else a chain."""
    from .bench.floor import fill, time_forwards

    lm, most, tree = level.lm, max(widths), _verifies_trees(level)
    cached = max(1, min(context, lm.capacity - most))
    store = lm.model.new_cache(cached + most, relative_positions=lm.policy.relative_positions)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    fill(store, cached, generator)
    return time_forwards(lm.model, store, cached=cached, widths=widths, tree=tree, repeats=repeats, generator=generator)
