"""Sequoia's tree planner (Chen et al., 2024, Sec. 3.2 and 4): measure, optimise, choose.

1. :func:`positional_acceptance` measures p_k, how often the k-th child of a node (siblings drawn
   without replacement) is the one the target accepts, by drafting star trees of width W.
2. :func:`best_tree` finds the tree of n nodes and depth <= d with the most expected accepted
   tokens, assuming p_k depends neither on depth nor on the parent (the positional acceptance
   assumption). With T[m][l][b] the best expected tokens of a subtree of m nodes (its root counted
   once), depth <= l, b root children:

       T[1][l][0] = 1
       T[m][l][1] = 1 + p_1 · max_b' T[m-1][l-1][b']
       T[m][l][b] = max_{1 <= y < m} T[y][l][b-1] + p_b · max_b' T[m-y][l-1][b']

   The draft tree of n nodes and depth d is the subtree of n + 1 nodes and depth d + 1 whose root is
   the last committed token, so its expected accepted tokens are max_b T[n+1][d+1][b] - 1.
3. :func:`plan_tree` is hardware-aware: with the verify time of n tokens and the draft's time per
   depth measured (:func:`measure_costs`), it picks the (n, d) maximising the predicted
   tokens per second (1 + accepted) / (d · draft_time + verify_time(n)).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import Counter, deque
from typing import Sequence

import attrs
import numpy as np
import torch

from specstack import (CachedModel, CachePolicy, Draft, FullCache, Level, LevelStats, SamplingConfig, SpecstackError,
                       SpeculationStack, Verifier)
from specstack.types import DraftKind, Verdict
from specstack.verify import default_verifier

from .drafters import SequoiaDrafter
from .shape import TreeShape

# -- 1. positional acceptance ----------------------------------------------------------------------


class _RankRecorder(Verifier):
    """Verifies as ``inner`` does and counts which sibling (by rank) of the root was accepted."""

    name = "sequoia-rank-recorder"

    def __init__(self, inner: Verifier) -> None:
        self.inner, self.accepts = inner, inner.accepts
        self.ranks: Counter[int] = Counter()
        self.rounds = 0

    def check_sampling(self, sampling: SamplingConfig) -> None:
        self.inner.check_sampling(sampling)

    def verify(self, draft: Draft, p: torch.Tensor, generator: torch.Generator) -> Verdict:
        verdict = self.inner.verify(draft, p, generator)
        self.rounds += 1
        if verdict.accepted:
            self.ranks[draft.children(-1).index(verdict.accepted[0])] += 1
        return verdict


def positional_acceptance(target, draft, prompt: Sequence[int], *, width: int = 8, new_tokens: int = 128,
                          sampling: SamplingConfig = SamplingConfig(), draft_policy: CachePolicy | None = None,
                          stop_tokens: Sequence[int] = (), seed: int = 0) -> tuple[float, ...]:
    """p_1 … p_width: the fraction of rounds in which the k-th child of a star tree of ``width``
    children, drafted by ``draft`` (a :class:`SequoiaDrafter` over ``draft_policy``) after
    ``prompt`` and its continuation, was the token ``target`` accepted. Decodes ``new_tokens``."""
    _positive("width", width)
    _positive("new tokens", new_tokens)
    kind = DraftKind.TREE_DETERMINISTIC if sampling.deterministic else DraftKind.TREE_WITHOUT_REPLACEMENT
    recorder = _RankRecorder(default_verifier(kind, sampling))
    drafting = functools.partial(SequoiaDrafter, shape=TreeShape.star(width))
    levels = [Level(model=draft, policy=draft_policy or FullCache(), model_drafter=drafting, name="draft"),
              Level(model=target, gamma=1, verifier=recorder, name="target")]
    SpeculationStack.build(levels, sampling=sampling, stop_tokens=stop_tokens, seed=seed).generate(prompt, new_tokens)
    return tuple(recorder.ranks[k] / recorder.rounds for k in range(width))


# -- 2. the dynamic program ------------------------------------------------------------------------


@attrs.frozen(kw_only=True, eq=False)
class TreeTable:
    """Sequoia's table for one acceptance vector, up to ``max_size`` draft nodes and ``max_depth``."""

    acceptance: tuple[float, ...]
    best: np.ndarray  # [M+1, L+1]: max_b T[m][l][b] (-inf: no such tree)
    table: np.ndarray  # [M+1, L+1, W+1]: T[m][l][b]
    split: np.ndarray  # [M+1, L+1, W+1]: the y achieving T[m][l][b], b >= 2

    @classmethod
    def solve(cls, acceptance: Sequence[float], max_size: int, max_depth: int) -> "TreeTable":
        p = _acceptance(acceptance)
        _positive("max_size", max_size)
        _positive("max_depth", max_depth)
        m_max, l_max, width = max_size + 1, max_depth + 1, len(p)
        table = np.full((m_max + 1, l_max + 1, width + 1), -np.inf)  # [M+1, L+1, W+1]
        split = np.zeros((m_max + 1, l_max + 1, width + 1), dtype=np.int64)
        best = np.full((m_max + 1, l_max + 1), -np.inf)  # [M+1, L+1]
        for l in range(1, l_max + 1):
            table[1, l, 0] = best[1, l] = 1.0
            for m in range(2, m_max + 1):
                if l >= 2:
                    table[m, l, 1] = 1.0 + _times(p[0], best[m - 1, l - 1])
                    for b in range(2, min(width, m - 1) + 1):
                        last = _times(p[b - 1], best[m - 1 : 0 : -1, l - 1])  # [m-1]: y = 1 … m-1
                        candidates = table[1:m, l, b - 1] + last  # [m-1]
                        y = int(np.argmax(candidates))
                        table[m, l, b], split[m, l, b] = candidates[y], y + 1
                best[m, l] = table[m, l].max()
        return cls(acceptance=tuple(p), best=best, table=table, split=split)

    def expected_accepted(self, size: int, depth: int) -> float:
        """Expected accepted tokens per round of the best tree of ``size`` nodes, depth <= ``depth``
        (-inf when no such tree exists: more nodes than ``depth`` levels of the vector's width hold)."""
        return float(self.best[size + 1, depth + 1]) - 1.0

    def shape(self, size: int, depth: int) -> TreeShape:
        """The best tree of ``size`` nodes and depth <= ``depth``, breadth first, siblings by rank."""
        if not np.isfinite(self.best[size + 1, depth + 1]):
            raise SpecstackError(f"no tree of {size} nodes fits depth {depth} with {len(self.acceptance)} children per node")
        parents, queue = [], deque([(-1, self._children(size + 1, depth + 1))])
        while queue:
            parent, children = queue.popleft()
            for subtree in children:
                parents.append(parent)
                queue.append((len(parents) - 1, subtree))
        return TreeShape(parents=parents)

    def _children(self, m: int, l: int, b: int | None = None) -> list:
        """The children of the root of the best (m, l) subtree with b root children, as nested lists."""
        b = int(np.argmax(self.table[m, l])) if b is None else b
        if b == 0:
            return []
        if b == 1:
            return [self._children(m - 1, l - 1)]
        y = int(self.split[m, l, b])
        return [*self._children(y, l, b - 1), self._children(m - y, l - 1)]


