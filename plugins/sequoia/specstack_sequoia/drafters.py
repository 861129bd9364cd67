"""Tree drafters: a draft model growing a Sequoia tree, and prompt lookup offering several matches.

:class:`SequoiaDrafter` follows a :class:`~specstack_sequoia.shape.TreeShape` (Chen et al., 2024,
"Sequoia: Scalable, Robust, and Hardware-aware Speculative Decoding"). It grows the tree one depth
per forward pass of its model: ``CachedModel.tree_logits`` scores the tree so far (row 0 after the
prefix, row i + 1 after node i), every frontier node draws its children from its row, and
``accept_path([])`` drops the tree from the draft's cache (the tokens the level above accepts come
back next round as part of the prefix). A tree of depth D costs D draft forwards.

:class:`TreeLookupDrafter` is model-free: prompt lookup that offers the continuations of several
earlier matches at once, merged into one trie, found in prompt lookup's n-gram index.
"""

from __future__ import annotations

from typing import ClassVar, Sequence

import attrs
import numpy as np
import torch

from specstack import Draft, LevelStats, SpecstackError, warp
from specstack.drafters import Drafter, LookupChances, ModelLevel
from specstack.ngrams import LOOKBACK, NgramIndex, by_agreement
from specstack.sampling import draw, draw_without_replacement, race_arrivals
from specstack.speedup import paying_nodes, subtree_parents
from specstack.types import DraftKind, as_tokens

from .shape import TreeShape

DEFAULT_TREE = "binary:3"


@attrs.define(eq=False, kw_only=True)
class _Growing:
    """A draft tree under construction, breadth first: tokens, parents and each node's q row."""

    vocab: int
    device: torch.device
    tokens: list[int] = attrs.field(factory=list)
    parents: list[int] = attrs.field(factory=list)
    rows: list[torch.Tensor] = attrs.field(factory=list)  # [V] each: q after the node's parent

    def add(self, token: int, parent: int, q: torch.Tensor) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.rows.append(q)
        return len(self.tokens) - 1

    def draft(self, kind: DraftKind) -> Draft:
        if not self.tokens:
            return Draft.empty(self.vocab, device=self.device)
        probs = torch.stack(self.rows)  # [k, V] on the drafting model's device
        return Draft(tokens=torch.tensor(self.tokens, dtype=torch.long, device=probs.device), probs=probs,  # [k]
                     parents=torch.tensor(self.parents, dtype=torch.long, device=probs.device), kind=kind)


def _kind(drafter: "SequoiaDrafter") -> DraftKind:
    if drafter.deterministic or drafter.sampling.deterministic:
        return DraftKind.TREE_DETERMINISTIC
    return DraftKind.TREE_WITH_REPLACEMENT if drafter.replacement else DraftKind.TREE_WITHOUT_REPLACEMENT


def race(q: torch.Tensor, count: int, generator: torch.Generator) -> list[int]:
    """``count`` tokens drawn from q [V] one after another without replacement (fewer when q's
    support is smaller): the first arrivals of the exponential race, arrival time -log(u) / q(x)."""
    return draw_without_replacement(q, min(count, int((q > 0).sum())), generator).tolist()


