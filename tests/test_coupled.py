"""Coupled sampling: every level draws position t's token from the same Exp(1) numbers, fixed by the seed and t.

What must hold (specstack.sampling): a coupled stack's output is the very text plain coupled autoregressive decoding
of the target writes with the same seed, token for token, whatever the levels below; and over seeds that text is
distributed as the target's warped distribution (the exponential race draws from p). The first is checked on random
synthetic stacks (the property tests' strategy) and on the real model in fp32; the second by the chi-square test of
test_distribution.py. Each check is shown to fail on a deliberately broken coupling.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings

import specstack.stack
from specstack import Level, SamplingConfig, SpeculationStack, SpecstackError
from specstack.sampling import RaceNoise, exponentials, position_noise, warp
from specstack.testing import ALPHA, stack_pvalue

from .stacks import StackCase, stack_cases

PROMPT = [1, 2]
SEEDS = range(6)
_positions = specstack.stack.row_positions  # the shipped one, before a test patches it


def coupled(case: StackCase) -> StackCase:
    return attrs.evolve(case, sampling=attrs.evolve(case.sampling, coupled=True))


def autoregressive(case: StackCase) -> SpeculationStack:
    stops = () if case.stop_token is None else (case.stop_token,)
    return SpeculationStack.build([Level(model=case.target())], sampling=case.sampling, stop_tokens=stops, seed=case.seed)


def texts(stack: SpeculationStack, length: int = 12) -> list[tuple[int, ...]]:
    return [stack.generate(PROMPT, length, seed=seed).tokens for seed in SEEDS]


@settings(max_examples=40, deadline=None)
@given(stack_cases(temperatures=(0.5, 1.0, 1.5)))
def test_a_coupled_stack_writes_the_autoregressive_text_of_its_seed(case: StackCase) -> None:
    case = coupled(case)
    assert texts(case.stack()) == texts(autoregressive(case))


def test_without_a_seed_each_call_writes_a_fresh_text_and_two_stacks_the_same_ones() -> None:
    """generate() without a seed continues the generators: a new text each call, the same run of texts in any stack
    built with the same seed."""
    case = coupled(_case(depth=3))
    stack, plain = case.stack(), autoregressive(case)
    runs = [stack.generate(PROMPT, 10).tokens for _ in range(4)]
    assert len(set(runs)) > 1
    assert runs == [plain.generate(PROMPT, 10).tokens for _ in range(4)]


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_coupled_texts_are_distributed_as_the_target(depth: int) -> None:
    case = coupled(_case(depth=depth))
    stack = autoregressive(case) if depth == 1 else case.stack()
    assert stack_pvalue(stack, case.target(), case.sampling, PROMPT) > ALPHA


def test_the_identity_test_catches_noise_read_at_the_wrong_position(monkeypatch) -> None:
    """A verifying level that races row i on the noise of the position before (off by one) keeps a valid-looking
    output but no longer the autoregressive text."""
    monkeypatch.setattr(specstack.stack, "row_positions", lambda start, draft: _positions(start, draft) - 1)
    case = coupled(_case(depth=3))
    assert texts(case.stack()) != texts(autoregressive(case))


def test_the_distribution_test_catches_noise_shared_by_all_positions(monkeypatch) -> None:
    """Noise that ignores the position draws each token from its own distribution but ties the draws together: the
    texts are no longer distributed as the target's."""
    same = lambda seed, position, vocab: exponentials(seed, 0, vocab)  # noqa: E731
    monkeypatch.setattr("specstack.sampling.exponentials", same)
    case = coupled(_case(depth=1))
    assert stack_pvalue(autoregressive(case), case.target(), case.sampling, PROMPT) < ALPHA


def test_the_race_draws_each_token_as_often_as_its_probability() -> None:
    """Over many positions the one-hot warp lands on token x a fraction p(x) of the time."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    sampling = SamplingConfig(temperature=1.0, coupled=True)
    rows = warp(logits.expand(20_000, 4), sampling, seed=7, positions=torch.arange(20_000))  # [n, V] one-hot
    assert torch.allclose(rows.mean(0), logits.softmax(-1), atol=0.01)
    assert torch.equal(rows.sum(-1), torch.ones(20_000))


def test_coupled_sampling_asks_for_the_seed_and_positions() -> None:
    with pytest.raises(SpecstackError, match="pass seed= and positions="):
        warp(torch.zeros(4), SamplingConfig(temperature=1.0, coupled=True))
    with pytest.raises(SpecstackError, match="coupled 1 is not allowed"):
        SamplingConfig(temperature=1.0, coupled=1)


def _case(depth: int) -> StackCase:
    return StackCase(vocab=4, depth=depth, gammas=(3, 2)[: depth - 1], noises=(1.0, 0.3)[: depth - 1], lookup_base=False,
                     streaming_base=False, sampling=SamplingConfig(temperature=1.0), stop_token=None, seed=5)


def test_kept_noise_draws_what_fresh_noise_draws() -> None:
    """A level's RaceNoise gives each position the row a fresh race would read, for the seed asked (a changed seed
    is a new text), whichever positions it kept before and however few it keeps."""
    sampling = SamplingConfig(temperature=0.7, coupled=True)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))  # [3, V]
    kept = RaceNoise(capacity=4)
    for seed, start in [(1, 10), (1, 11), (1, 40), (2, 11), (1, 11), (1, 10)]:
        positions = torch.arange(start, start + 3)  # [3]
        assert torch.equal(warp(logits, sampling, seed=seed, positions=positions, noise=kept), warp(logits, sampling, seed=seed, positions=positions))
    race = (warp(logits, sampling.marginal).double() / position_noise(2, torch.arange(11, 14), 50)).argmax(-1)  # [3]: argmax p / E
    assert torch.equal(warp(logits, sampling, seed=2, positions=torch.arange(11, 14), noise=kept).argmax(-1), race)
