"""Bad input gets a one-line error naming the value and what is allowed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specstack import Level, PromptLookupDrafter, SamplingConfig, SpecstackError, SpeculationStack, StreamingLLM
from specstack.registry import Registry
from specstack.synthetic import SyntheticLM

target = SyntheticLM(vocab_size=6, seed=1, max_length=64)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SpeculationStack.build([]), "a stack needs at least one level; got an empty list"),
        (lambda: Level(model=target, gamma=-1), r"gamma -1 is not allowed; use an integer >= 1 \(or 0 below the top level"),
        (lambda: SpeculationStack.build([Level(model=target), Level(model=target, gamma=0)]), "gamma 0 is not allowed at the top level 1"),
        (lambda: SpeculationStack.build([Level(model=target), Level(model=target)]), "level 1 needs gamma"),
        (lambda: SpeculationStack.build([Level(model=SyntheticLM(vocab_size=7)), Level(model=target, gamma=2)]),
         "level 0 has vocabulary size 7 but the target has 6"),
        (lambda: SpeculationStack.build([Level(model=SyntheticLM(vocab_size=6, tokenizer_id="other")), Level(model=target, gamma=2)]),
         r"level 0 \(SyntheticLM\) uses tokenizer .other. but the target \(SyntheticLM\) uses .synthetic."),
        (lambda: SpeculationStack.build([Level(drafter=PromptLookupDrafter(vocab=6))]), "the top level must be a model"),
        (lambda: SpeculationStack.build([Level(model=target)], sampling=SamplingConfig(temperature=1.0), verifier=Registry.create(entry_points=False).verifier("greedy")),
         "verifier 'greedy' needs temperature 0 or coupled sampling, got temperature 1.0"),
        (lambda: StreamingLLM(window=0), "window 0 is not allowed; use an integer >= 2"),
        (lambda: PromptLookupDrafter(vocab=6, min_ngram=3, max_ngram=2), "n-gram range 3..2 is not allowed"),
        (lambda: PromptLookupDrafter(vocab=6, lookback=-1), r"prompt lookup's lookback -1 is not allowed; use a whole number >= 0"),
        (lambda: PromptLookupDrafter(vocab=6, lookback=2.5), r"prompt lookup's lookback 2.5 is not allowed"),
        (lambda: SpeculationStack.build([Level(model=target)]).generate(list(range(6)) * 10, 10),
         "a 60-token prompt plus 10 new tokens needs 70 positions but the model's window is 64"),
        (lambda: SpeculationStack.build([Level(model=target)]).generate([], 10), "the prompt is empty"),
        (lambda: SpeculationStack.build([Level(model=target)]).generate([1], 0), "max_new_tokens 0 is not allowed"),
        (lambda: SpeculationStack.build([Level(model=target)]).generate([9], 3), r"prompt token 9 is outside the vocabulary \[0, 6\)"),
        (lambda: SpeculationStack.build([Level(model=target)]).generate([1, 2.5, 3], 3),
         "prompt token 2.5 is not allowed; token ids are integers"),  # int() would have read it as 2
        (lambda: SpeculationStack.build([Level(model=target)]).generate(torch.tensor([1.0, 2.0]), 3),
         "prompt token 1.0 is not allowed; token ids are integers"),
        (lambda: SpeculationStack.build([Level(model=target)]).generate(torch.tensor([[1, 2, 3]]), 3),
         r"the prompt has shape \[1, 3\]; give one sequence of token ids \(1-D\)"),
        (lambda: SpeculationStack.build([Level(model=target)]).generate([1, 2], 3, seed="a"),
         "seed 'a' is not allowed; use an integer, or None to continue the generators"),
        (lambda: SamplingConfig(temperature=1.0, top_k=True), "top_k True is not allowed"),
    ],
)
def test_bad_input_is_reported_in_one_line(build, message) -> None:
    with pytest.raises(SpecstackError, match=message) as error:
        build()
    assert "\n" not in str(error.value)


def test_a_prompt_of_integer_tensors_or_arrays_is_read_as_its_ids() -> None:
    stack = SpeculationStack.build([Level(model=target)])
    expected = stack.generate([1, 2, 3], 4, seed=0).tokens
    for prompt in (torch.tensor([1, 2, 3]), np.array([1, 2, 3]), [np.int64(1), np.int32(2), torch.tensor(3)]):
        assert stack.generate(prompt, 4, seed=0).tokens == expected
