"""The output distribution of every stack is exactly the target's.

Method: enumerate every continuation of a fixed prompt (``length`` tokens over a 3–5 token
vocabulary, or shorter when it ends in the stop token) with its exact probability under the
target's warped distribution; draw ``SAMPLES`` generations from the stack; Pearson's chi-square
goodness-of-fit test (bins with expected count < 5 pooled; any observed impossible sequence fails
outright). Each example fails at p < ``ALPHA``; with ``EXAMPLES`` derandomized examples the chance of
a false alarm in the property test is at most EXAMPLES × ALPHA = 0.13%, and since the seeds are fixed
the outcome is the same on every run. Its stacks sample (T > 0): at T = 0 all draws are one sequence,
which test_greedy.py checks against argmax decoding over 60 examples of the same stacks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from specstack import Level, SamplingConfig, SpeculationStack, StreamingLLM, Verifier
from specstack.sampling import sample
from specstack.synthetic import SyntheticLM, sequence_probabilities
from specstack.testing import ALPHA, SAMPLES, stack_pvalue
from specstack.types import Verdict

from .stacks import StackCase, stack_cases

EXAMPLES = 13
SAMPLED = (0.5, 1.0, 1.5)  # the property test's temperatures
PROMPT = [1, 2]
LENGTH = 3


def sampled_pvalue(stack: SpeculationStack, target: SyntheticLM, sampling: SamplingConfig, stops=(), samples: int = SAMPLES) -> float:
    return stack_pvalue(stack, target, sampling, PROMPT, length=LENGTH, samples=samples, stop_tokens=stops)


@settings(max_examples=EXAMPLES)
@given(stack_cases(temperatures=SAMPLED))
def test_stack_output_is_distributed_as_target(device: str, case: StackCase) -> None:
    stops = () if case.stop_token is None else (case.stop_token,)
    assert sampled_pvalue(case.stack(device), case.target(), case.sampling, stops) > ALPHA


class NoResidualVerifier(Verifier):
    """Deliberately wrong: after a rejection it samples from p instead of normalize(max(p - q, 0))."""

    name = "broken-no-residual"

    def verify(self, draft, p, generator) -> Verdict:
        rows = torch.arange(len(draft), device=p.device)
        accept = (torch.rand(len(draft), generator=generator, device=p.device) * draft.probs[rows, draft.tokens] < p[rows, draft.tokens]).long()
        m = int(accept.cumprod(0).sum())
        return Verdict(accepted=tuple(range(m)), next_token=sample(p[m], generator), bonus=m == len(draft))


class AlwaysAcceptVerifier(Verifier):
    """Deliberately wrong: accepts every drafted token (outputs the draft's distribution)."""

    name = "broken-always-accept"

    def verify(self, draft, p, generator) -> Verdict:
        return Verdict(accepted=tuple(range(len(draft))), next_token=sample(p[len(draft)], generator), bonus=True)


@pytest.mark.parametrize("broken", [NoResidualVerifier(), AlwaysAcceptVerifier()], ids=lambda v: v.name)
@pytest.mark.parametrize("seed", [3, 11])
def test_the_distribution_test_catches_a_broken_verifier(device: str, broken: Verifier, seed: int) -> None:
    """A test of the test: the same check rejects verifiers that are known to be lossy."""
    sampling = SamplingConfig(temperature=1.0)
    target = SyntheticLM(device=device, vocab_size=4, seed=seed, sharpness=1.5)
    draft = SyntheticLM(device=device, vocab_size=4, seed=seed + 1, base=target, noise=2.0)
    stack = SpeculationStack.build([Level(model=draft), Level(model=target, gamma=3)], sampling=sampling, verifier=broken, seed=seed)
    assert sampled_pvalue(stack, target, sampling) < ALPHA
    correct = SpeculationStack.build([Level(model=draft), Level(model=target, gamma=3)], sampling=sampling, seed=seed)
    assert sampled_pvalue(correct, target, sampling) > ALPHA


def test_identical_drafter_is_always_accepted(device: str) -> None:
    target = SyntheticLM(device=device, vocab_size=5, seed=7)
    stack = SpeculationStack.build([Level(model=target), Level(model=target, gamma=4)], sampling=SamplingConfig(temperature=1.0))
    result = stack.generate(PROMPT, 40)
    assert result.levels[-1].acceptance_rate == 1.0
    assert sampled_pvalue(stack, target, SamplingConfig(temperature=1.0)) > ALPHA


def test_disjoint_support_rejects_everything_and_stays_exact(device: str) -> None:
    sampling = SamplingConfig(temperature=1.0)
    target = SyntheticLM(device=device, vocab_size=4, seed=5, support=(2, 3))
    draft = SyntheticLM(device=device, vocab_size=4, seed=6, support=(0, 1))
    stack = SpeculationStack.build([Level(model=draft), Level(model=target, gamma=3)], sampling=sampling)
    assert stack.generate(PROMPT, 30).levels[-1].accepted == 0
    assert sampled_pvalue(stack, target, sampling) > ALPHA


def test_one_hot_distributions_give_the_single_possible_output(device: str) -> None:
    target = SyntheticLM(device=device, vocab_size=5, seed=8, sharpness=1e4)
    draft = SyntheticLM(device=device, vocab_size=5, seed=9, sharpness=1e4)
    sampling = SamplingConfig(temperature=1.0)
    exact = sequence_probabilities(target, PROMPT, LENGTH, sampling)
    assert max(exact.values()) == pytest.approx(1.0)
    stack = SpeculationStack.build([Level(model=draft), Level(model=draft, gamma=2), Level(model=target, gamma=3)], sampling=sampling)
    outputs = {stack.generate(PROMPT, LENGTH).tokens for _ in range(50)}
    assert outputs == {max(exact, key=exact.get)}


def test_stop_token_inside_a_draft_ends_generation_with_exact_distribution(device: str) -> None:
    sampling = SamplingConfig(temperature=1.0)
    target = SyntheticLM(device=device, vocab_size=3, seed=21)
    draft = SyntheticLM(device=device, vocab_size=3, seed=22, base=target, noise=0.5)
    stack = SpeculationStack.build([Level(model=draft), Level(model=target, gamma=5)], sampling=sampling, stop_tokens=(0,))
    outputs = [stack.generate(PROMPT, LENGTH) for _ in range(200)]
    assert any(r.stopped_by == "eos" and len(r.tokens) < LENGTH for r in outputs)
    assert all(0 not in r.tokens[:-1] for r in outputs)
    assert sampled_pvalue(stack, target, sampling, stops=(0,)) > ALPHA


LONG_PROMPT = [1, 2, 3, 0, 2, 1, 3, 3, 0, 1, 2, 2, 3, 1, 0, 0, 2, 3, 1, 2]  # long enough to evict and gather


def _middle_policy(name: str):
    from specstack import Registry, Retrieval

    if name == "retrieval":
        return Retrieval(budget=8, chunk_size=2, stride=2, reserve=8)
    if name == "streaming":
        return StreamingLLM(sinks=2, window=6, relative_positions=False)
    return Registry.create().cache_policy(name, budget=8)


@pytest.mark.parametrize(("policy", "sampling"), [
    ("retrieval", SamplingConfig(temperature=1.0)),
    ("retrieval", SamplingConfig(temperature=0.7, top_k=3, top_p=0.9)),
    ("topk-oracle", SamplingConfig(temperature=0.7, top_k=3, top_p=0.9)),
    ("h2o", SamplingConfig(temperature=1.0)),
    ("streaming", SamplingConfig(temperature=0.7, top_k=3, top_p=0.9)),
])
def test_a_partial_view_at_the_middle_level_keeps_the_target_distribution(device: str, policy, sampling) -> None:
    """Depth 3 with the middle level over a gathered (retrieval, Top-K oracle), per-head evicted (H2O)
    or streaming view of the target's own cache."""
    target = SyntheticLM(device=device, vocab_size=4, seed=31, sharpness=1.5)
    draft = SyntheticLM(device=device, vocab_size=4, seed=32, base=target, noise=1.0)
    levels = [Level(model=draft), Level(model=target, policy=_middle_policy(policy), gamma=2), Level(model=target, gamma=3)]
    stack = SpeculationStack.build(levels, sampling=sampling, seed=4)
    assert stack_pvalue(stack, target, sampling, LONG_PROMPT, length=LENGTH) > ALPHA
    assert stack.top.drafter.lm.stats.gathers > 0 or policy in ("h2o", "streaming")


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.8), SamplingConfig(temperature=1.2, top_k=3, top_p=0.8)], ids=["t0.8", "t1.2-k3-p0.8"])
def test_a_middle_level_that_is_the_target_is_always_accepted(device: str, sampling) -> None:
    """The middle level hands up its own p at the tokens it emits; if it is the target itself, the top
    level must accept every one of them. Misaligned rows (which greedy tests cannot see) fail this."""
    target = SyntheticLM(device=device, vocab_size=5, seed=41, sharpness=1.5)
    draft = SyntheticLM(device=device, vocab_size=5, seed=42, base=target, noise=1.0)
    stack = SpeculationStack.build([Level(model=draft), Level(model=target, gamma=3), Level(model=target, gamma=4)], sampling=sampling)
    result = stack.generate(PROMPT, 60)
    middle, top = result.levels[1], result.levels[2]
    assert middle.rejected > 0  # the draft does get rejected below
    assert top.drafted > 0 and top.acceptance_rate == 1.0
