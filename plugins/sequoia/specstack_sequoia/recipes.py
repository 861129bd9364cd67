"""Stacks with a token tree at level 0, in the style of :mod:`specstack.builtins` (whose helpers they
reuse). A ``tree`` option is a :class:`~specstack_sequoia.shape.TreeShape` or its spec string
(``-o tree=widths:4,2,1`` on the command line); the level verifying the tree asks for as many tokens
as the tree is deep."""

from __future__ import annotations

import functools

import attrs

from specstack import Retrieval, StackRecipe
from specstack.builtins import _full, _streaming_draft, _view
from specstack.ngrams import LOOKBACK
from specstack.retrieval import AUTO, STRIDE
from specstack.stack import Level

from .drafters import DEFAULT_TREE, SequoiaDrafter
from .shape import TreeShape


def _tree_draft(draft, shape: TreeShape, sinks: int, draft_window: int, draft_vocab: int, replacement: bool = False) -> Level:
    """The draft model over a StreamingLLM cache, growing trees of ``shape`` from its ``draft_vocab`` most frequent tokens (0: all)."""
    drafting = functools.partial(SequoiaDrafter, shape=shape, replacement=replacement)
    return attrs.evolve(_streaming_draft(draft, sinks, draft_window, draft_vocab), model_drafter=drafting, name="draft+sequoia")


def _sequoia(registry, *, target, draft, tree: TreeShape | str = DEFAULT_TREE, draft_window: int = 256, sinks: int = 16,
             replacement: bool = False, draft_vocab: int = 0) -> list[Level]:
    shape = TreeShape.parse(tree)
    return [_tree_draft(draft, shape, sinks, draft_window, draft_vocab, replacement), _full(target, shape.depth)]


def _triforce_tree(registry, *, target, draft, tree: TreeShape | str = "binary:2", gamma2: int = 6, budget: int | str = AUTO, chunk_size: int = 8,
                   stride: int = STRIDE, draft_window: int = 256, sinks: int = 16, draft_vocab: int = 0) -> list[Level]:
    shape = TreeShape.parse(tree)
    retrieval = Retrieval(budget=budget, chunk_size=chunk_size, stride=stride)
    return [_tree_draft(draft, shape, sinks, draft_window, draft_vocab), _view(target, retrieval, shape.depth), _full(target, gamma2)]


def _lookup_tree(registry, *, target, gamma: int = 4, max_ngram: int = 3, branches: int = 3, lookback: int = LOOKBACK) -> list[Level]:
    lookup = registry.drafter("lookup-tree", vocab=target.vocab_size, max_ngram=max_ngram, branches=branches, lookback=lookback)
    return [Level(drafter=lookup), _full(target, gamma)]


def _triforce_lookup_tree(registry, *, target, gamma1: int = 4, gamma2: int = 6, budget: int | str = AUTO, chunk_size: int = 8,
                          stride: int = STRIDE, max_ngram: int = 3, branches: int = 3, lookback: int = LOOKBACK) -> list[Level]:
    lookup = registry.drafter("lookup-tree", vocab=target.vocab_size, max_ngram=max_ngram, branches=branches, lookback=lookback)
    retrieval = Retrieval(budget=budget, chunk_size=chunk_size, stride=stride)
    return [Level(drafter=lookup), _view(target, retrieval, gamma1), _full(target, gamma2)]


RECIPES = [
    StackRecipe(name="sequoia", description="draft tree+StreamingLLM -> target (Sequoia; -o tree=binary:3)", build=_sequoia, needs_draft=True),
    StackRecipe(name="triforce-tree", description="draft tree+StreamingLLM -> target+Retrieval -> target (γ1 = tree depth)",
                build=_triforce_tree, needs_draft=True),
    StackRecipe(name="lookup-tree", description="prompt lookup with branches (a trie) -> target", build=_lookup_tree),
    StackRecipe(name="triforce-lookup-tree", description="prompt lookup with branches -> target+Retrieval -> target", build=_triforce_lookup_tree),
]
