"""No tensor of the hot path is made on the default device: the CPU half of the CUDA path.

Representative stacks (synthetic chains and trees, prompt lookup, retrieval, the H2O and Top-K oracle
plugins, and a tiny random-weight Llama in a TriForce stack) are built and run under
:class:`~specstack.testing.devices.DeviceGuard`, which fails on any tensor factory called from
specstack code without ``device=``. Each run must also give the same tokens as the same stack run
without the guard, so the guard changes nothing it lets through.
"""

from __future__ import annotations

import functools
from typing import Callable

import pytest
import torch

from specstack import Level, PromptLookupDrafter, SamplingConfig, SpeculationStack, StreamingLLM
from specstack.hf import HFCausalLM
from specstack.retrieval import Retrieval
from specstack.synthetic import SyntheticLM, greedy_decode
from specstack.testing.devices import DeviceGuard, DeviceMixingError, _example_without_device

GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = SamplingConfig(temperature=0.8)
COUPLED = SamplingConfig(temperature=0.8, coupled=True)
SAMPLINGS = pytest.mark.parametrize("sampling", [GREEDY, SAMPLED, COUPLED], ids=["greedy", "t0.8", "t0.8-coupled"])
VOCAB = 6
PROMPT = [1, 2, 3, 0, 2, 1, 3, 3, 0, 1, 2, 2, 3, 1, 0, 0, 2, 3, 1, 2, 4, 5, 1, 2, 3]  # long enough to evict and gather
REPEATING = [1, 2, 3, 4, 1, 2, 3, 4, 5, 1, 2, 3, 4, 1, 2]  # prompt lookup finds matches
NEW_TOKENS = 16


def _guarded_equals_unguarded(build: Callable[[], SpeculationStack], prompt: list[int], n: int = NEW_TOKENS) -> tuple[SpeculationStack, tuple[int, ...]]:
    """Run a fresh stack from ``build`` without and then with the guard; both must give the same tokens.
    Building happens under the guard too (models, caches and policies make tensors when built)."""
    expected = build().generate(prompt, n).tokens
    with DeviceGuard():
        stack = build()
        tokens = stack.generate(prompt, n).tokens
    assert tokens == expected
    assert 0 < len(tokens) <= n
    return stack, tokens


def _synthetic() -> tuple[SyntheticLM, SyntheticLM]:
    target = SyntheticLM(vocab_size=VOCAB, seed=31, sharpness=1.5)
    return target, SyntheticLM(vocab_size=VOCAB, seed=32, base=target, noise=1.0)


# -- the guard itself ------------------------------------------------------------------------------


def test_the_guard_flags_a_factory_without_device_in_specstack_only() -> None:
    with DeviceGuard():
        with pytest.raises(DeviceMixingError) as error:
            _example_without_device()
        assert _example_without_device("cpu").shape == (3,)  # named device: passes
        assert torch.zeros(3).shape == (3,)  # called from a test, outside specstack: passes
        assert torch.zeros_like(torch.ones(3, device="cpu")).shape == (3,)  # *_like inherits its device
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("torch.zeros called without device= at specstack/testing/devices.py:")
    _example_without_device()  # no guard, no error


def test_the_guard_can_survey_without_raising() -> None:
    with DeviceGuard(strict=False) as guard:
        _example_without_device()
        _example_without_device()
    assert len(guard.sites) == 2 and guard.sites[0] == guard.sites[1]


# -- synthetic stacks ------------------------------------------------------------------------------


@SAMPLINGS
def test_streaming_draft_under_a_retrieval_level(sampling) -> None:
    def build() -> SpeculationStack:
        target, draft = _synthetic()
        levels = [Level(model=draft, policy=StreamingLLM(sinks=2, window=6)),
                  Level(model=target, policy=Retrieval(budget=8, chunk_size=2, stride=2, reserve=8), gamma=2),
                  Level(model=target, gamma=3)]
        return SpeculationStack.build(levels, sampling=sampling, seed=4)

    stack, tokens = _guarded_equals_unguarded(build, PROMPT)
    assert stack.top.drafter.lm.stats.gathers > 0  # the retrieval path did run under the guard
    if sampling.temperature == 0:
        assert list(tokens) == greedy_decode(_synthetic()[0], PROMPT, NEW_TOKENS)


@SAMPLINGS
def test_prompt_lookup_at_level_0(sampling) -> None:
    def build() -> SpeculationStack:
        target = SyntheticLM(vocab_size=VOCAB, seed=31, sharpness=1.5)
        middle = SyntheticLM(vocab_size=VOCAB, seed=33, support=(1, 2, 3, 4))
        levels = [Level(drafter=PromptLookupDrafter(vocab=VOCAB)), Level(model=middle, gamma=3), Level(model=target, gamma=3)]
        return SpeculationStack.build(levels, sampling=sampling, seed=5)

    _guarded_equals_unguarded(build, REPEATING)


