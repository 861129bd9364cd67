from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specstack import SamplingConfig, SpecstackError, sampling, warp

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


def test_first_argmax_is_torchs_argmax_ties_and_nan_included() -> None:
    """On float32 CPU rows, the numpy path (other dtypes and devices take torch's own argmax)."""
    rows = torch.randint(0, 4, (6, 300), generator=torch.Generator().manual_seed(1)).float()  # [6, 300]: many ties at the maximum
    rows[2, 7] = rows[2, 250] = float("nan")  # NaN counts as the largest, its first one wins
    rows[3] = float("-inf")
    rows[4, [5, 90]] = float("inf")
    want = rows.argmax(dim=-1)  # [6]
    assert sampling.first_argmax(rows).tolist() == want.tolist() and want[2] == 7 and want[4] == 5
    assert sampling.first_argmax(rows, keepdim=True).tolist() == rows.argmax(dim=-1, keepdim=True).tolist()
    assert sampling.first_argmax(rows[1]).tolist() == int(want[1])  # one row: a 0-d index
    assert sampling.first_argmax(rows.t().contiguous().t()).tolist() == want.tolist()  # strided rows
    assert sampling.first_argmax(rows.view(2, 3, 300)).tolist() == want.view(2, 3).tolist()


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


# -- top-p's prefilter: the k highest logits first, the whole vocabulary only when needed ----------