def _times(p: float, values):
    """p · values with -inf (no tree) kept as -inf even when p is 0."""
    return np.where(np.isfinite(values), p * np.where(np.isfinite(values), values, 0.0), -np.inf)


def best_tree(acceptance: Sequence[float], size: int, depth: int) -> tuple[TreeShape, float]:
    """The tree of ``size`` nodes and depth <= ``depth`` with the most expected accepted tokens."""
    table = TreeTable.solve(acceptance, size, depth)
    return table.shape(size, depth), table.expected_accepted(size, depth)


# -- 3. hardware-aware choice ----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Costs:
    """Measured seconds: the verifying level's forward over ``verify_sizes`` draft tokens, and one
    forward of the draft per tree depth."""

    verify_sizes: tuple[int, ...]
    verify_seconds: tuple[float, ...]
    draft_seconds: float

    def verify(self, size: int) -> float:
        """Seconds to verify ``size`` tokens (linear between the measured sizes)."""
        return float(np.interp(size, self.verify_sizes, self.verify_seconds))

    def round_seconds(self, size: int, depth: int) -> float:
        return depth * self.draft_seconds + self.verify(size)


@attrs.frozen(kw_only=True)
class Plan:
    """The chosen tree and what it is expected to give."""

    shape: TreeShape
    expected_accepted: float  # draft tokens accepted per round
    tokens_per_second: float | None  # predicted, with costs
    round_seconds: float | None
    acceptance: tuple[float, ...]

    @property
    def tokens_per_round(self) -> float:
        return 1.0 + self.expected_accepted


