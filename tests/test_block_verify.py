"""Block verification (Sun et al., 2024) is exact, and emits at least as many tokens as the token rule.

The exact tests enumerate every draft x_1 … x_k of a small vocabulary with its probability under q, every outcome of
the verifier with its probability (from :func:`block_chances` and :func:`block_residual`), and let the target
continue each outcome to k + 1 tokens: the result must be the target's own joint distribution of k + 1 tokens. The
same enumeration, given a rule known to be wrong, must find it wrong. The sampled tests check that ``verify`` draws
what those functions say, and that whole stacks verified by blocks sample the target's distribution.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings

from specstack import BlockVerifier, Draft, Kind, Level, Registry, SamplingConfig, SpeculationStack, SpecstackError
from specstack.synthetic import SyntheticLM, greedy_decode
from specstack.testing import ALPHA, chi_square_pvalue, stack_pvalue
from specstack.types import DraftKind
from specstack.verify import block_chances, block_residual

from .stacks import stack_cases

VOCAB = 3


def _tables(seed: int, k: int, sharpness: float) -> tuple[dict, dict]:
    """p and q after every prefix of up to k tokens: {prefix: [V]} (float64, so the enumeration is exact to 1e-12)."""
    g = torch.Generator().manual_seed(seed)
    def row() -> torch.Tensor:
        return torch.softmax(sharpness * torch.randn(VOCAB, generator=g, dtype=torch.float64), 0)  # [V]
    prefixes = [pre for n in range(k + 1) for pre in itertools.product(range(VOCAB), repeat=n)]
    return {pre: row() for pre in prefixes}, {pre: row() for pre in prefixes}


def _rows(table: dict, x: tuple, n: int) -> torch.Tensor:
    return torch.stack([table[x[:i]] for i in range(n)])  # [n, V]


def _prob(table: dict, seq: tuple, start: int = 0) -> float:
    out = 1.0
    for i in range(start, len(seq)):
        out *= float(table[seq[:i]][seq[i]])
    return out


def block_outcomes(draft: Draft, p: torch.Tensor, residual=block_residual) -> dict[tuple[int, int], float]:
    """{(τ, next token): probability} of one block's verdict: τ is the largest i with η_i < h_i, so
    P(τ = i) = h_i prod_{j > i} (1 - h_j) (h_0 taken as 1)."""
    k = len(draft)
    weight, hold = block_chances(draft, p)
    out = {}
    for tau in range(k + 1):
        chance = float((hold[tau] if tau else 1.0) * torch.prod(1 - hold[tau + 1 :]))
        weights = residual(draft, p, weight, torch.tensor([tau]))
        for token, w in enumerate((weights / weights.sum()).tolist()):
            out[(tau, token)] = chance * w
    return out


def token_rule_outcomes(draft: Draft, p: torch.Tensor) -> dict[tuple[int, int], float]:
    """The same for speculative sampling token by token (Leviathan et al., 2023), written out independently."""
    out, alive = {}, 1.0
    for i, x in enumerate(draft.tokens.tolist()):
        accept = min(1.0, float(p[i, x] / draft.probs[i, x]))
        residual = (p[i] - draft.probs[i]).clamp_min(0)
        for token, w in enumerate((residual / residual.sum()).tolist() if residual.sum() > 0 else [0.0] * VOCAB):
            out[(i, token)] = alive * (1 - accept) * w
        alive *= accept
    for token, w in enumerate(p[len(draft)].tolist()):
        out[(len(draft), token)] = alive * w
    return out


def emitted_joint(P: dict, Q: dict, k: int, outcomes) -> tuple[dict, float]:
    """The joint distribution of k + 1 tokens when a verifier's emitted tokens are continued by the target, and
    the mean number of tokens a block emits, over drafts drawn from Q."""
    joint, emitted = {}, 0.0
    for x in itertools.product(range(VOCAB), repeat=k):
        draft = Draft(tokens=torch.tensor(x), probs=_rows(Q, x, k))
        q_x = _prob(Q, x)
        for (tau, token), chance in outcomes(draft, _rows(P, x, k + 1)).items():
            seq = (*x[:tau], token)
            emitted += q_x * chance * len(seq)
            for tail in itertools.product(range(VOCAB), repeat=k + 1 - len(seq)):
                full = seq + tail
                joint[full] = joint.get(full, 0.0) + q_x * chance * _prob(P, full, len(seq))
    return joint, emitted


def _error(P: dict, joint: dict, k: int) -> float:
    return max(abs(joint.get(seq, 0.0) - _prob(P, seq)) for seq in itertools.product(range(VOCAB), repeat=k + 1))


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("sharpness", [1.0, 3.0])
def test_block_verification_is_exact_and_emits_at_least_the_token_rule(k: int, seed: int, sharpness: float) -> None:
    P, Q = _tables(seed, k, sharpness)
    joint, block = emitted_joint(P, Q, k, block_outcomes)
    assert _error(P, joint, k) < 1e-12
    token_joint, token = emitted_joint(P, Q, k, token_rule_outcomes)
    assert _error(P, token_joint, k) < 1e-12  # the reference itself is exact
    assert block >= token - 1e-12
    if k > 1:
        assert block > token + 1e-6  # these random tables leave room: the block rule uses it


def _unscaled_residual(draft, p, weight, tau):
    """Deliberately wrong: the residual of the token rule, max(p_τ - q_τ, 0), without the block weight w_τ."""
    return block_residual(draft, p, torch.ones_like(weight), tau)


def _first_failure(draft: Draft, p: torch.Tensor, residual=block_residual) -> dict[tuple[int, int], float]:
    """Deliberately wrong: the block's chances, but τ taken as the first position that does not hold, minus one."""
    weight, hold = block_chances(draft, p)
    out, alive = {}, 1.0
    for tau in range(len(draft) + 1):
        stop = 1.0 - float(hold[tau + 1]) if tau < len(draft) else 1.0
        weights = residual(draft, p, weight, torch.tensor([tau]))
        for token, w in enumerate((weights / weights.sum()).tolist()):
            out[(tau, token)] = alive * stop * w
        alive *= 1.0 - stop
    return out


