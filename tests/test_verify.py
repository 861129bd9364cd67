"""Verifiers are pure functions of probabilities and a generator."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specstack import Draft, GreedyVerifier, SamplingConfig, SpeculativeSamplingVerifier
from specstack.sampling import warp
from specstack.testing import chi_square_pvalue


def random_probs(seed: int, rows: int, vocab: int, temperature: float = 1.0) -> torch.Tensor:
    logits = 2 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
    return warp(logits, SamplingConfig(temperature=temperature))


def draw_draft(q: torch.Tensor, generator: torch.Generator) -> Draft:
    tokens = torch.stack([torch.multinomial(row, 1, generator=generator)[0] for row in q])
    return Draft(tokens=tokens, probs=q)


@settings(max_examples=200)
@given(st.integers(0, 6), st.integers(2, 8), st.integers(0, 10**6), st.sampled_from([0.0, 1.0]))
def test_verdict_is_a_valid_prefix(k: int, vocab: int, seed: int, temperature: float) -> None:
    g = torch.Generator().manual_seed(seed)
    q = random_probs(seed, k, vocab, temperature)
    p = random_probs(seed + 1, k + 1, vocab, temperature)
    draft = draw_draft(q, g) if k else Draft.empty(vocab)
    for verifier in (SpeculativeSamplingVerifier(), GreedyVerifier()):
        verdict = verifier.verify(draft, p, g)
        assert 0 <= verdict.num_accepted <= k
        assert verdict.accepted == tuple(range(verdict.num_accepted))
        assert 0 <= verdict.next_token < vocab
        assert verdict.bonus == (verdict.num_accepted == k)
        assert p[verdict.num_accepted, verdict.next_token] > 0


def test_greedy_verifier_accepts_while_argmax_agrees() -> None:
    p = torch.eye(5)[[1, 2, 3, 4]]  # argmax 1, 2, 3, then 4
    verdict = GreedyVerifier().verify(Draft(tokens=torch.tensor([1, 2, 0]), probs=torch.eye(5)[[1, 2, 0]]), p, torch.Generator())
    assert verdict.accepted == (0, 1) and verdict.next_token == 3 and not verdict.bonus


def test_identical_distributions_accept_everything() -> None:
    g = torch.Generator().manual_seed(0)
    for seed in range(50):
        q = random_probs(seed, 4, 6)
        draft = draw_draft(q, g)
        p = torch.cat([q, random_probs(seed + 99, 1, 6)])
        assert SpeculativeSamplingVerifier().verify(draft, p, g).num_accepted == 4


def test_disjoint_support_rejects_the_first_token() -> None:
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 3)
    p = torch.tensor([[0.0, 0.0, 0.3, 0.7]] * 4)
    verdict = SpeculativeSamplingVerifier().verify(Draft(tokens=torch.tensor([0, 1, 0]), probs=q), p, torch.Generator())
    assert verdict.num_accepted == 0 and verdict.next_token in (2, 3)


@pytest.mark.parametrize("seed", range(4))
def test_first_emitted_token_is_distributed_as_p(seed: int) -> None:
    """One verification step in isolation: the token emitted at position 0 follows p[0] exactly."""
    g = torch.Generator().manual_seed(seed)
    q = random_probs(seed, 2, 6)
    p = random_probs(seed + 10, 3, 6)
    emitted = []
    for _ in range(4000):
        draft = draw_draft(q, g)
        verdict = SpeculativeSamplingVerifier().verify(draft, p, g)
        emitted.append(int(draft.tokens[0]) if verdict.num_accepted else verdict.next_token)
    assert chi_square_pvalue(emitted, dict(enumerate(p[0].tolist()))) > 1e-4


def test_verifier_uses_only_the_given_generator() -> None:
    q = random_probs(1, 3, 6)
    p = random_probs(2, 4, 6)
    draft = Draft(tokens=torch.tensor([0, 1, 2]), probs=q)
    runs = []
    for _ in range(2):
        torch.manual_seed(torch.randint(0, 1000, ()).item())  # the global RNG must not matter
        runs.append(SpeculativeSamplingVerifier().verify(draft, p, torch.Generator().manual_seed(7)))
    assert runs[0] == runs[1]