@pytest.mark.parametrize(("sampling", "options"), [
    (GREEDY, {}),
    (SAMPLED, {}),
    (SAMPLED, {"replacement": True}),
    (SamplingConfig(temperature=0.8, top_k=2), {"deterministic": True}),
    (COUPLED, {}),
], ids=["greedy", "t0.8", "t0.8-replacement", "t0.8-k2-deterministic", "t0.8-coupled"])
def test_sequoia_tree_at_level_0(sampling, options) -> None:
    """Trees of every kind, so every tree verifier runs: drawn without and with replacement, and
    deterministic (greedy; and sampled, with a sibling outside top-k 2); then prompt lookup with branches."""
    from specstack_sequoia import SequoiaDrafter, TreeLookupDrafter

    def build() -> SpeculationStack:
        target, draft = _synthetic()
        tree = Level(model=draft, model_drafter=functools.partial(SequoiaDrafter, shape="widths:3,2", **options))
        levels = [tree, Level(model=target, policy=Retrieval(budget=8, chunk_size=2, stride=2, reserve=16), gamma=2),
                  Level(model=target, gamma=3)]
        return SpeculationStack.build(levels, sampling=sampling, seed=9)

    _guarded_equals_unguarded(build, PROMPT)

    def build_lookup() -> SpeculationStack:
        target, _ = _synthetic()
        levels = [Level(drafter=TreeLookupDrafter(vocab=VOCAB, branches=3)), Level(model=target, gamma=3)]
        return SpeculationStack.build(levels, sampling=sampling, seed=7)

    _guarded_equals_unguarded(build_lookup, REPEATING)


def test_stop_tokens_cut_chains_and_trees() -> None:
    from specstack_sequoia import SequoiaDrafter, TreeLookupDrafter

    def build(tree: bool) -> SpeculationStack:
        target, draft = _synthetic()
        below = Level(model=draft, model_drafter=functools.partial(SequoiaDrafter, shape="widths:3,2")) if tree else Level(model=draft)
        return SpeculationStack.build([below, Level(model=target, gamma=4)], sampling=SAMPLED, seed=4, stop_tokens=(1,))

    for tree in (False, True):
        stack, tokens = _guarded_equals_unguarded(functools.partial(build, tree), PROMPT)
        assert tokens[-1] == 1 and len(tokens) < NEW_TOKENS

    def build_lookup() -> SpeculationStack:  # the lookup tree has inner stop tokens: the cut drops their subtrees
        levels = [Level(drafter=TreeLookupDrafter(vocab=VOCAB, branches=3)), Level(model=_synthetic()[0], gamma=3)]
        return SpeculationStack.build(levels, sampling=SAMPLED, seed=7, stop_tokens=(3,))

    _guarded_equals_unguarded(build_lookup, REPEATING)


@pytest.mark.parametrize("policy", ["h2o", "topk-oracle"])
@SAMPLINGS
def test_plugin_policies_at_the_middle_level(policy, sampling) -> None:
    from specstack_h2o import H2O
    from specstack_topk_oracle import TopKOracle

    def build() -> SpeculationStack:
        target, draft = _synthetic()
        middle = H2O(budget=8, recent=4, reserve=4) if policy == "h2o" else TopKOracle(budget=8, stride=2)
        levels = [Level(model=draft), Level(model=target, policy=middle, gamma=2), Level(model=target, gamma=3)]
        return SpeculationStack.build(levels, sampling=sampling, seed=4)

    _guarded_equals_unguarded(build, PROMPT)


# -- a tiny random-weight Llama --------------------------------------------------------------------


@pytest.fixture(scope="module")
def llamas() -> tuple[HFCausalLM, HFCausalLM]:
    from specstack.testing.llama import random_llama

    return random_llama(seed=0, name="tiny"), random_llama(seed=1, name="tiny-draft")  # target, draft


@SAMPLINGS
def test_triforce_shaped_stack_on_a_tiny_llama(llamas, sampling) -> None:
    prompt = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(2)).tolist()

    def build() -> SpeculationStack:
        target, draft = llamas
        levels = [Level(model=draft, policy=StreamingLLM(sinks=4, window=28)),
                  Level(model=target, policy=Retrieval(budget=32, chunk_size=8, stride=16, reserve=16), gamma=2),
                  Level(model=target, gamma=4)]
        return SpeculationStack.build(levels, sampling=sampling, seed=3)

    stack, _ = _guarded_equals_unguarded(build, prompt, 20)
    assert stack.top.drafter.lm.stats.gathers > 0