@pytest.mark.parametrize("broken", [lambda d, p: block_outcomes(d, p, residual=_unscaled_residual), _first_failure],
                         ids=["unscaled-residual", "first-failure"])
def test_the_enumeration_catches_a_broken_block_rule(broken) -> None:
    P, Q = _tables(3, 3, 1.0)  # (seed 0's tables happen to reach no residual with w_τ < 1: any scaling is exact there)
    joint, _ = emitted_joint(P, Q, 3, broken)
    assert _error(P, joint, 3) > 1e-3


@pytest.mark.parametrize("one_hot", [False, True], ids=["sampled", "one-hot"])
@pytest.mark.parametrize("seed", range(3))
def test_verify_draws_the_block_rules_outcomes(seed: int, one_hot: bool) -> None:
    """``verify``'s own draws (τ, next token) for one draft follow :func:`block_outcomes` (chi-square): one-hot rows
    (prompt lookup's), which it hands to the token rule, as well."""
    P, Q = _tables(seed + 10, 3, 1.0)
    x = (0, 1, 2)
    q = torch.nn.functional.one_hot(torch.tensor(x), VOCAB).float() if one_hot else _rows(Q, x, 3).float()
    draft, p = Draft(tokens=torch.tensor(x), probs=q), _rows(P, x, 4).float()
    g = torch.Generator().manual_seed(seed)
    verifier = BlockVerifier()
    draws = []
    for _ in range(6000):
        verdict = verifier.verify(draft, p, g)
        draws.append((verdict.num_accepted, verdict.next_token))
    assert chi_square_pvalue(draws, block_outcomes(draft, p)) > ALPHA


def test_with_one_hot_drafts_a_block_holds_as_long_as_the_token_rule_accepts() -> None:
    """Prompt lookup's drafts (q one-hot): P(τ >= i) = p_0(x_1) … p_{i-1}(x_i), the token rule's exactly."""
    P, _ = _tables(5, 3, 2.0)
    x = (2, 0, 1)
    draft = Draft(tokens=torch.tensor(x), probs=torch.nn.functional.one_hot(torch.tensor(x), VOCAB).double())
    p = _rows(P, x, 4)
    block, token = block_outcomes(draft, p), token_rule_outcomes(draft, p)
    for i in range(4):
        reach = [sum(v for (tau, _), v in table.items() if tau >= i) for table in (block, token)]
        assert reach[0] == pytest.approx(reach[1], abs=1e-12)
        assert reach[0] == pytest.approx(_prob(P, x[:i]), abs=1e-12)


