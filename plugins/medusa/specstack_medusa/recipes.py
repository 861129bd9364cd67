"""The Medusa and EAGLE stacks, in the style of :mod:`specstack.builtins` (whose helpers they reuse). The level
verifying the heads' tree asks for as many tokens as the tree is deep (the heads, plus one)."""

from __future__ import annotations

from specstack import MergedDrafter, Retrieval, StackRecipe
from specstack.builtins import _full, _view
from specstack.ngrams import LOOKBACK
from specstack.retrieval import AUTO, STRIDE
from specstack.stack import Level

from .drafter import MIN_PROB
from .eagle import EagleLayer, synthetic_layer
from .heads import MedusaHeads, synthetic_heads


def _synthetic(vocab: int) -> dict:
    return {"heads": synthetic_heads(vocab, token_input=True)}


def _synthetic_chain(vocab: int) -> dict:
    return {"heads": synthetic_heads(vocab, chained=True)}


def _synthetic_eagle(vocab: int) -> dict:
    return {"heads": synthetic_layer(vocab)}


def _heads(registry, target, heads: str | MedusaHeads | EagleLayer | None, tree_size: int, top_k: int, draft_vocab: int, min_prob: float,
           draft_temperature: float | str, drafter: str = "medusa") -> Level:
    return Level(drafter=registry.drafter(drafter, vocab=target.vocab_size, heads=heads, tree_size=tree_size, top_k=top_k, draft_vocab=draft_vocab,
                                          min_prob=min_prob, draft_temperature=draft_temperature))


def _medusa(registry, *, target, heads: str | MedusaHeads | None = None, tree_size: int = 4, top_k: int = 8, draft_vocab: int | None = None,
            min_prob: float = MIN_PROB, draft_temperature: float | str = 0.0) -> list[Level]:
    level0 = _heads(registry, target, heads, tree_size, top_k, draft_vocab, min_prob, draft_temperature)
    return [level0, _full(target, level0.drafter.step)]


def _medusa_chain(registry, *, target, heads: str | MedusaHeads | None = "chained", tree_size: int = 4, top_k: int = 8, draft_vocab: int | None = None,
                  min_prob: float = MIN_PROB, draft_temperature: float | str = 0.0) -> list[Level]:
    return _medusa(registry, target=target, heads=heads, tree_size=tree_size, top_k=top_k, draft_vocab=draft_vocab, min_prob=min_prob,
                   draft_temperature=draft_temperature)


def _triforce_medusa(registry, *, target, heads: str | MedusaHeads | None = None, tree_size: int = 4, top_k: int = 8, draft_vocab: int | None = None, min_prob: float = MIN_PROB, draft_temperature: float | str = 0.0, gamma2: int = 6,
                     budget: int | str = AUTO, chunk_size: int = 8, stride: int = STRIDE) -> list[Level]:
    level0 = _heads(registry, target, heads, tree_size, top_k, draft_vocab, min_prob, draft_temperature)
    return _over_retrieval(target, level0, gamma2, budget, chunk_size, stride)


def _over_retrieval(target, level0: Level, gamma2: int, budget: int | str, chunk_size: int, stride: int) -> list[Level]:
    """TriForce's two upper levels over a tree drafter at ``level0``: the target over its retrieval view, asking for
    as many tokens as the tree is deep, then the target over its full cache."""
    retrieval = Retrieval(budget=budget, chunk_size=chunk_size, stride=stride)
    return [level0, _view(target, retrieval, level0.drafter.step), _full(target, gamma2)]


def _lookup_and_heads(registry, target, heads, tree_size: int, top_k: int, draft_vocab: int | None, min_prob: float, draft_temperature: float | str,
                      max_ngram: int, min_ngram: int, first_only: bool, lookback: int, drafter: str = "medusa") -> Level:
    """Level 0 of the lookup stacks: prompt lookup and the heads (or the EAGLE layer) merged into one drafter."""
    level0 = _heads(registry, target, heads, tree_size, top_k, draft_vocab, min_prob, draft_temperature, drafter)
    lookup = registry.drafter("prompt-lookup", vocab=target.vocab_size, max_ngram=max_ngram, min_ngram=min_ngram, lookback=lookback)
    return Level(drafter=MergedDrafter(parts=(lookup, level0.drafter), first_only=first_only))


def _medusa_lookup(registry, *, target, heads: str | MedusaHeads | None = "chained", tree_size: int = 4, top_k: int = 8, draft_vocab: int | None = None,
                   min_prob: float = MIN_PROB, draft_temperature: float | str = 0.0, max_ngram: int = 3, min_ngram: int = 3, first_only: bool = True, lookback: int = LOOKBACK) -> list[Level]:
    level0 = _lookup_and_heads(registry, target, heads, tree_size, top_k, draft_vocab, min_prob, draft_temperature, max_ngram, min_ngram, first_only,
                              lookback)
    return [level0, _full(target, level0.drafter.step)]


