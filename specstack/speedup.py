"""The speedup a speculation stack should reach, predicted from forward costs and acceptance rates.

This is the one place that figure is computed. Speculative decoding (Leviathan et al., 2023, Eq. 1):
with per-token acceptance α and a chain of γ drafted tokens, a round emits on average

    E(α, γ) = (1 − α^(γ+1)) / (1 − α)        (γ + 1 when α = 1)

tokens. A verifying level whose drafter costs t_d per drafted token and whose own forward of the
γ+1 tokens costs c_v therefore emits a token every

    t = (γ · t_d + c_v) / E(α, γ).

A verifying level is itself a drafter for the level above, so the formula stacks: t_0 is the draft
model's single-token forward, t_i = (γ_i · t_(i−1) + c_i) / E(α_i, γ_i), and the predicted speedup
is c_ar / t_n, with c_ar the target's single-token forward over its full cache (autoregressive
decoding). For TriForce (Sun et al., 2024) that is L0 the draft, L1 the target over the retrieval
view (acceptance β of the draft, γ1), L2 the target over the full cache (acceptance α of L1, γ2).
"""

from __future__ import annotations

import itertools
import math
import operator

import attrs

from .errors import SpecstackError


def _acceptance(instance, attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0 <= value <= 1):
        raise SpecstackError(f"{attribute.name} {value!r} is not allowed; use a rate in [0, 1]")


def at_least_one(instance, attribute, value: int) -> None:
    """attrs validator: an integer >= 1 (γ, a count)."""
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise SpecstackError(f"{attribute.name} {value!r} is not allowed; use an integer >= 1")


def _cost(instance, attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise SpecstackError(f"{attribute.name} {value!r} is not allowed; use a finite cost > 0")


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


def best_length(acceptance, costs) -> int:
    """:func:`best_count` for a chain: ``acceptance[l]`` = a_l is the chance that the draft's token l is accepted
    once the tokens before it were (Eq. 1 above without its one α: a_l may fall along the chain), so token i is
    reached with Π_{l<=i} a_l."""
    return best_count(list(itertools.accumulate(acceptance, operator.mul)), costs)


def chain_ceiling(acceptance: float, costs) -> tuple[float, int]:
    """The most a level that verifies chains can gain over its own step, with drafting free: the speedup
    c_0 · E(α, γ) / c_γ and the γ that reaches it (0: no draft pays), where every drafted token is accepted
    with ``acceptance`` α once the tokens before it were and ``costs[m]`` = c_m is the seconds of a forward of
    m + 1 tokens (``costs[0]``: the step). Any drafter's cost, or acceptance below α, only lowers it
    (docs/benchmarks.md: what a verify over 32,000 keys costs on the third host)."""
    gamma = best_length([acceptance] * (len(costs) - 1), costs)
    return expected_emitted(acceptance, gamma) * costs[0] / costs[gamma], gamma


@attrs.frozen(kw_only=True)
class LevelCost:
    """One verifying level: the acceptance of its drafter's tokens, γ, and its forward of γ+1 tokens."""

    acceptance: float = attrs.field(validator=_acceptance)
    gamma: int = attrs.field(validator=at_least_one)
    verify_cost: float = attrs.field(validator=_cost)  # c_v, seconds (or any unit, used consistently)

    def time_per_token(self, draft_cost: float) -> float:
        """t = (γ · t_d + c_v) / E(α, γ), with t_d the drafter's time per drafted token."""
        return (self.gamma * draft_cost + self.verify_cost) / expected_emitted(self.acceptance, self.gamma)


def _emitted(instance, attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 1):
        raise SpecstackError(f"{attribute.name} {value!r} is not allowed; a round emits at least 1 token")


@attrs.frozen(kw_only=True)
class MeasuredLevelCost:
    """A verifying level whose round is measured rather than modelled: one verifying a token tree
    (Sequoia, Medusa), whose output per round the chain formula E(α, γ) does not give. A round emits
    ``emitted`` tokens on average (measured), costs ``drafts`` tokens' worth of its drafter's time
    (the tree's depth: one draft step per layer of the tree) and one forward of the tree, ``verify_cost``:

        t = (drafts · t_d + c_v) / emitted."""

    emitted: float = attrs.field(validator=_emitted)
    drafts: int = attrs.field(validator=at_least_one)
    verify_cost: float = attrs.field(validator=_cost)

    def time_per_token(self, draft_cost: float) -> float:
        return (self.drafts * draft_cost + self.verify_cost) / self.emitted


@attrs.frozen(kw_only=True)
class StackCost:
    """A stack's costs: the draft's token, each verifying level bottom first, the autoregressive token."""

    draft_cost: float = attrs.field(validator=_cost)  # t_0
    levels: tuple[LevelCost | MeasuredLevelCost, ...] = attrs.field(converter=tuple)
    autoregressive_cost: float = attrs.field(validator=_cost)  # c_ar

    @levels.validator
    def _levels(self, attribute, value: tuple[LevelCost | MeasuredLevelCost, ...]) -> None:
        if not value or not all(isinstance(level, (LevelCost, MeasuredLevelCost)) for level in value):
            raise SpecstackError(f"levels {value!r} is not allowed; give at least one LevelCost or MeasuredLevelCost, bottom first")

    def time_per_token(self) -> float:
        """t_n: the top level's time per emitted token."""
        t = self.draft_cost
        for level in self.levels:
            t = level.time_per_token(t)
        return t

    @property
    def speedup(self) -> float:
        """c_ar / t_n: predicted speedup over autoregressive decoding with the full cache."""
        return self.autoregressive_cost / self.time_per_token()


def measured_speedup(baseline_seconds: float, baseline_tokens: int, seconds: float, tokens: int) -> float:
    """The measured speedup: the baseline's decode seconds per token over the stack's (same process, same prompt)."""
    if tokens <= 0 or baseline_tokens <= 0 or seconds <= 0:
        raise SpecstackError(f"a speedup needs tokens and time on both sides; got {tokens} tokens in {seconds} s against {baseline_tokens}")
    return (baseline_seconds / baseline_tokens) / (seconds / tokens)


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
