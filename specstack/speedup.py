"""The speedup a speculation stack should reach, predicted from forward costs and acceptance rates.

This is the one place that figure is computed. Speculative decoding (Leviathan et al., 2023, Eq. 1):
with per-token acceptance α and a chain of k drafted tokens, a round accepts j of them with probability

    P(j | k) = α^j (1 − α) for j < k,   α^k for j = k,

and emits j + 1 tokens (the accepted ones and the recovered or bonus one), on average

    E(α, k) = (1 − α^(k+1)) / (1 − α)        (k + 1 when α = 1).

The top level drafts γ tokens a round and keeps all it emits, so with c(T) its forward of T tokens and
D(k) the seconds the level below takes to supply k drafted tokens it emits a token every

    t = (D(γ) + c(γ + 1)) / E(α, γ),

and the predicted speedup is c_ar / t, with c_ar the target's single-token forward over its full cache
(autoregressive decoding). A level below the top is asked for what the level above drafts, and
``SpeculativeLevel.propose`` runs its rounds as TriForce's middle level does (Sun et al., 2024: it
drafts until it holds the γ2 tokens the target verifies): each round drafts min(γ, still wanted), and
what the last round emits beyond the wanted tokens is dropped. So its supply is

    S(w) = D(k) + c(k + 1) + Σ_j P(j | k) S(w − j − 1),   k = min(γ, w),   S(w <= 0) = 0,

and D(k) = S_below(k), down to level 0, whose k drafted tokens cost k · t_0. Pricing a middle level
at (γ t_0 + c) / E per token instead, as if everything it emitted were used, overrates it: under a top
level with γ = 1 each middle round supplies one token whatever its acceptance. For TriForce that is
L0 the draft, L1 the target over the retrieval view (acceptance β of the draft, γ1), L2 the target
over the full cache (acceptance α of L1, γ2).

A round also costs its level time outside forwards: sampling and verifying its rows, a model-free
drafter's drafting below it. Given as ``round_overhead`` o (the tuner measures it,
``LevelStats.bookkeeping_seconds`` a round), it is added to c(k + 1) wherever a round is priced. A
gathering level (TriForce's retrieval view) re-gathers every ``stride`` tokens the stack emits, whatever
γ: that is ``token_overhead`` g, added to every emitted token, t = t_n + g. Both are 0 by default. t_0 and
c_ar are what the caller gives: the tuner's t_0 is a drafted token's forward and its sampling, its c_ar the
target's one-token forward and an autoregressive step's own sampling.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import statistics
from typing import Callable, Iterable, Mapping, Sequence

import attrs

from .errors import SpecstackError


def _acceptance(instance, attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0 <= value <= 1):
        raise SpecstackError(f"{attribute.name} {value!r} is not allowed; use a rate in [0, 1]")


def _at_least(minimum: int):
    """An attrs validator: an integer (not a bool) >= ``minimum``."""

    def check(instance, attribute, value: int) -> None:
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
            raise SpecstackError(f"{attribute.name} {value!r} is not allowed; use an integer >= {minimum}")

    return check


at_least_one = _at_least(1)  # γ, a count
at_least_zero = _at_least(0)  # a level's γ, 0 where it drafts nothing


def _cost(instance, attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise SpecstackError(f"{attribute.name} {value!r} is not allowed; use a finite cost > 0")


def _overhead(instance, attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise SpecstackError(f"{attribute.name} {value!r} is not allowed; use a finite number of seconds >= 0")


def expected_emitted(acceptance: float, gamma: int) -> float:
    """E(α, γ) = (1 − α^(γ+1)) / (1 − α): tokens one round emits (accepted + the recovered or bonus one)."""
    if acceptance == 1:
        return gamma + 1.0
    return (1 - acceptance ** (gamma + 1)) / (1 - acceptance)


def best_count(reach, costs) -> int:
    """How many nodes of a draft to verify this round: the m (0 … len(costs) − 1, and within ``reach``) that
    maximises the tokens the round is expected to emit per second of its verifying forward,

        (1 + Σ_{i<m} r_i) / c_m,

    where ``reach[i]`` = r_i is the chance that node i is accepted (it and every node above it: a round emits one
    token per accepted node, plus the recovered or bonus one), the first m nodes form a draft for every m (parents
    before children), and ``costs[m]`` = c_m the seconds of a forward of m + 1 tokens (``costs[0]``: the level's own
    step, nothing drafted). The drafter's own cost is left out: the draft is made before its count is chosen (a
    lookup's is negligible; a Medusa draft's is not, 1.9-2.2 ms at 7,500 tokens in bf16, docs/results.md)."""
    best, best_rate, emitted = 0, 1.0 / costs[0], 1.0
    for m in range(1, min(len(costs), len(reach) + 1)):
        emitted += reach[m - 1]
        if emitted / costs[m] > best_rate:
            best, best_rate = m, emitted / costs[m]
    return best


def paying_nodes(reach: Sequence[float], nodes: Sequence[int], costs: Sequence[float]) -> list[int]:
    """The nodes of ``nodes`` (a tree's, closed under taking parents, in tree order) worth a forward at ``costs``
    (``costs[m]``: the seconds of a forward of m + 1 tokens): the m most likely to be accepted by ``reach`` (each
    node's estimated chance; a parent's is never below its child's, and ranks first at a tie, as it comes first),
    with m the count that maximises the tokens a round emits per second (:func:`best_count`).
    Closed under taking parents, in tree order."""
    likeliest = sorted(nodes, key=lambda i: -reach[i])  # stable: a parent before its equally likely child
    return sorted(likeliest[: best_count([reach[i] for i in likeliest], costs)])


def subtree_parents(nodes: Sequence[int], parents: Sequence[int]) -> list[int]:
    """``parents`` renumbered for the subtree of ``nodes`` (ascending, closed under taking parents)."""
    index = {node: i for i, node in enumerate(nodes)}
    return [index[parents[node]] if parents[node] >= 0 else -1 for node in nodes]


def best_length(acceptance, costs) -> int:
    """:func:`best_count` for a chain: ``acceptance[l]`` = a_l is the chance that the draft's token l is accepted
    once the tokens before it were (Eq. 1 above without its one α: a_l may fall along the chain), so token i is
    reached with Π_{l<=i} a_l."""
    return best_count(list(itertools.accumulate(acceptance, operator.mul)), costs)


def chain_ceiling(acceptance: float, costs, draft_cost: float = 0.0) -> tuple[float, int]:
    """The most a level that verifies chains can gain over its own step: the speedup c_0 · E(α, γ) / (γ t + c_γ)
    and the γ that reaches it (0: no draft pays), where every drafted token is accepted with ``acceptance`` α once
    the tokens before it were, ``costs[m]`` = c_m is the seconds of a forward of m + 1 tokens (``costs[0]``: the
    step) and each drafted token costs ``draft_cost`` t seconds (0: drafting free; a level below's one-token step:
    TriForce's bound, its catch-up forwards and bookkeeping left out). Any higher cost, or acceptance below α, only
    lowers it (docs/benchmarks.md: what a verify over 32,000 keys costs on the third host)."""
    rounds = [cost + m * draft_cost for m, cost in enumerate(costs)]  # [γ + 1]: a round of m drafted tokens
    gamma = best_length([acceptance] * (len(costs) - 1), rounds)
    return expected_emitted(acceptance, gamma) * costs[0] / rounds[gamma], gamma


Supply = Callable[[int], float]  # k -> expected seconds for a level to supply k drafted tokens to the level above


def drafted_at(cost: float) -> Supply:
    """Level 0's supply: k drafted tokens cost k times ``cost`` (t_0, a draft model's forward of one token)."""
    return lambda k: k * cost


def emitted_odds(acceptance: float, k: int) -> list[float]:
    """P(j | k), j = 0 … k: the chance that a round of k drafted tokens accepts j of them (and emits j + 1)."""
    return [acceptance**j * (1 - acceptance) for j in range(k)] + [acceptance**k]


@attrs.frozen(kw_only=True)
class LevelCost:
    """One verifying level: the acceptance of its drafter's tokens, γ, and its forward of γ+1 tokens;
    ``forward_costs`` (T -> seconds) prices the shorter forwards of the rounds it runs when asked for
    fewer than γ tokens (a forward missing from it is priced as ``verify_cost``, an upper bound)."""

    acceptance: float = attrs.field(validator=_acceptance)
    gamma: int = attrs.field(validator=at_least_zero)  # 0: the level drafts nothing, one forward of one token a round
    verify_cost: float = attrs.field(validator=_cost)  # c(γ + 1), seconds (or any unit, used consistently)
    forward_costs: Mapping[int, float] = attrs.field(factory=dict, converter=dict, eq=False)
    round_overhead: float = attrs.field(default=0.0, validator=_overhead)  # o: a round's seconds outside forwards

    def forward_cost(self, tokens: int) -> float:
        return self.verify_cost if tokens == self.gamma + 1 else self.forward_costs.get(tokens, self.verify_cost)

    def round_seconds(self, k: int, below: Supply) -> float:
        """D(k) + c(k + 1) + o: k tokens drafted below, verified in one forward, and the round's bookkeeping."""
        return below(k) + self.forward_cost(k + 1) + self.round_overhead

    def time_per_token(self, below: Supply) -> float:
        """t = (D(γ) + c(γ + 1) + o) / E(α, γ): the top level's seconds per emitted token."""
        return self.round_seconds(self.gamma, below) / expected_emitted(self.acceptance, self.gamma)

    def supply(self, wanted: int, below: Supply) -> float:
        """S(wanted): expected seconds to emit at least ``wanted`` tokens for the level above, rounds of
        min(γ, still wanted) drafted tokens (the module docstring's recursion, bottom up)."""
        seconds = [0.0]  # seconds[w] = S(w)
        for w in range(1, wanted + 1):
            k = min(self.gamma, w)
            rest = sum(p * seconds[max(w - j - 1, 0)] for j, p in enumerate(emitted_odds(self.acceptance, k)))
            seconds.append(self.round_seconds(k, below) + rest)
        return seconds[wanted]


def _emitted(instance, attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 1):
        raise SpecstackError(f"{attribute.name} {value!r} is not allowed; a round emits at least 1 token")


@attrs.frozen(kw_only=True)
class MeasuredLevelCost:
    """A verifying level whose round is measured rather than modelled: one verifying a token tree
    (Sequoia, Medusa), whose output per round the chain formula E(α, γ) does not give. A round emits
    ``emitted`` tokens on average (measured), costs ``drafts`` tokens' worth of its drafter's time
    (the tree's depth: one draft step per layer of the tree) and one forward of the tree, ``verify_cost``:

        t = (D(drafts) + c_v + o) / emitted.

    Below another level it supplies ``wanted`` tokens in about wanted / emitted rounds, at least one
    (the calibration measured the mean a round emits, not its distribution)."""

    emitted: float = attrs.field(validator=_emitted)
    drafts: int = attrs.field(validator=at_least_one)
    verify_cost: float = attrs.field(validator=_cost)
    round_overhead: float = attrs.field(default=0.0, validator=_overhead)  # o: a round's seconds outside forwards

    def round_seconds(self, below: Supply) -> float:
        return below(self.drafts) + self.verify_cost + self.round_overhead

    def time_per_token(self, below: Supply) -> float:
        return self.round_seconds(below) / self.emitted

    def supply(self, wanted: int, below: Supply) -> float:
        return max(1.0, wanted / self.emitted) * self.round_seconds(below)


@attrs.frozen(kw_only=True)
class StackCost:
    """A stack's costs: the draft's token, each verifying level bottom first, the autoregressive token."""

    draft_cost: float = attrs.field(validator=_cost)  # t_0
    levels: tuple[LevelCost | MeasuredLevelCost, ...] = attrs.field(converter=tuple)
    autoregressive_cost: float = attrs.field(validator=_cost)  # c_ar
    token_overhead: float = attrs.field(default=0.0, validator=_overhead)  # g: seconds an emitted token costs beyond its rounds (re-gathers)

    @levels.validator
    def _levels(self, attribute, value: tuple[LevelCost | MeasuredLevelCost, ...]) -> None:
        if not value or not all(isinstance(level, (LevelCost, MeasuredLevelCost)) for level in value):
            raise SpecstackError(f"levels {value!r} is not allowed; give at least one LevelCost or MeasuredLevelCost, bottom first")

    def time_per_token(self) -> float:
        """t_n + g: the top level's time per emitted token, each level below supplying what the one above drafts,
        and what every emitted token costs beyond its rounds."""
        below = drafted_at(self.draft_cost)
        for level in self.levels[:-1]:
            below = functools.partial(level.supply, below=below)
        return self.levels[-1].time_per_token(below) + self.token_overhead

    @property
    def speedup(self) -> float:
        """c_ar / t_n: predicted speedup over autoregressive decoding with the full cache."""
        return self.autoregressive_cost / self.time_per_token()


def measured_speedup(baseline_seconds: float, baseline_tokens: int, seconds: float, tokens: int) -> float:
    """The measured speedup: the baseline's decode seconds per token over the stack's (same process, same prompt)."""
    if tokens <= 0 or baseline_tokens <= 0 or seconds <= 0:
        raise SpecstackError(f"a speedup needs tokens and time on both sides; got {tokens} tokens in {seconds} s against {baseline_tokens}")
    return (baseline_seconds / baseline_tokens) / (seconds / tokens)


def median_speedup(speedups: Sequence[float | None]) -> float | None:
    """A stack's speedup over turns (``specstack bench --repeats``, ``specstack demo --repeats``): the median of its
    turns' speedups, each measured against the baseline of its own turn; None where no turn measured one."""
    measured = [s for s in speedups if s is not None]
    return statistics.median(measured) if measured else None


def turns_range(speedups: Iterable[float | None]) -> tuple[float, float] | None:
    """The least and the most of a stack's measured speedups turn by turn, shown beside their median; None with
    fewer than two turns measured."""
    measured = [s for s in speedups if s is not None]
    return (min(measured), max(measured)) if len(measured) > 1 else None


def triforce(*, c_ar: float, c2: float, c1: float, t0: float,
             alpha: float = 0.9, beta: float = 0.8, gamma1: int = 2, gamma2: int = 6) -> StackCost:
    """TriForce's three levels. Defaults: the paper's γ1 = 2, γ2 = 6 and acceptance rates of its
    Llama-2-7B-128K / JackFram/llama-68m setup (β = 0.8 draft → retrieval, α = 0.9 retrieval → full).

    ``t0`` draft forward of 1 token; ``c1`` target over the retrieval view, γ1+1 tokens; ``c2`` target
    over the full cache, γ2+1 tokens; ``c_ar`` target over the full cache, 1 token."""
    return StackCost(
        draft_cost=t0,
        levels=(LevelCost(acceptance=beta, gamma=gamma1, verify_cost=c1), LevelCost(acceptance=alpha, gamma=gamma2, verify_cost=c2)),
        autoregressive_cost=c_ar,
    )