def _triforce_medusa_lookup(registry, *, target, heads: str | MedusaHeads | None = "chained", tree_size: int = 4, top_k: int = 8,
                            draft_vocab: int | None = None, min_prob: float = MIN_PROB, draft_temperature: float | str = 0.0, max_ngram: int = 3, min_ngram: int = 3,
                            first_only: bool = True, lookback: int = LOOKBACK, gamma2: int = 6, budget: int | str = AUTO, chunk_size: int = 8,
                            stride: int = STRIDE) -> list[Level]:
    level0 = _lookup_and_heads(registry, target, heads, tree_size, top_k, draft_vocab, min_prob, draft_temperature, max_ngram, min_ngram, first_only,
                              lookback)
    return _over_retrieval(target, level0, gamma2, budget, chunk_size, stride)


def _eagle(registry, *, target, heads: str | EagleLayer | None = "eagle", tree_size: int = 4, top_k: int = 8, draft_vocab: int | None = None,
           min_prob: float = MIN_PROB, draft_temperature: float | str = 0.0) -> list[Level]:
    level0 = _heads(registry, target, heads, tree_size, top_k, draft_vocab, min_prob, draft_temperature, "eagle")
    return [level0, _full(target, level0.drafter.step)]


def _eagle_lookup(registry, *, target, heads: str | EagleLayer | None = "eagle", tree_size: int = 4, top_k: int = 8, draft_vocab: int | None = None,
                  min_prob: float = MIN_PROB, draft_temperature: float | str = 0.0, max_ngram: int = 3, min_ngram: int = 3, first_only: bool = True,
                  lookback: int = LOOKBACK) -> list[Level]:
    level0 = _lookup_and_heads(registry, target, heads, tree_size, top_k, draft_vocab, min_prob, draft_temperature, max_ngram, min_ngram, first_only,
                              lookback, "eagle")
    return [level0, _full(target, level0.drafter.step)]


def _triforce_eagle_lookup(registry, *, target, heads: str | EagleLayer | None = "eagle", tree_size: int = 4, top_k: int = 8,
                           draft_vocab: int | None = None, min_prob: float = MIN_PROB, draft_temperature: float | str = 0.0, max_ngram: int = 3,
                           min_ngram: int = 3, first_only: bool = True, lookback: int = LOOKBACK, gamma2: int = 6, budget: int | str = AUTO,
                           chunk_size: int = 8, stride: int = STRIDE) -> list[Level]:
    level0 = _lookup_and_heads(registry, target, heads, tree_size, top_k, draft_vocab, min_prob, draft_temperature, max_ngram, min_ngram, first_only,
                              lookback, "eagle")
    return _over_retrieval(target, level0, gamma2, budget, chunk_size, stride)


RECIPES = [
    StackRecipe(name="medusa", description="Medusa heads on the target's hidden state (a tree) -> target (-o tree_size=4)", build=_medusa,
                conformance_options=_synthetic),
    StackRecipe(name="medusa-chain", description="chained heads (one head, step after step, EAGLE-style) on the target's hidden state (a tree) -> target",
                build=_medusa_chain, conformance_options=_synthetic_chain),
    StackRecipe(name="triforce-medusa", description="Medusa heads on the middle level's hidden state -> target+Retrieval -> target",
                build=_triforce_medusa, conformance_options=_synthetic),
    StackRecipe(name="medusa-lookup", description="prompt lookup's chain where it matches 3+ tokens, else chained Medusa heads' tree -> target",
                build=_medusa_lookup, conformance_options=_synthetic),
    StackRecipe(name="triforce-medusa-lookup",
                description="medusa-lookup's draft on the middle level's hidden state -> target+Retrieval -> target",
                build=_triforce_medusa_lookup, conformance_options=_synthetic),
    StackRecipe(name="eagle", description="EAGLE's draft layer over the target's features (a tree) -> target", build=_eagle,
                conformance_options=_synthetic_eagle),
    StackRecipe(name="eagle-lookup", description="prompt lookup's chain where it matches 3+ tokens, else EAGLE's tree -> target",
                build=_eagle_lookup, conformance_options=_synthetic_eagle),
    StackRecipe(name="triforce-eagle-lookup", description="eagle-lookup's draft on the middle level's hidden state -> target+Retrieval -> target",
                build=_triforce_eagle_lookup, conformance_options=_synthetic_eagle),
]
