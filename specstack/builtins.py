"""The built-in components, registered through the same hooks as any third-party plugin."""

from __future__ import annotations

import functools

import attrs

from .draft_vocabulary import with_draft_vocabulary
from .drafters import LookupFirstDrafter, PromptLookupDrafter
from .hookspecs import hookimpl
from .ngrams import LOOKBACK
from .policies import FullCache, StreamingLLM
from .retrieval import AUTO, STRIDE, Retrieval
from .recipes import StackRecipe
from .stack import Level
from .verify import BlockVerifier, GreedyVerifier, SequoiaVerifier, SpecInferVerifier, SpeculativeSamplingVerifier, TokenTreeVerifier


@hookimpl
def specstack_cache_policies() -> list:
    return [FullCache, StreamingLLM, Retrieval]


@hookimpl
def specstack_drafters() -> list:
    return [PromptLookupDrafter]


@hookimpl
def specstack_verifiers() -> list:
    return [GreedyVerifier, SpeculativeSamplingVerifier, BlockVerifier, SequoiaVerifier, SpecInferVerifier, TokenTreeVerifier]


def _autoregressive(registry, *, target) -> list[Level]:
    return [Level(model=target, name="target")]


def _speculative(registry, *, target, draft, gamma: int = 4, draft_vocab: int = 0) -> list[Level]:
    return [Level(model=with_draft_vocabulary(draft, draft_vocab), name="draft"), _full(target, gamma)]


def _prompt_lookup(registry, *, target, gamma: int = 4, max_ngram: int = 3, min_ngram: int = 1, lookback: int = LOOKBACK) -> list[Level]:
    """Prompt lookup into the target; ``min_ngram``: the shortest match it drafts from (docs/results.md, "Prompt
    lookup's shortest match and γ": on prose, drafting only from 3-token matches paid more than from any); ``lookback``:
    how far back its occurrences are compared with the text to choose one (0: the latest)."""
    lookup = registry.drafter("prompt-lookup", vocab=target.vocab_size, max_ngram=max_ngram, min_ngram=min_ngram, lookback=lookback)
    return [Level(drafter=lookup), _full(target, gamma)]


def _full(target, gamma: int) -> Level:
    """The target over its full cache: the top level of every speculative stack."""
    return Level(model=target, gamma=gamma, name="target")


def _view(target, policy, gamma: int | None = None) -> Level:
    """The target over a partial view of its KV cache chosen by ``policy``."""
    return Level(model=target, policy=policy, gamma=gamma, name=f"target+{policy.name}")


# TriForce and its ablations (Sun et al., 2024). Defaults: the paper's γ1 = 2, γ2 = 6, chunks of 8,
# a 16-sink + 256-token StreamingLLM draft cache; the retrieval budget is "auto", scaled with the
# context at every gather (about 1/16 of it: 512 at the 8K window of the embedded default, as the
# paper gathers 4K of 120K), so that the default stack fits any prompt length.


def _streaming_draft(draft, sinks: int, draft_window: int, draft_vocab: int) -> Level:
    """The draft over a StreamingLLM cache, drafting from its ``draft_vocab`` most frequent tokens (0: all;
    :mod:`specstack.draft_vocabulary`)."""
    return Level(model=with_draft_vocabulary(draft, draft_vocab), policy=StreamingLLM(sinks=sinks, window=draft_window), name="draft+streaming")


def _triforce(registry, *, target, draft, gamma1: int = 2, gamma2: int = 6, budget: int | str = AUTO, chunk_size: int = 8,
              stride: int = STRIDE, draft_window: int = 256, sinks: int = 16, draft_vocab: int = 0) -> list[Level]:
    retrieval = Retrieval(budget=budget, chunk_size=chunk_size, stride=stride)
    return [_streaming_draft(draft, sinks, draft_window, draft_vocab), _view(target, retrieval, gamma1), _full(target, gamma2)]


def _triforce_hybrid(registry, *, target, draft, gamma1: int = 2, gamma2: int = 6, budget: int | str = AUTO, chunk_size: int = 8,
                     stride: int = STRIDE, draft_window: int = 256, sinks: int = 16, max_ngram: int = 3, min_ngram: int = 3,
                     draft_vocab: int = 0, lookback: int = LOOKBACK) -> list[Level]:
    """TriForce whose level 0 copies where the text repeats: prompt lookup's chain where the last
    ``min_ngram``+ tokens occurred before, else the draft model's own chain (:class:`LookupFirstDrafter`)."""
    lookup = registry.drafter("prompt-lookup", vocab=target.vocab_size, max_ngram=max_ngram, min_ngram=min_ngram, lookback=lookback)
    draft_level, *above = _triforce(registry, target=target, draft=draft, gamma1=gamma1, gamma2=gamma2, budget=budget, chunk_size=chunk_size,
                                    stride=stride, draft_window=draft_window, sinks=sinks, draft_vocab=draft_vocab)
    return [attrs.evolve(draft_level, model_drafter=functools.partial(LookupFirstDrafter, lookup=lookup)), *above]


