from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specstack import SamplingConfig, SpecstackError, warp

logit_rows = st.lists(st.floats(-20, 20, allow_nan=False), min_size=2, max_size=12).map(torch.tensor)


@settings(max_examples=200)
@given(logit_rows, st.sampled_from([0.3, 1.0, 2.0]), st.sampled_from([1.0, 0.95, 0.5, 0.1]), st.sampled_from([None, 1, 3]))
def test_warp_is_a_distribution_honouring_top_k_and_top_p(logits, temperature, top_p, top_k) -> None:
    probs = warp(logits, SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k))
    scaled = logits.float() / temperature  # what warp ranks: tiny logits can tie once divided
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-5)
    assert bool((probs >= 0).all())
    assert probs[scaled.argmax()] > 0  # the most likely token always survives
    if top_k is not None:
        kth = scaled.topk(min(top_k, len(logits))).values[-1]
        assert bool((probs[scaled < kth] == 0).all())
    if top_p < 1:
        plain = warp(logits, SamplingConfig(temperature=temperature, top_k=top_k))
        kept = probs > 0
        assert plain[kept].sum() >= top_p - 1e-5 or kept.all()
        assert plain[kept].min() >= plain[~kept].max() if (~kept).any() else True


def test_top_p_keeps_the_argmax_when_probabilities_round_to_a_tie() -> None:
    """Found by hypothesis 6.100 (make test-floors): the two probabilities are equal floats, and
    ranking by them (stable) put index 0 first and dropped the argmax."""
    probs = warp(torch.tensor([0.0, 7.45e-09]), SamplingConfig(temperature=0.3, top_p=0.5))
    assert probs.tolist() == [0.0, 1.0]


@given(logit_rows)
def test_temperature_zero_is_one_hot_on_the_first_argmax(logits) -> None:
    probs = warp(logits, SamplingConfig(temperature=0.0))
    assert probs.sum() == 1 and probs[logits.argmax()] == 1


def test_warp_works_on_batches() -> None:
    logits = torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(0))
    cfg = SamplingConfig(temperature=0.7, top_p=0.8, top_k=4)
    batched = warp(logits, cfg)
    assert torch.allclose(batched[1, 2], warp(logits[1, 2], cfg))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature -0.5 is not allowed; use a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature nan is not allowed"),
        ({"top_p": 0.0}, "top_p 0.0 is not allowed; use a number in (0, 1]"),
        ({"top_p": 1.5}, "top_p 1.5 is not allowed"),
        ({"top_k": 0}, "top_k 0 is not allowed; use an integer >= 1"),
    ],
)
def test_bad_sampling_values_are_named(kwargs, message) -> None:
    with pytest.raises(SpecstackError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SamplingConfig(**kwargs)
