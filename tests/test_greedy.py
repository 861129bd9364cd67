"""Greedy stacks reproduce argmax decoding of the target token for token."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specstack import Level, SamplingConfig, SpeculationStack
from specstack.synthetic import SyntheticLM, greedy_decode

from .stacks import StackCase, stack_cases


@settings(max_examples=60)
@given(stack_cases(temperatures=(0.0,)), st.integers(1, 40), st.lists(st.integers(0, 2), min_size=1, max_size=8))
def test_greedy_stack_equals_argmax_decoding(device: str, case: StackCase, max_new_tokens: int, prompt: list[int]) -> None:
    stops = () if case.stop_token is None else (case.stop_token,)
    result = case.stack(device).generate(prompt, max_new_tokens)
    assert list(result.tokens) == greedy_decode(case.target(), prompt, max_new_tokens, stops)


def test_max_new_tokens_reached_in_the_middle_of_a_round(device: str) -> None:
    target = SyntheticLM(device=device, vocab_size=6, seed=1)
    stack = SpeculationStack.build([Level(model=target), Level(model=target, gamma=6)])
    result = stack.generate([1, 2, 3], 4)  # the round could emit 7 tokens; only 4 are wanted
    assert list(result.tokens) == greedy_decode(target, [1, 2, 3], 4)
    assert result.stopped_by == "max_new_tokens"


def test_repeated_generation_is_reproducible_and_independent_of_history(device: str) -> None:
    target = SyntheticLM(device=device, vocab_size=6, seed=2)
    draft = SyntheticLM(device=device, vocab_size=6, seed=3, base=target, noise=1.0)
    stack = SpeculationStack.build([Level(model=draft), Level(model=target, gamma=3)], sampling=SamplingConfig(temperature=1.0))
    first = stack.generate([1, 2], 20, seed=5)
    stack.generate([4, 4, 4], 20, seed=6)
    assert stack.generate([1, 2], 20, seed=5).tokens == first.tokens


def test_depth_one_is_autoregressive_and_counts_one_forward_per_token(device: str) -> None:
    target = SyntheticLM(device=device, vocab_size=6, seed=4)
    result = SpeculationStack.build([Level(model=target)]).generate([1], 10)
    assert list(result.tokens) == greedy_decode(target, [1], 10)
    assert result.levels[0].forward_calls == 10


def test_speculation_saves_target_forward_passes(device: str) -> None:
    target = SyntheticLM(device=device, vocab_size=6, seed=4, sharpness=3.0)
    draft = SyntheticLM(device=device, vocab_size=6, seed=5, base=target, noise=0.2)
    result = SpeculationStack.build([Level(model=draft), Level(model=target, gamma=4)]).generate([1], 40)
    target_stats = result.levels[-1]
    assert target_stats.acceptance_rate > 0.5
    assert target_stats.forward_calls < 40 / 2
    assert target_stats.emitted == target_stats.accepted + target_stats.rounds


def test_a_synthetic_models_logits_and_states_are_fixed_by_the_context_whatever_a_caller_does_with_them() -> None:
    """The model draws each context's logits and hidden state once and hands out copies: changing one
    changes nothing it returns later, and a fresh model with the same seed draws the same numbers."""
    model = SyntheticLM(vocab_size=5, seed=3, base=SyntheticLM(vocab_size=5, seed=4), noise=0.5)
    logits, state = model.logits_for([1, 2]), model.hidden_for([1, 2])
    want_logits, want_state = logits.clone(), state.clone()
    logits += 100.0
    state.zero_()
    fresh = SyntheticLM(vocab_size=5, seed=3, base=SyntheticLM(vocab_size=5, seed=4), noise=0.5)
    for got, want in ((model.logits_for([1, 2]), want_logits), (model.hidden_for((1, 2)), want_state),
                      (fresh.logits_for((1, 2)), want_logits), (fresh.hidden_for([1, 2]), want_state)):
        assert torch.equal(got, want)
    assert not torch.equal(model.logits_for([2, 1]), want_logits)
