"""The tree of Medusa candidates (Cai et al., 2024, Sec. 2.1.2 and Appendix on "optimized tree
construction"): a candidate is a path of ranks (r_1, …, r_d), taking the rank-r_j token of the head
for depth j; its chance of being accepted whole is estimated as the product of the heads' measured
rank accuracies, and the ``size`` most likely paths form the tree. Every prefix of a chosen path is
at least as likely as the path, so the set is closed under taking parents.

Medusa's heads all read the same hidden state, so the candidates at a depth do not depend on the
tokens above them: the tree is fixed per accuracy table, and each node's token is a lookup.

Each round, which of the tree's nodes to verify: those the heads are confident of (``confident_nodes``,
EAGLE-2's path probability), and, where the level above's forward costs are known, those that pay
(:func:`specstack.speedup.paying_nodes`, Sequoia's hardware-aware sizing made per round), by chances of acceptance that
``DepthCalibration`` corrects depth by depth from the verdicts.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import attrs


Path = tuple[int, ...]


def choose_paths(accuracy: Sequence[Sequence[float]], size: int) -> list[Path]:
    """The ``size`` rank paths with the largest products of ``accuracy[depth][rank]``, parents before
    children and siblings by rank (best-first search: a child is never likelier than its parent)."""
    chosen: list[Path] = []
    frontier = [(-float(accuracy[0][r]), (r,)) for r in range(len(accuracy[0]))] if accuracy else []
    heapq.heapify(frontier)
    while frontier and len(chosen) < size:
        score, path = heapq.heappop(frontier)
        if score >= 0:  # nothing likely is left
            break
        chosen.append(path)
        if len(path) < len(accuracy):
            for r, a in enumerate(accuracy[len(path)]):
                heapq.heappush(frontier, (score * float(a), (*path, r)))
    return sorted(chosen, key=lambda p: (len(p), p))


def parents_of(paths: Sequence[Path]) -> list[int]:
    """The index of each path's parent in ``paths`` (-1 for depth 1); ``paths`` as ``choose_paths`` orders them."""
    index = {path: i for i, path in enumerate(paths)}
    return [index[path[:-1]] if len(path) > 1 else -1 for path in paths]


@attrs.frozen
class RankTree:
    """A tree of rank paths (``choose_paths``) as the drafter walks it: per node, in depth order, its ``depth``, its
    ``rank`` and its ``parent`` (-1 at depth 0). A depth's nodes are contiguous."""

    depth: tuple[int, ...]
    rank: tuple[int, ...]
    parent: tuple[int, ...]

    @classmethod
    def of(cls, paths: Sequence[Path]) -> "RankTree":
        return cls(depth=tuple(len(p) - 1 for p in paths), rank=tuple(p[-1] for p in paths), parent=tuple(parents_of(paths)))

    def __len__(self) -> int:
        return len(self.depth)

    @property
    def depths(self) -> int:
        return self.depth[-1] + 1 if self.depth else 0

    def cut(self, depths: int) -> "RankTree":
        """The nodes of the first ``depths`` depths."""
        k = sum(d < depths for d in self.depth)
        return RankTree(depth=self.depth[:k], rank=self.rank[:k], parent=self.parent[:k])

    def at(self, depth: int) -> range:
        """The nodes at ``depth``."""
        return range(self.depth.index(depth), len(self.depth) - self.depth[::-1].index(depth))

    def slots(self, depth: int) -> list[int]:
        """Each node at ``depth``'s parent as a row among the nodes of the depth above (0 at depth 0: the root)."""
        nodes = self.at(depth)
        first_above = self.at(depth - 1).start if depth else 0
        return [max(self.parent[i] - first_above, 0) for i in nodes]


def path_probabilities(node_probs: Sequence[float], parents: Sequence[int]) -> list[float]:
    """Each node's path probability: the product of the heads' probabilities of the node's tokens from the root
    down to it (EAGLE-2, Li et al., 2024, Sec. 4: the draft model's confidence approximates a node's chance of
    acceptance). It never exceeds its parent's."""
    path: list[float] = []
    for p, parent in zip(node_probs, parents):
        path.append(float(p) * (path[parent] if parent >= 0 else 1.0))
    return path


def confident_nodes(node_probs: Sequence[float], parents: Sequence[int], least: float) -> list[int]:
    """The nodes worth verifying: those whose path probability (:func:`path_probabilities`) is at least ``least``,
    in their order; closed under taking parents, as a path's probability never exceeds its parent's."""
    return [i for i, p in enumerate(path_probabilities(node_probs, parents)) if p >= least]


@attrs.define(kw_only=True)
class DepthCalibration:
    """How often the level above accepts the heads' guesses, against their path probabilities, depth by depth: per
    depth d of the tree, a running count of the rounds that accepted a node at depth d and one of the path
    probabilities drafted there (``weight`` of the way to each round's, from 1 and 1; their ratio scales the path
    probabilities). The deeper a guess, the surer the heads were of it than the target: greedy over 7,500 tokens,
    the path probabilities of chained heads' nodes summed to 67.0 / 23.2 / 11.3 at depths 0 / 1 / 2 where 72 / 19 /
    4 rounds accepted a node there (Austen), 65.1 / 15.6 / 5.3 against 52 / 10 / 1 (KJV). A depth whose nodes all
    priced out moves ``retry`` of the way back to 1, so that it is tried again."""

    weight: float
    retry: float
    _counts: list[list[float]] = attrs.field(init=False, factory=list)  # depth -> [rounds accepting there, path probabilities drafted there]
    _shown: list[float] = attrs.field(init=False, factory=list)  # depth -> the last draft's path probabilities there ([]: nothing drafted)

    def reach(self, path: Sequence[float], depths: Sequence[int], parents: Sequence[int]) -> list[float]:
        """Each node's chance of acceptance (nodes in tree order): its path probability times its depth's ratio, at most
        1 and at most its parent's (so that a parent ranks first, as paying_nodes needs)."""
        reach: list[float] = []
        for p, depth, parent in zip(path, depths, parents):
            accepted, predicted = self._at(depth)
            chance = min(1.0, p * accepted / predicted)
            reach.append(min(chance, reach[parent]) if parent >= 0 else chance)
        return reach

    def show(self, path: Sequence[float], depths: Sequence[int], nodes: Sequence[int]) -> None:
        """The draft of ``nodes`` is what the next verdict judges (none: the next verdict is not learnt from)."""
        self._shown = [0.0] * (max((depths[i] for i in nodes), default=-1) + 1)
        for i in nodes:
            self._shown[depths[i]] += path[i]

    def observe(self, accepted: int) -> None:
        """The verdict on the draft last shown: ``accepted`` tokens, so a node at each depth below ``accepted``."""
        for depth, predicted in enumerate(self._shown):
            counts = self._at(depth)
            counts[0] += self.weight * ((depth < accepted) - counts[0])
            counts[1] += self.weight * (predicted - counts[1])
        self._shown = []

    def priced_out(self, depths: set[int]) -> None:
        """Move each of ``depths``, none of whose nodes paid, back toward 1."""
        for depth in depths:
            counts = self._at(depth)
            counts[0] += self.retry * (counts[1] - counts[0])

    def _at(self, depth: int) -> list[float]:
        while len(self._counts) <= depth:
            self._counts.append([1.0, 1.0])
        return self._counts[depth]