@attrs.define(eq=False, kw_only=True)
class SequoiaDrafter(ModelLevel):
    """Draws a token tree of a fixed shape from a draft model (Chen et al., 2024, Sec. 3.1).

    At a node with c children in the shape, with q = warp(logits after the node):

    * without replacement (the default, ``TREE_WITHOUT_REPLACEMENT``): the exponential race
      ``(u.log() / q).topk(c)``, u ~ U[0, 1)^V, in the race's order — sequential sampling without
      replacement; c is capped at the size of q's support;
    * ``replacement=True`` (``TREE_WITH_REPLACEMENT``, SpecInfer): c independent draws from q;
    * ``deterministic=True``, and always at temperature 0 (``TREE_DETERMINISTIC``): the c tokens
      with the largest logits;
    * coupled sampling (``TREE_DETERMINISTIC``): the first c arrivals of the race on the stack's noise at the
      children's position (``specstack.sampling``), the first being the draw plain coupled decoding would make.

    Every child's ``probs`` row is q after its parent. A stop token gets no children, and
    ``propose(prefix, n)`` grows at most ``n`` levels.
    """

    name: ClassVar[str] = "sequoia"

    shape: TreeShape = attrs.field(default=DEFAULT_TREE, converter=TreeShape.parse)
    replacement: bool = False
    deterministic: bool = False
    draft_kind: DraftKind = attrs.field(init=False, default=attrs.Factory(_kind, takes_self=True))

    def propose(self, prefix: Sequence[int], n: int) -> Draft:
        tree = _Growing(vocab=self.vocab_size, device=self.lm.device)
        frontier = [(-1, -1)]  # (node in the draft, node in the shape); -1: the root
        for depth in range(min(n, self.shape.depth)):  # the frontier's children are at this depth
            logits = self._logits(prefix, tree)  # [k+1, V] on the model's device, where this level's generator is
            q = warp(logits, self.sampling.marginal)  # [k+1, V]
            grown = []
            for node, at in frontier:
                slots = self.shape.children(at)
                for token, slot in zip(self._children(logits[node + 1], q[node + 1], len(slots), len(prefix) + depth), slots):
                    child = tree.add(token, node, q[node + 1])
                    if token not in self.stop_tokens and self.shape.children(slot):
                        grown.append((child, slot))
            frontier = grown
            if not frontier:
                break
        draft = tree.draft(self.draft_kind)
        self.lm.stats.drafted += len(draft)
        return draft

    def _logits(self, prefix: Sequence[int], tree: _Growing) -> torch.Tensor:
        """[k+1, V]: after the prefix and after each node of the tree so far, in one forward."""
        if not tree.tokens:
            return self.lm.logits(prefix, 1)  # [1, V]
        logits = self.lm.tree_logits(prefix, tree.draft(self.draft_kind))  # [k+1, V]
        self.lm.accept_path([])  # the draft's cache keeps the committed tokens only
        return logits

    def _children(self, logits: torch.Tensor, q: torch.Tensor, count: int, position: int) -> list[int]:
        """``count`` children at ``position`` of a node with ``logits`` [V] and q [V], as the draft kind says."""
        if self.sampling.coupled and not self.sampling.greedy and not self.deterministic:
            at = torch.tensor(position, device="cpu")
            return race_arrivals(q, self.generator.initial_seed(), at, min(count, int((q > 0).sum()))).tolist()
        if self.draft_kind is DraftKind.TREE_DETERMINISTIC:
            return logits.topk(min(count, logits.shape[0])).indices.tolist()
        if self.draft_kind is DraftKind.TREE_WITH_REPLACEMENT:
            return draw(q, self.generator, count).tolist()  # i.i.d. draws from q (inverse CDF)
        return race(q, count, self.generator)


Branch = tuple[tuple[int, int], tuple[int, ...]]  # ((match length, rank among the branches), its continuation)