def plan_tree(acceptance: Sequence[float], *, max_size: int, max_depth: int, costs: Costs | None = None) -> Plan:
    """Sequoia's choice: without ``costs`` the best tree of ``max_size`` nodes and depth <=
    ``max_depth``; with them the (size, depth) within those bounds maximising predicted tokens/s."""
    table = TreeTable.solve(acceptance, max_size, max_depth)
    options = [(n, d) for n in range(1, max_size + 1) for d in range(1, max_depth + 1) if np.isfinite(table.best[n + 1, d + 1])]
    if costs is None:
        size = max(n for n, d in options if d == max_depth)
        depth = max_depth
    else:
        size, depth = max(options, key=lambda nd: (1 + table.expected_accepted(*nd)) / costs.round_seconds(*nd))
    shape, accepted = table.shape(size, depth), table.expected_accepted(size, depth)
    seconds = costs.round_seconds(shape.size, shape.depth) if costs is not None else None
    return Plan(shape=shape, expected_accepted=accepted, tokens_per_second=(1 + accepted) / seconds if seconds else None,
                round_seconds=seconds, acceptance=table.acceptance)


def measure_costs(target, draft, prompt: Sequence[int], *, sizes: Sequence[int], draft_width: int = 8,
                  draft_policy: CachePolicy | None = None, repeats: int = 5) -> Costs:
    """Time the target's forward over its full cache of ``prompt`` scoring a tree of each of
    ``sizes`` tokens, and the draft's forward over ``draft_policy`` scoring ``draft_width`` tokens
    (one depth of a tree); the median of ``repeats`` runs after one warm-up."""
    sizes = sorted(set(sizes))
    verifying = _prefilled(target, FullCache(), prompt)
    verify = [_median_seconds(verifying, prompt, size, repeats) for size in sizes]
    drafting = _prefilled(draft, draft_policy or FullCache(), prompt)
    return Costs(verify_sizes=tuple(sizes), verify_seconds=tuple(verify), draft_seconds=_median_seconds(drafting, prompt, draft_width, repeats))


def _prefilled(model, policy: CachePolicy, prompt: Sequence[int]) -> CachedModel:
    lm = CachedModel(model, policy, LevelStats(name="timing"))
    lm.logits(prompt, 1)
    return lm


def _median_seconds(lm: CachedModel, prompt: Sequence[int], size: int, repeats: int) -> float:
    vocab = lm.model.vocab_size
    device = lm.device
    tokens = torch.arange(size, dtype=torch.long, device=device) % vocab  # [k]
    tree = Draft(tokens=tokens, probs=torch.zeros(1, vocab, device=device).expand(size, vocab), parents=torch.full((size,), -1, dtype=torch.long, device=device),
                 kind=DraftKind.TREE_DETERMINISTIC)  # a star: the cost depends on the token count
    times = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        float(lm.tree_logits(prompt, tree)[-1, 0])  # reading a value waits for an asynchronous device
        times.append(time.perf_counter() - began)
        lm.accept_path([])
    return statistics.median(times[1:])


# -- checks ----------------------------------------------------------------------------------------


def _acceptance(values: Sequence[float]) -> list[float]:
    p = [float(v) for v in values]
    if not p or not all(0.0 <= v <= 1.0 for v in p) or sum(p) > 1.0 + 1e-6:
        raise SpecstackError(f"acceptance vector {list(values)!r} is not allowed; use one or more probabilities in [0, 1] summing to at most 1")
    return p


def _positive(what: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecstackError(f"{what} {value!r} is not allowed; use an integer >= 1")
