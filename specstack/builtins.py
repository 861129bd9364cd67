"""The built-in components, registered through the same hooks as any third-party plugin."""

from __future__ import annotations

from .drafters import PromptLookupDrafter
from .hookspecs import hookimpl
from .policies import FullCache, StreamingLLM
from .retrieval import Retrieval
from .recipes import StackRecipe
from .stack import Level
from .verify import GreedyVerifier, SpeculativeSamplingVerifier


@hookimpl
def specstack_cache_policies() -> list:
    return [FullCache, StreamingLLM, Retrieval]


@hookimpl
def specstack_drafters() -> list:
    return [PromptLookupDrafter]


@hookimpl
def specstack_verifiers() -> list:
    return [GreedyVerifier, SpeculativeSamplingVerifier]


def _autoregressive(registry, *, target) -> list[Level]:
    return [Level(model=target, name="target")]


def _speculative(registry, *, target, draft, gamma: int = 4) -> list[Level]:
    return [Level(model=draft, name="draft"), Level(model=target, gamma=gamma, name="target")]


def _prompt_lookup(registry, *, target, gamma: int = 4, max_ngram: int = 3) -> list[Level]:
    lookup = registry.drafter("prompt-lookup", vocab=target.vocab_size, max_ngram=max_ngram)
    return [Level(drafter=lookup), Level(model=target, gamma=gamma, name="target")]


@hookimpl
def specstack_stacks() -> list:
    return [
        StackRecipe(name="autoregressive", description="the target alone, one token per forward pass", build=_autoregressive),
        StackRecipe(name="speculative", description="draft model -> target (classic speculative decoding)", build=_speculative, needs_draft=True),
        StackRecipe(name="prompt-lookup", description="n-gram prompt lookup -> target", build=_prompt_lookup),
    ]