@attrs.define(eq=False, kw_only=True)
class TreeLookupDrafter(Drafter):
    """Prompt lookup with branches: the continuations of up to ``branches`` earlier occurrences of the
    last ``max_ngram`` … ``min_ngram`` tokens, each at most ``n`` tokens, merged into one trie (a shared
    prefix is proposed once). Longer n-grams first; of an n-gram's latest CANDIDATES occurrences, the
    ones whose preceding tokens agree longest with the text's first (compared up to ``lookback`` tokens
    back, :func:`specstack.ngrams.by_agreement`; ties, and ``lookback=0``: the latest first).

    Deterministic (``TREE_DETERMINISTIC``, one-hot ``probs`` rows); siblings are tried in the order
    of the matches that introduced them. When nothing matches the draft is empty and the level above
    samples on its own. The search is prompt lookup's incremental index
    (:class:`~specstack.ngrams.NgramIndex`): O(γ) a round, no scan of the context.

    Once priced (:meth:`price`: the tuner tells it what the level above's forward of 1, 2, … tokens costs), a round
    drafts only the nodes that pay (:func:`specstack.speedup.best_count`): the likeliest, each node's chance that the
    text will follow the trie down to it estimated as its parent's times its branch's chance at its depth. A branch's
    chances are kept per match length and rank (the 1st, 2nd, … branch of a draft): at each depth, how often its token
    was the text's once its tokens before were (a running estimate, ACCEPTANCE_WEIGHT of the way to each outcome; a
    depth not yet seen taken as the deepest one seen). They are read off the text the level above writes after each
    draft, over the rounds until it leaves a branch or runs its length (:class:`specstack.drafters.LookupChances`),
    drafted nodes or not, so a branch priced out goes on being measured and needs no retry. What is drafted
    depends on earlier rounds only, never on the level's draws in this one, so verification stays exact (as with the
    Medusa heads' priced trees, docs/trees.md).
    """

    name: ClassVar[str] = "lookup-tree"
    draft_kind: ClassVar[DraftKind] = DraftKind.TREE_DETERMINISTIC

    vocab: int
    max_ngram: int = 3
    min_ngram: int = 1
    branches: int = 3
    lookback: int = LOOKBACK
    stats: LevelStats = attrs.field(factory=lambda: LevelStats(name="lookup-tree"))
    _index: NgramIndex = attrs.field(init=False)
    _verify_seconds: tuple[float, ...] = attrs.field(init=False, default=())  # the level above's forward of 1, 2, … tokens (price); (): no pricing
    _chances: LookupChances = attrs.field(init=False, factory=LookupChances)  # per (match length, rank), at each depth

    def __attrs_post_init__(self) -> None:
        if not (_is_int(self.min_ngram) and _is_int(self.max_ngram) and 1 <= self.min_ngram <= self.max_ngram):
            raise SpecstackError(f"n-gram range {self.min_ngram!r}..{self.max_ngram!r} is not allowed; need integers 1 <= min_ngram <= max_ngram")
        if not (_is_int(self.branches) and self.branches >= 1):
            raise SpecstackError(f"lookup-tree branches {self.branches!r} is not allowed; use an integer >= 1")
        if not (_is_int(self.lookback) and self.lookback >= 0):
            raise SpecstackError(f"lookup-tree lookback {self.lookback!r} is not allowed; use a whole number >= 0 (0: the latest occurrences first)")
        self._index = NgramIndex(max_ngram=self.max_ngram, min_ngram=self.min_ngram)

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def reset(self) -> None:
        self._index.clear()
        self._chances.clear()  # equal seeds, equal drafts

    def price(self, verify_seconds: Sequence[float]) -> bool:
        self._verify_seconds = tuple(verify_seconds)
        self._chances.clear()
        return True

    def prefill(self, prompt: Sequence[int]) -> None:
        self._index.catch_up(as_tokens(prompt))

    def propose(self, prefix: Sequence[int], n: int) -> Draft:
        prefix = as_tokens(prefix)
        seq = prefix.array()  # [L]
        self._chances.read(seq, self._index.catch_up(prefix))
        branches = self._matches(seq, n)
        tokens, parents, owners, depths = _trie([continuation for _, continuation in branches])
        if self._verify_seconds:
            for key, continuation in branches:
                self._chances.show(key, continuation, seq.shape[0])
            tokens, parents = self._paying(tokens, parents, [self._chances.rate(branches[owner][0], depth) for owner, depth in zip(owners, depths)])
        self.stats.drafted += len(tokens)
        if not tokens:
            return Draft.empty(self.vocab)
        host = torch.device("cpu")  # model-free: the verifying level moves the draft to its device
        ids = torch.tensor(tokens, dtype=torch.long, device=host)  # [k]
        probs = torch.zeros(len(tokens), self.vocab, device=host).scatter_(1, ids[:, None], 1.0)  # [k, V]
        return Draft(tokens=ids, probs=probs, parents=torch.tensor(parents, dtype=torch.long, device=host), kind=self.draft_kind)

    def _matches(self, seq: np.ndarray, n: int) -> list[Branch]:
        """Up to ``branches`` continuations, each adding at least one node to the trie, with their keys."""
        found: list[Branch] = []
        for size in range(min(self.max_ngram, seq.shape[0] - 1), self.min_ngram - 1, -1):
            for end in by_agreement(seq, self._index.earlier(seq, size), self.lookback):
                continuation = tuple(seq[end + 1 : end + 1 + n].tolist())
                if continuation and not any(seen[: len(continuation)] == continuation for _, seen in found):
                    found.append(((size, len(found)), continuation))
                    if len(found) == self.branches:
                        return found
        return found

    def _paying(self, tokens: list[int], parents: list[int], rates: list[float]) -> tuple[list[int], list[int]]:
        """The trie's nodes worth a forward at the priced costs, renumbered: the likeliest first, as many as pay
        (a node's reach: its parent's times its own ``rates`` entry, so never above its parent's)."""
        reach: list[float] = []
        for parent, rate in zip(parents, rates):
            reach.append((reach[parent] if parent >= 0 else 1.0) * rate)
        kept = paying_nodes(reach, range(len(tokens)), self._verify_seconds)
        return [tokens[i] for i in kept], subtree_parents(kept, parents)

    def level_stats(self) -> list[LevelStats]:
        return [self.stats]


def _trie(continuations: list[tuple[int, ...]]) -> tuple[list[int], list[int], list[int], list[int]]:
    """The continuations merged into one trie: each node's token, parent (-1: a root), the continuation that
    introduced it and its depth."""
    tokens, parents, owners, depths, nodes = [], [], [], [], {}  # nodes: (parent, token) -> index in the trie
    for owner, continuation in enumerate(continuations):
        node = -1
        for depth, token in enumerate(continuation):
            if (node, token) not in nodes:
                nodes[node, token] = len(tokens)
                tokens.append(token)
                parents.append(node)
                owners.append(owner)
                depths.append(depth)
            node = nodes[node, token]
    return tokens, parents, owners, depths


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