@settings(max_examples=8, deadline=None)
@given(stack_cases(temperatures=(0.5, 1.0, 1.5)))
def test_stacks_verified_by_blocks_sample_the_target(device: str, case) -> None:
    stops = () if case.stop_token is None else (case.stop_token,)
    stack = SpeculationStack.build(case.levels(device), sampling=case.sampling, stop_tokens=stops, seed=case.seed, verifier=BlockVerifier())
    assert stack_pvalue(stack, case.target(), case.sampling, [1, 2], length=3, stop_tokens=stops) > ALPHA


@settings(max_examples=20, deadline=None)
@given(stack_cases(temperatures=(0.0,)))
def test_greedy_stacks_verified_by_blocks_equal_argmax_decoding(device: str, case) -> None:
    stops = () if case.stop_token is None else (case.stop_token,)
    stack = SpeculationStack.build(case.levels(device), sampling=case.sampling, stop_tokens=stops, seed=case.seed, verifier=BlockVerifier())
    assert list(stack.generate([1, 2], 24).tokens) == greedy_decode(case.target(), [1, 2], 24, stops)


def test_a_block_verified_stack_accepts_more_drafted_tokens_than_the_token_rule(device: str) -> None:
    """Same synthetic draft and target, T = 1, 400 tokens: more tokens a round under the block rule."""
    target = SyntheticLM(device=device, vocab_size=8, seed=3, sharpness=1.5)
    draft = SyntheticLM(device=device, vocab_size=8, seed=4, base=target, noise=1.0)
    sampling = SamplingConfig(temperature=1.0)
    per_round = {}
    for verifier in (None, BlockVerifier()):
        stack = SpeculationStack.build([Level(model=draft), Level(model=target, gamma=6)], sampling=sampling, verifier=verifier, seed=0)
        stats = stack.generate([1, 2], 400, seed=0).levels[-1]
        per_round[verifier is None] = stats.emitted / stats.rounds
    assert per_round[False] > per_round[True]


def test_the_block_verifier_is_registered_refuses_trees_and_uses_only_its_generator() -> None:
    assert "block" in Registry.create().names(Kind.VERIFIER)
    tree = Draft(tokens=torch.tensor([0, 1]), probs=torch.full((2, VOCAB), 1 / VOCAB), parents=torch.tensor([-1, -1]),
                 kind=DraftKind.TREE_WITH_REPLACEMENT)
    with pytest.raises(SpecstackError, match="verifier 'block' verifies chain drafts losslessly"):
        BlockVerifier().verify(tree, torch.full((3, VOCAB), 1 / VOCAB), torch.Generator())
    P, Q = _tables(1, 3, 1.0)
    x = (1, 1, 0)
    draft, p = Draft(tokens=torch.tensor(x), probs=_rows(Q, x, 3).float()), _rows(P, x, 4).float()
    runs = []
    for _ in range(2):
        torch.manual_seed(torch.randint(0, 1000, ()).item())  # the global RNG must not matter
        runs.append([BlockVerifier().verify(draft, p, torch.Generator().manual_seed(7)) for _ in range(3)])
    assert runs[0] == runs[1]


def test_a_stack_option_sets_the_block_verifier_at_every_level_and_an_unknown_one_is_one_line() -> None:
    """``-o verifier=block`` (``Registry.stack(verifier=…)``) verifies every level's chains by blocks."""
    target = SyntheticLM(vocab_size=8, seed=3, sharpness=1.5)
    registry, sampling = Registry.create(), SamplingConfig(temperature=1.0)
    stack = registry.stack("triforce-lookup", target=target, sampling=sampling, verifier="block", budget=16, chunk_size=4, stride=8)
    assert [stack.top.verifier.name, stack.top.drafter.verifier.name] == ["block", "block"]
    with pytest.raises(SpecstackError, match="unknown verifier 'blocks'; available: block, greedy"):
        registry.stack("triforce-lookup", target=target, sampling=sampling, verifier="blocks")
