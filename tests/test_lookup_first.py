"""Level 0 that lets prompt lookup draft first and the draft model elsewhere (:class:`LookupFirstDrafter`,
the ``triforce-hybrid`` stack): the target's distribution and its greedy output, with both parts drafting."""

from __future__ import annotations

import functools

import pytest
import torch

from specstack import Level, LookupFirstDrafter, ModelDrafter, PromptLookupDrafter, Registry, Retrieval, SamplingConfig, SpeculationStack, SpecstackError, StreamingLLM
from specstack.synthetic import SyntheticLM, greedy_decode
from specstack.testing import ALPHA, stack_pvalue
from specstack.types import Draft

PROMPT = [1, 2, 3, 0, 1, 2, 3, 0, 2, 1, 3, 3, 0, 1, 2, 2, 3, 1, 0, 1, 2]  # repeats: lookup matches after some endings, not others
VOCAB = 4


class ClaimsTheModelsRows(LookupFirstDrafter):
    """Deliberately wrong: hands up lookup's copied tokens with the model's distribution as their q,
    though no random draw chose them."""

    def propose(self, prefix, n) -> Draft:
        draft = super().propose(prefix, n)
        if self._model_drafted:
            return draft
        rows = ModelDrafter.propose(self, prefix, len(draft)).probs[: len(draft)]  # [k, V]
        return Draft(tokens=draft.tokens[: len(rows)], probs=rows.cpu())


def _stack(device: str, sampling: SamplingConfig, drafter=LookupFirstDrafter, min_ngram: int = 2) -> tuple[SpeculationStack, SyntheticLM]:
    target = SyntheticLM(device=device, vocab_size=VOCAB, seed=31, sharpness=1.5)
    draft = SyntheticLM(device=device, vocab_size=VOCAB, seed=32, base=target, noise=1.0)
    lookup = PromptLookupDrafter(vocab=VOCAB, max_ngram=3, min_ngram=min_ngram)
    levels = [
        Level(model=draft, policy=StreamingLLM(sinks=1, window=6), model_drafter=functools.partial(drafter, lookup=lookup)),
        Level(model=target, policy=Retrieval(budget=8, chunk_size=2, stride=2, reserve=8), gamma=2),
        Level(model=target, gamma=3),
    ]
    return SpeculationStack.build(levels, sampling=sampling, seed=4), target


def _level0(stack: SpeculationStack) -> LookupFirstDrafter:
    return stack.top.drafter.drafter


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3, top_p=0.9)], ids=["t1", "t0.7-k3-p0.9"])
def test_lookup_first_keeps_the_target_distribution(device: str, sampling) -> None:
    stack, target = _stack(device, sampling)
    assert stack_pvalue(stack, target, sampling, PROMPT, length=3) > ALPHA
    level0 = _level0(stack)
    assert level0.lookup.stats.drafted > 0  # lookup drafted in some rounds ...
    assert level0.lm.stats.drafted > level0.lookup.stats.drafted  # ... and the model in others (the level counts both parts' tokens)


def test_the_distribution_test_catches_lookup_tokens_claiming_the_models_distribution(device: str) -> None:
    sampling = SamplingConfig(temperature=1.0)
    stack, target = _stack(device, sampling, drafter=ClaimsTheModelsRows)
    assert stack_pvalue(stack, target, sampling, PROMPT, length=3) < ALPHA


@pytest.mark.parametrize("seed", range(6))
def test_greedy_lookup_first_equals_greedy_decoding(seed: int) -> None:
    target = SyntheticLM(vocab_size=24, seed=seed, sharpness=2.0)
    draft = SyntheticLM(vocab_size=24, seed=seed + 50, base=target, noise=0.5)
    prompt = [(5 * i * i + seed) % 24 for i in range(300)]  # repeats with period 24: lookup matches often
    stack = Registry.create().stack("triforce-hybrid", target=target, draft=draft, budget=64, chunk_size=4, stride=8, draft_window=16, sinks=2, min_ngram=2)
    result = stack.generate(prompt, 40)
    assert list(result.tokens) == greedy_decode(target, prompt, 40)
    level0 = _level0(stack)
    assert level0.lookup.stats.drafted > 0 and level0.lm.stats.drafted > level0.lookup.stats.drafted  # both parts drafted


def test_a_model_is_refused_as_the_lookup_part() -> None:
    target = SyntheticLM(vocab_size=VOCAB, seed=0)
    levels = [Level(model=target, model_drafter=functools.partial(LookupFirstDrafter, lookup=_model_drafter(target))), Level(model=target, gamma=2)]
    with pytest.raises(SpecstackError, match="lookup-first drafting takes a model-free chain drafter; got ModelDrafter"):
        SpeculationStack.build(levels)


def _model_drafter(model):
    from specstack.model import CachedModel
    from specstack.policies import FullCache
    from specstack.types import LevelStats

    return ModelDrafter(lm=CachedModel(model=model, policy=FullCache(), stats=LevelStats(name="x")), sampling=SamplingConfig(), generator=torch.Generator())