def _nucleus_by_full_sort(probs: torch.Tensor, logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """specstack's top-p before the prefilter (commit 455465a), kept verbatim as the reference."""
    order = logits.sort(dim=-1, descending=True, stable=True).indices  # [..., V]
    sorted_probs = probs.gather(-1, order)  # [..., V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [..., V]
    drop_sorted = mass_before >= top_p  # [..., V]
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)  # [..., V]
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _reference_warp(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    plain = warp(logits, SamplingConfig(temperature=config.temperature, top_k=config.top_k))  # [..., V]; no top-p
    scaled = logits.float() / config.temperature
    if config.top_k is not None and config.top_k < logits.shape[-1]:
        scaled = scaled.masked_fill(scaled < scaled.topk(config.top_k, dim=-1).values[..., -1:], float("-inf"))
    return _nucleus_by_full_sort(plain, scaled, config.top_p)


def _adversarial_logits(family: str, rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, V] logits of one family: ordinary, peaked, flat, all equal, a few values tied in
    runs, a tie straddling the 64th place, or powers of two whose masses hit top_p exactly."""
    normal = torch.randn(rows, vocab, generator=generator)  # [rows, V]
    if family == "peaked":
        return normal * 8
    if family == "flat":
        return normal * 0.01
    if family == "equal":
        return torch.zeros(rows, vocab)
    if family == "ties":
        return torch.randint(0, 6, (rows, vocab), generator=generator).float() * 2
    if family == "tie-at-k":  # 40 clear winners, then 100 tokens tied across the 64th place
        logits = normal - 20
        places = torch.randperm(vocab, generator=generator)[:140]
        logits[:, places[:40]] = 10 + torch.randn(rows, 40, generator=generator)
        logits[:, places[40:]] = 9.0
        return logits
    if family == "halves":  # p = 1/2, 1/4, 1/8, ...: cumulative masses land exactly on 0.5, 0.75, 0.875
        logits = torch.full((rows, vocab), -1e4)
        logits[:, :20] = -torch.arange(20).float() * math.log(2)
        return logits[:, torch.randperm(vocab, generator=generator)]
    return normal * 3


FAMILIES = ["normal", "peaked", "flat", "equal", "ties", "tie-at-k", "halves"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("vocab", [300, 4096])
def test_top_p_prefilter_gives_the_full_sort_bit_for_bit(family, vocab) -> None:
    generator = torch.Generator().manual_seed(vocab)
    for trial in range(24):
        rows = (1, 7, 3)[trial % 3]
        logits = _adversarial_logits(family, rows, vocab, generator)  # [rows, V]
        config = SamplingConfig(temperature=(1.0, 0.5, 1.7)[trial % 3], top_p=(0.5, 0.75, 0.9, 0.95, 0.999, 0.875)[trial % 6],
                                top_k=(None, None, 100, 3)[trial % 4])
        got, want = warp(logits, config), _reference_warp(logits, config)  # [rows, V]
        assert torch.equal(got > 0, want > 0), f"kept other tokens than the full sort ({family}, trial {trial})"
        assert torch.equal(got, want), f"probabilities differ from the full sort ({family}, trial {trial})"


@pytest.mark.parametrize("family", FAMILIES)
def test_top_p_prefilter_decides_as_the_full_sort_at_the_real_vocabulary(family) -> None:
    """V = 49152 (SmolLM2): the prefilter's drop mask, whenever it answers, is the full sort's."""
    generator = torch.Generator().manual_seed(7)
    answered = 0
    for rows, top_p in ((1, 0.9), (7, 0.5), (7, 0.95)):
        logits = _adversarial_logits(family, rows, 49152, generator)  # [rows, V]
        probs = logits.softmax(dim=-1)  # [rows, V]
        drop = sampling._drop_within_top(probs, logits, top_p)  # [rows, V] or None
        if drop is not None:
            answered += 1
            assert torch.equal(drop, sampling._drop_by_sort(probs, logits, top_p))
        assert torch.equal(warp(logits, SamplingConfig(temperature=1.0, top_p=top_p)), _nucleus_by_full_sort(probs, logits, top_p))
    if family in ("normal", "peaked", "tie-at-k", "halves"):
        assert answered == 3, "the prefilter should settle peaked distributions without a full sort"


def test_top_p_prefilter_never_settles_a_nucleus_that_may_reach_past_a_split_tie() -> None:
    """100 tokens tie across the 64th place and the nucleus needs some of them: which ones is the
    full ranking's call (lowest indices first), so the 64 highest logits must not decide alone."""
    logits = torch.full((1, 4096), -30.0)
    logits[0, 1000:1100] = 0.0  # [1, V]; top-k may return any 64 of these
    probs = logits.softmax(dim=-1)
    assert sampling._drop_among(probs, logits, 0.5, 64)[0] is None
    kept = torch.nonzero(warp(logits, SamplingConfig(temperature=1.0, top_p=0.5))[0]).flatten()
    assert kept.tolist() == list(range(1000, 1050))


def test_top_p_prefilter_works_on_batches() -> None:
    logits = torch.randn(2, 3, 4096, generator=torch.Generator().manual_seed(1)) * 4  # [B, T, V]
    config = SamplingConfig(temperature=0.8, top_p=0.9)
    assert torch.equal(warp(logits, config), _reference_warp(logits, config))


def test_sample_draws_each_token_with_its_probability_and_never_one_of_probability_zero() -> None:
    """Inverse-CDF sampling against the exact distribution (chi-square), zeros at both ends and between, an
    unnormalised total; the same seed draws the same tokens."""
    from specstack.testing import chi_square_pvalue

    probs = torch.tensor([0.0, 0.3, 0.0, 0.05, 0.45, 0.0, 0.2, 0.0]) * 3  # total 3
    generator = torch.Generator().manual_seed(0)
    draws = [sampling.sample(probs, generator) for _ in range(20000)]
    assert not {0, 2, 5, 7} & set(draws)
    assert chi_square_pvalue(draws, {i: float(p) / 3 for i, p in enumerate(probs) if p > 0}) > 1e-3
    again = torch.Generator().manual_seed(0)
    assert [sampling.sample(probs, again) for _ in range(50)] == draws[:50]


def test_draw_of_many_tokens_draws_each_independently_with_its_probability() -> None:
    """``draw(probs, generator, count)``: count independent draws (with replacement, as Sequoia's sampled trees ask),
    the same distribution as one at a time (chi-square over 4,000 x 5 draws), zeros never drawn."""
    from specstack.testing import chi_square_pvalue

    probs = torch.tensor([0.0, 0.3, 0.0, 0.05, 0.45, 0.0, 0.2, 0.0])
    generator = torch.Generator().manual_seed(0)
    draws = [token for _ in range(4000) for token in sampling.draw(probs, generator, 5).tolist()]
    assert len(draws) == 20000 and not {0, 2, 5, 7} & set(draws)
    assert chi_square_pvalue(draws, {i: float(p) for i, p in enumerate(probs) if p > 0}) > 1e-3
    pairs = [tuple(sampling.draw(probs, generator, 2).tolist()) for _ in range(4000)]  # independent: the pair's law is the product
    assert chi_square_pvalue(pairs, {(a, b): float(probs[a] * probs[b]) for a in range(8) for b in range(8) if probs[a] * probs[b] > 0}) > 1e-3


def test_sample_at_the_top_of_the_uniform_draws_the_last_token_with_mass(monkeypatch) -> None:
    """u times the total can round up to the total: the last token with any mass is drawn, not one past the end
    nor one of weight zero."""
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.ones(1))
    assert sampling.sample(torch.tensor([0.2, 0.5, 0.3, 0.0, 0.0]), torch.Generator()) == 2


@pytest.mark.parametrize("probs", [[0.0, 0.0, 0.0], [0.5, -0.1, 0.6], [0.5, float("nan"), 0.5], [0.5, float("inf"), 0.5]])
def test_sample_refuses_what_is_not_a_distribution(probs) -> None:
    with pytest.raises(ValueError, match="cannot sample"):
        sampling.sample(torch.tensor(probs), torch.Generator())
