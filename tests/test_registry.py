"""The registry: built-ins through the same hooks as third-party plugins, clear errors."""

from __future__ import annotations

import types

import pytest

from specstack import EvictionPolicy, Kind, Registry, SpecstackError, StreamingLLM
from specstack.hookspecs import hookimpl
from specstack.registry import PluginWarning


def test_builtins_are_registered_through_hooks(registry) -> None:
    assert registry.names(Kind.CACHE_POLICY) == ["full", "retrieval", "streaming"]
    assert registry.names(Kind.VERIFIER) == ["block", "greedy", "sequoia", "specinfer", "speculative", "token-tree"]
    assert {"autoregressive", "speculative", "prompt-lookup"} <= set(registry.names(Kind.STACK))
    assert registry.entry(Kind.CACHE_POLICY, "full").plugin == "specstack.builtins"


def test_an_empty_registry_has_nothing() -> None:
    empty = Registry.create(builtins=False, entry_points=False)
    assert all(empty.names(kind) == [] for kind in Kind)
    with pytest.raises(SpecstackError, match="unknown cache policy 'full'; available: none"):
        empty.cache_policy("full")


def test_unknown_names_list_what_is_available(registry) -> None:
    with pytest.raises(SpecstackError, match="unknown cache policy 'x'; available: full, retrieval, streaming"):
        registry.cache_policy("x")
    with pytest.raises(SpecstackError, match="unknown verifier 'nope'; available: block, greedy, sequoia, specinfer, speculative, token-tree"):
        registry.verifier("nope")


def test_parameters_are_checked(registry) -> None:
    assert isinstance(registry.cache_policy("streaming", sinks=4, window=64), StreamingLLM)
    with pytest.raises(SpecstackError, match="cache policy 'streaming' has no parameter 'size'; parameters: sinks, window, budget"):
        registry.cache_policy("streaming", size=3)


class Recent(EvictionPolicy):
    name = "recent"

    def select(self, state):
        raise NotImplementedError


def plugin_module(**hooks) -> types.ModuleType:
    module = types.ModuleType("thirdparty")
    for name, fn in hooks.items():
        setattr(module, name, hookimpl(fn))
    return module


def test_a_plugin_object_registers_components() -> None:
    registry = Registry.create(entry_points=False, plugins=[plugin_module(specstack_cache_policies=lambda: [Recent])])
    assert "recent" in registry.names(Kind.CACHE_POLICY)
    assert registry.entry(Kind.CACHE_POLICY, "recent").plugin == "thirdparty"


def test_a_name_registered_twice_is_reported_and_the_first_kept() -> None:
    class Impostor(Recent):
        name = "streaming"

    with pytest.warns(PluginWarning, match="cache policy 'streaming' is already registered by specstack.builtins"):
        registry = Registry.create(entry_points=False, plugins=[plugin_module(specstack_cache_policies=lambda: [Impostor])])
    assert registry.entry(Kind.CACHE_POLICY, "streaming").component is StreamingLLM


def test_a_misspelled_hook_is_reported_and_other_plugins_keep_working() -> None:
    with pytest.warns(PluginWarning, match="unknown hook 'specstack_cache_policys'"):
        registry = Registry.create(entry_points=False, plugins=[plugin_module(specstack_cache_policys=lambda: [Recent])])
    assert registry.names(Kind.CACHE_POLICY) == ["full", "retrieval", "streaming"]
    assert registry.problems[0].plugin == "thirdparty"


def test_a_failing_hook_is_reported() -> None:
    def broken():
        raise RuntimeError("weights missing")

    with pytest.warns(PluginWarning, match="hook specstack_cache_policies failed: RuntimeError: weights missing"):
        registry = Registry.create(entry_points=False, plugins=[plugin_module(specstack_cache_policies=broken)])
    assert "full" in registry.names(Kind.CACHE_POLICY)


def test_recipes_build_stacks_by_name(registry) -> None:
    from specstack.synthetic import SyntheticLM, greedy_decode

    target = SyntheticLM(vocab_size=6, seed=1)
    draft = SyntheticLM(vocab_size=6, seed=2, base=target, noise=0.5)
    for name, extra in [("autoregressive", {}), ("speculative", {"draft": draft, "gamma": 3}), ("prompt-lookup", {}),
                        ("prompt-lookup", {"min_ngram": 2, "gamma": 1})]:
        stack = registry.stack(name, target=target, **extra)
        assert list(stack.generate([1, 2], 12).tokens) == greedy_decode(target, [1, 2], 12)
    lookup = registry.stack("prompt-lookup", target=target, min_ngram=2).top.drafter
    assert (lookup.min_ngram, lookup.max_ngram) == (2, 3)
    with pytest.raises(SpecstackError, match="stack 'speculative' needs a draft model"):
        registry.stack("speculative", target=target)
    with pytest.raises(SpecstackError, match="stack 'speculative' has no option 'gama'; options: gamma"):
        registry.stack("speculative", target=target, draft=draft, gama=2)