def _triforce_lookup(registry, *, target, gamma1: int = 4, gamma2: int = 6, budget: int | str = AUTO, chunk_size: int = 8,
                     stride: int = STRIDE, max_ngram: int = 3, lookback: int = LOOKBACK) -> list[Level]:
    lookup = registry.drafter("prompt-lookup", vocab=target.vocab_size, max_ngram=max_ngram, lookback=lookback)
    retrieval = Retrieval(budget=budget, chunk_size=chunk_size, stride=stride)
    return [Level(drafter=lookup), _view(target, retrieval, gamma1), _full(target, gamma2)]


def _retrieval_flat(registry, *, target, gamma: int = 6, budget: int | str = AUTO, chunk_size: int = 8, stride: int = STRIDE,
                    refresh_below: float = 0.0) -> list[Level]:
    retrieval = Retrieval(budget=budget, chunk_size=chunk_size, stride=stride, refresh_below=refresh_below)
    return [_view(target, retrieval), _full(target, gamma)]


def _named_policy(registry, name: str, budget: int | str):
    """A registered cache policy by name; budget "auto" leaves the budget to the policy's own default:
    "auto" again for retrieval (scaled with the context), a fixed size for the others."""
    return registry.cache_policy(name) if budget == AUTO else registry.cache_policy(name, budget=budget)


def _self_speculative(registry, *, target, policy: str = "retrieval", budget: int | str = AUTO, gamma: int = 6) -> list[Level]:
    return [_view(target, _named_policy(registry, policy, budget)), _full(target, gamma)]


def _hierarchical(registry, *, target, draft, policy: str = "retrieval", budget: int | str = AUTO, gamma1: int = 2, gamma2: int = 6,
                  draft_window: int = 256, sinks: int = 16, draft_vocab: int = 0) -> list[Level]:
    middle = _view(target, _named_policy(registry, policy, budget), gamma1)
    return [_streaming_draft(draft, sinks, draft_window, draft_vocab), middle, _full(target, gamma2)]


def _streaming_hierarchy(registry, *, target, draft, gamma1: int = 2, gamma2: int = 6, window: int = 512, sinks: int = 16,
                         draft_window: int = 256, draft_vocab: int = 0) -> list[Level]:
    middle = _view(target, StreamingLLM(sinks=sinks, window=window, relative_positions=False), gamma1)
    return [_streaming_draft(draft, sinks, draft_window, draft_vocab), middle, _full(target, gamma2)]


def _naive(registry, *, target, draft, gamma: int = 4, draft_window: int = 256, sinks: int = 16, draft_vocab: int = 0) -> list[Level]:
    return [_streaming_draft(draft, sinks, draft_window, draft_vocab), _full(target, gamma)]


@hookimpl
def specstack_stacks() -> list:
    return [
        StackRecipe(name="autoregressive", description="the target alone, one token per forward pass", build=_autoregressive),
        StackRecipe(name="speculative", description="draft model -> target (classic speculative decoding)", build=_speculative, needs_draft=True),
        StackRecipe(name="prompt-lookup", description="n-gram prompt lookup -> target", build=_prompt_lookup),
        StackRecipe(name="triforce", description="draft+StreamingLLM -> target+Retrieval -> target (TriForce)", build=_triforce, needs_draft=True),
        StackRecipe(name="triforce-hybrid", description="prompt lookup where it matches 3+ tokens, else draft+StreamingLLM -> target+Retrieval -> target",
                    build=_triforce_hybrid, needs_draft=True),
        StackRecipe(name="triforce-lookup", description="prompt lookup -> target+Retrieval -> target", build=_triforce_lookup),
        StackRecipe(name="retrieval-flat", description="target+Retrieval -> target (retrieval without hierarchy)", build=_retrieval_flat),
        StackRecipe(name="streaming-hierarchy", description="draft+StreamingLLM -> target+StreamingLLM -> target", build=_streaming_hierarchy, needs_draft=True),
        StackRecipe(name="self-speculative", description="target+POLICY -> target (any registered cache policy, by name)", build=_self_speculative),
        StackRecipe(name="hierarchical", description="draft+StreamingLLM -> target+POLICY -> target (TriForce with any policy)", build=_hierarchical, needs_draft=True),
        StackRecipe(name="naive", description="draft+StreamingLLM -> target (the paper's naive policy)", build=_naive, needs_draft=True),
    ]
