"""The tree of Medusa candidates (Cai et al., 2024, Sec. 2.1.2 and Appendix on "optimized tree
construction"): a candidate is a path of ranks (r_1, …, r_d), taking the rank-r_j token of the head
for depth j; its chance of being accepted whole is estimated as the product of the heads' measured
rank accuracies, and the ``size`` most likely paths form the tree. Every prefix of a chosen path is
at least as likely as the path, so the set is closed under taking parents.

Medusa's heads all read the same hidden state, so the candidates at a depth do not depend on the
tokens above them: the tree is fixed per accuracy table, and each node's token is a lookup.
"""

from __future__ import annotations

import heapq
from typing import Sequence

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


def confident_nodes(node_probs: Sequence[float], parents: Sequence[int], least: float) -> list[int]:
    """The nodes worth verifying: those whose path probability (the product of the heads' probabilities
    of the node's tokens from the root down to it) is at least ``least``, in their order (EAGLE-2, Li et
    al., 2024, Sec. 4: the draft model's confidence approximates a node's chance of acceptance). A path's
    probability never exceeds its parent's, so the kept set is closed under taking parents."""
    path: list[float] = []
    for p, parent in zip(node_probs, parents):
        path.append(float(p) * (path[parent] if parent >= 0 else 1.0))
    return [i for i, p in enumerate(path) if p >= least]

