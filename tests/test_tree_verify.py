"""Tree verifiers emit exactly the target's distribution: checked by enumeration, not sampling.

Method: p(context) and q(context) are deterministic functions of the context (synthetic models,
warped). For a tree shape and a draft kind, every draft the drafter can produce is enumerated with
its exact probability; for each, the exact distribution of the emitted tokens is computed by
recursing through the verifier's ``step`` (:func:`verdict_distribution`); every emitted sequence
is extended to depth + 1 tokens with the target's exact continuation probabilities. The result
must equal the target's own distribution over sequences of that length. Deliberately broken
verifiers fail the same check, and ``verify`` (which samples) agrees with ``step`` (chi-square).
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from typing import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specstack.errors import SpecstackError
from specstack.sampling import SamplingConfig, warp
from specstack.synthetic import SyntheticLM, sequence_probabilities
from specstack.testing import chi_square_pvalue
from specstack.types import Draft, DraftKind, Verdict
from specstack.verify import (GreedyVerifier, NodeOutcome, SequoiaVerifier, SpecInferVerifier, SpeculativeSamplingVerifier,
                              TokenTreeVerifier, TreeVerifier, Verifier, check_verdict, default_verifier,
                              multi_step_sampling, recovery_distribution, without_token)

PROMPT = (1, 2)
ATOL = 1e-6

SHAPES = {  # parents, topologically ordered; siblings in index order
    "star2": [-1, -1],
    "star3": [-1, -1, -1],
    "chain3": [-1, 0, 1],
    "binary2": [-1, -1, 0, 0, 1, 1],
    "irregular": [-1, 0, 0, -1, 1, 3],
}
WARPS = {
    "t1": SamplingConfig(temperature=1.0),
    "topk2": SamplingConfig(temperature=1.0, top_k=2),
    "topp": SamplingConfig(temperature=1.0, top_p=0.7),
}
GREEDY = SamplingConfig(temperature=0.0)


# -- the exact model: p and q as functions of the context -------------------------------------------


class World:
    """A target and a correlated drafter over ``vocab`` tokens, warped by ``sampling`` (q at T=1 for
    a greedy target, so that greedy verification sees non-trivial drafts)."""

    def __init__(self, vocab: int, sampling: SamplingConfig, seed: int = 0) -> None:
        self.vocab, self.sampling = vocab, sampling
        self.target = SyntheticLM(vocab_size=vocab, seed=seed, sharpness=1.5)
        self.drafter = SyntheticLM(vocab_size=vocab, seed=seed + 1, base=self.target, noise=1.0)
        self.draft_sampling = SamplingConfig(temperature=1.0) if sampling.greedy else sampling

    @functools.cache
    def p(self, context: tuple[int, ...]) -> torch.Tensor:
        return warp(self.target.logits_for(list(context)), self.sampling)  # [V]

    @functools.cache
    def q(self, context: tuple[int, ...]) -> torch.Tensor:
        return warp(self.drafter.logits_for(list(context)), self.draft_sampling)  # [V]

    @functools.cache
    def continuations(self, context: tuple[int, ...], n: int) -> dict[tuple[int, ...], float]:
        """Exact target probability of every n-token continuation of ``context``."""
        if n == 0:
            return {(): 1.0}
        out = {}
        for token, prob in enumerate(self.p(context).tolist()):
            if prob > 0:
                for rest, tail in self.continuations((*context, token), n - 1).items():
                    out[(token, *rest)] = prob * tail
        return out


def path_tokens(parents: list[int], tokens: list[int], node: int) -> tuple[int, ...]:
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return tuple(path[::-1])


def child_distribution(q: torch.Tensor, siblings: list[int], kind: DraftKind) -> list[tuple[int, float]]:
    """The next sibling's token distribution, given the earlier siblings' tokens."""
    if kind in (DraftKind.CHAIN, DraftKind.TREE_WITH_REPLACEMENT):
        return list(enumerate(q.tolist()))
    if kind is DraftKind.TREE_WITHOUT_REPLACEMENT:
        rest = q.clone()
        rest[siblings] = 0.0
        if rest.sum() > 0:
            return list(enumerate((rest / rest.sum()).tolist()))
        return [(next(t for t in range(len(q)) if t not in siblings), 1.0)]  # support exhausted: a fixed pick
    ranked = q.argsort(descending=True, stable=True).tolist()  # deterministic: top-k by q
    return [(ranked[len(siblings) % len(ranked)], 1.0)]


def lookup_children(q: torch.Tensor, siblings: list[int], kind: DraftKind) -> list[tuple[int, float]]:
    """Deterministic candidates with repeats (two prompt-lookup matches proposing the same token)."""
    ranked = q.argsort(descending=True, stable=True).tolist()
    return [(ranked[len(siblings) // 2], 1.0)]


def enumerate_drafts(world: World, parents: list[int], kind: DraftKind, children=child_distribution) -> Iterator[tuple[Draft, float]]:
    """Every draft of this shape and kind with its exact probability."""

    def grow(tokens: list[int], prob: float) -> Iterator[tuple[list[int], float]]:
        i = len(tokens)
        if i == len(parents):
            yield tokens, prob
            return
        q = world.q(PROMPT + path_tokens(parents, tokens, parents[i]))
        siblings = [tokens[j] for j in range(i) if parents[j] == parents[i]]
        for token, chance in children(q, siblings, kind):
            if chance > 0:
                yield from grow([*tokens, token], prob * chance)

    for tokens, prob in grow([], 1.0):
        rows = [world.q(PROMPT + path_tokens(parents, tokens, parent)) for parent in parents]
        probs = torch.stack(rows) if rows else torch.empty(0, world.vocab)  # [k, V]
        tree = None if kind is DraftKind.CHAIN else torch.tensor(parents, dtype=torch.long)
        yield Draft(tokens=torch.tensor(tokens, dtype=torch.long), probs=probs, parents=tree, kind=kind), prob


def target_rows(world: World, draft: Draft) -> torch.Tensor:
    """p [k+1, V]: at the root, then after each draft token."""
    parents, tokens = draft.parent_index().tolist(), draft.tokens.tolist()
    return torch.stack([world.p(PROMPT + path_tokens(parents, tokens, node)) for node in range(-1, len(draft))])


# -- exact outcomes of one draft -----------------------------------------------------------------------


def verdict_distribution(verifier: Verifier, draft: Draft, p: torch.Tensor) -> dict[tuple, float]:
    """Exact probability of every (accepted, next_token, bonus), by recursing through ``step``'s
    NodeOutcomes (a deterministic verifier: its one verdict)."""
    if not isinstance(verifier, TreeVerifier):
        verdict = verifier.verify(draft, p, torch.Generator())
        return {(verdict.accepted, verdict.next_token, verdict.bonus): 1.0}
    out: dict[tuple, float] = defaultdict(float)

    def walk(node: int, accepted: tuple[int, ...], prob: float) -> None:
        children = draft.children(node)
        if not children:
            for token, chance in enumerate(p[node + 1].tolist()):
                out[(accepted, token, True)] += prob * chance
            return
        outcome = verifier.step(p[node + 1], draft.probs[children[0]], draft.tokens[children])
        accept = outcome.accept.tolist()
        for child, chance in zip(children, accept):
            if chance > 0:
                walk(child, (*accepted, child), prob * chance)
        stop = max(0.0, 1.0 - sum(accept))
        for token, chance in enumerate(outcome.residual.tolist()):
            out[(accepted, token, False)] += prob * stop * chance

    walk(-1, (), 1.0)
    return {key: prob for key, prob in out.items() if prob > 0}


def output_error(verifier: Verifier, world: World, shape: str, kind: DraftKind, children=child_distribution) -> float:
    """Max |P_stack(s) - P_target(s)| over sequences s of depth + 1 tokens."""
    parents = SHAPES[shape]
    length = max(len(path_tokens(parents, parents, node)) for node in range(len(parents))) + 1  # depth + 1
    total: dict[tuple[int, ...], float] = defaultdict(float)
    for draft, draft_prob in enumerate_drafts(world, parents, kind, children):
        tokens = draft.tokens.tolist()
        for (accepted, next_token, _), prob in verdict_distribution(verifier, draft, target_rows(world, draft)).items():
            emitted = (*(tokens[i] for i in accepted), next_token)
            for rest, tail in world.continuations(PROMPT + emitted, length - len(emitted)).items():
                total[emitted + rest] += draft_prob * prob * tail
    exact = sequence_probabilities(world.target, list(PROMPT), length, world.sampling)
    return max(abs(total.get(s, 0.0) - exact.get(s, 0.0)) for s in set(total) | set(exact))


# -- deliberately broken verifiers ----------------------------------------------------------------------


class LiteralSequoia(SequoiaVerifier):
    """Sequoia's loop as written for distinct siblings, with no care for a token q_j cannot draw: it
    is tested with r * 0 < p_j(x) and q_j is still subtracted from p on its rejection. Exact on
    without-replacement drafts (while q's support lasts); wrong on drafts with repeated siblings."""

    def step(self, p_row, q_row, tokens) -> NodeOutcome:
        p, q, accept, reach = p_row, q_row, [], 1.0
        for x in tokens.tolist():
            ratio = min(1.0, float(p[x] / q[x])) if q[x] > 0 else float(p[x] > 0)
            accept.append(reach * ratio)
            reach *= 1.0 - ratio
            p, q = recovery_distribution(p, q), without_token(q, x)
        return NodeOutcome(accept=torch.tensor(accept), residual=p)


class NotRenormalisedSequoia(SequoiaVerifier):
    """Wrong: removes a rejected sibling's token from q but does not renormalise (on these drafts the
    same as SpecInfer's rule, q never changed)."""

    def step(self, p_row, q_row, tokens) -> NodeOutcome:
        return multi_step_sampling(p_row, q_row, tokens, after_rejection=lambda q, x: q.index_fill(0, torch.tensor([x]), 0.0))


class PerPathTokenTree(TokenTreeVerifier):
    """Wrong (Medusa-style): an independent target sample per root-to-leaf path; the first path
    whose sample matches its token wins, so child j is accepted with p(x_j) * prod_{i<j} (1 - p(x_i))."""

    def step(self, p_row, q_row, tokens) -> NodeOutcome:
        hit = p_row[tokens]  # [m]
        missed_before = torch.cat([torch.ones(1), (1 - hit).cumprod(0)[:-1]])  # [m]
        rest = p_row.index_fill(0, tokens, 0.0)  # [V]
        return NodeOutcome(accept=hit * missed_before, residual=rest / rest.sum() if rest.sum() > 0 else p_row)


# -- the exact check ----------------------------------------------------------------------------------------

W = DraftKind.TREE_WITHOUT_REPLACEMENT
R = DraftKind.TREE_WITH_REPLACEMENT
D = DraftKind.TREE_DETERMINISTIC
VERIFIER_KINDS = [(SequoiaVerifier(), W), (SpecInferVerifier(), R), (TokenTreeVerifier(), D), (TokenTreeVerifier(), W),
                  (TokenTreeVerifier(), R)]
TREE_SHAPES = [("star2", 4), ("star3", 3), ("binary2", 3), ("irregular", 3)]


@pytest.mark.parametrize("warp_name", WARPS)
@pytest.mark.parametrize("shape, vocab", TREE_SHAPES, ids=[s for s, _ in TREE_SHAPES])
@pytest.mark.parametrize("verifier, kind", VERIFIER_KINDS, ids=lambda x: getattr(x, "name", getattr(x, "value", "")))
def test_tree_verifier_is_exact_on_the_kinds_it_accepts(verifier: TreeVerifier, kind: DraftKind, shape: str, vocab: int,
                                                         warp_name: str) -> None:
    assert kind in verifier.accepts
    assert output_error(verifier, World(vocab, WARPS[warp_name]), shape, kind) < ATOL


@pytest.mark.parametrize("warp_name", WARPS)
@pytest.mark.parametrize("verifier", [SequoiaVerifier(), SpecInferVerifier(), TokenTreeVerifier()], ids=lambda v: v.name)
def test_tree_verifier_is_exact_on_chains(verifier: TreeVerifier, warp_name: str) -> None:
    assert output_error(verifier, World(4, WARPS[warp_name]), "chain3", DraftKind.CHAIN) < ATOL


@pytest.mark.parametrize("warp_name", WARPS)
@pytest.mark.parametrize("shape", ["star2", "irregular"])
def test_token_tree_is_exact_with_repeated_candidates(shape: str, warp_name: str) -> None:
    assert output_error(TokenTreeVerifier(), World(3, WARPS[warp_name]), shape, D, children=lookup_children) < ATOL


GREEDY_CASES = [(DraftKind.CHAIN, "chain3"), (W, "star3"), (W, "irregular"), (R, "irregular"), (D, "star3"), (D, "irregular")]


@pytest.mark.parametrize("kind, shape", GREEDY_CASES, ids=[f"{k.value}-{s}" for k, s in GREEDY_CASES])
def test_greedy_verifier_is_exact_at_temperature_zero(kind: DraftKind, shape: str) -> None:
    assert output_error(GreedyVerifier(), World(3, GREEDY), shape, kind) < ATOL


BROKEN = [
    pytest.param(LiteralSequoia(), R, "star2", 4, id="sequoia-on-with-replacement"),
    pytest.param(NotRenormalisedSequoia(), W, "star2", 4, id="siblings-not-renormalised"),
    pytest.param(PerPathTokenTree(), D, "star2", 4, id="independent-per-path-samples"),
    pytest.param(PerPathTokenTree(), D, "binary2", 3, id="independent-per-path-samples-binary"),
]


@pytest.mark.parametrize("broken, kind, shape, vocab", BROKEN)
def test_the_exact_check_catches_a_broken_verifier(broken: TreeVerifier, kind: DraftKind, shape: str, vocab: int) -> None:
    """A test of the test: the same check fails for rules known to be lossy."""
    assert output_error(broken, World(vocab, WARPS["t1"]), shape, kind) > 1e-3


def test_literal_sequoia_is_exact_on_its_own_kind() -> None:
    """The control for the first broken case: the same rule passes on distinct siblings."""
    assert output_error(LiteralSequoia(), World(4, WARPS["t1"]), "star2", W) < ATOL


def test_sequoia_tolerates_repeated_siblings() -> None:
    """Taking q as one-hot on a token it cannot draw makes a repeat a no-op, so SequoiaVerifier is
    exact even on with-replacement drafts (it still declares only the kinds it was designed for)."""
    assert output_error(SequoiaVerifier(), World(3, WARPS["t1"]), "binary2", R) < ATOL


# -- verify (sampling) agrees with step (exact) -------------------------------------------------------------


def richest_draft(verifier: TreeVerifier, world: World, kind: DraftKind) -> tuple[Draft, torch.Tensor]:
    """Of the first 100 drafts of the irregular shape, the one whose verification has the most outcomes."""
    drafts = itertools.islice(enumerate_drafts(world, SHAPES["irregular"], kind), 100)
    candidates = [(draft, target_rows(world, draft)) for draft, _ in drafts]
    return max(candidates, key=lambda pair: len(verdict_distribution(verifier, *pair)))


@pytest.mark.parametrize("verifier, kind", [(SequoiaVerifier(), W), (SpecInferVerifier(), R), (TokenTreeVerifier(), D)],
                         ids=lambda x: getattr(x, "name", getattr(x, "value", "")))
def test_verify_samples_the_outcomes_step_computes(verifier: TreeVerifier, kind: DraftKind) -> None:
    draft, p = richest_draft(verifier, World(3, WARPS["t1"], seed=4), kind)
    exact = verdict_distribution(verifier, draft, p)
    assert len(exact) > 6
    generator = torch.Generator().manual_seed(11)
    drawn = []
    for _ in range(2000):
        verdict = verifier.verify(draft, p, generator)
        drawn.append((verdict.accepted, verdict.next_token, verdict.bonus))
    assert chi_square_pvalue(drawn, exact) > 1e-4


def test_greedy_follows_the_argmax_path() -> None:
    p = torch.eye(4)[[2, 1, 3, 0, 0]]  # argmax at the root 2; after node 1 it is 3; after node 3, 0
    draft = Draft(tokens=torch.tensor([1, 2, 2, 3]), probs=torch.full((4, 4), 0.25), parents=torch.tensor([-1, -1, -1, 1]),
                  kind=D)
    assert GreedyVerifier().verify(draft, p, torch.Generator()) == Verdict(accepted=(1, 3), next_token=0, bonus=True)
    draft = Draft(tokens=torch.tensor([1, 2, 0]), probs=torch.full((3, 4), 0.25), parents=torch.tensor([-1, -1, 1]), kind=D)
    assert GreedyVerifier().verify(draft, p, torch.Generator()) == Verdict(accepted=(1,), next_token=3, bonus=False)


def test_token_tree_step_counts_a_repeated_candidate_once() -> None:
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    outcome = TokenTreeVerifier().step(p, torch.full((4,), 0.25), torch.tensor([2, 2, 0]))
    assert outcome.accept.tolist() == pytest.approx([0.3, 0.0, 0.1])
    assert outcome.residual.tolist() == pytest.approx([0.0, 1 / 3, 0.0, 2 / 3])


def test_sequoia_step_has_no_nan_when_q_runs_out() -> None:
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([1.0, 0.0, 0.0])
    outcome = SequoiaVerifier().step(p, q, torch.tensor([0, 1, 2]))  # 1 and 2 are fixed picks once q is exhausted
    assert torch.isfinite(outcome.accept).all() and torch.isfinite(outcome.residual).all()
    assert outcome.accept.tolist() == pytest.approx([0.5, 0.5, 0.0])
    assert recovery_distribution(p, p).tolist() == p.tolist()


# -- well-formed verdicts (hypothesis) ------------------------------------------------------------------------


@st.composite
def trees(draw, kinds=tuple(DraftKind)) -> tuple[Draft, torch.Tensor]:
    vocab = draw(st.integers(2, 6))
    k = draw(st.integers(0, 8))
    kind = draw(st.sampled_from(sorted(kinds, key=lambda kind: kind.value)))
    parents = None if kind is DraftKind.CHAIN else torch.tensor([draw(st.integers(-1, i - 1)) for i in range(k)], dtype=torch.long)
    seed = draw(st.integers(0, 2**31))
    sampling = draw(st.sampled_from([SamplingConfig(temperature=1.0), SamplingConfig(temperature=1.0, top_k=2), GREEDY]))
    logits = 2 * torch.randn(2 * k + 1, vocab, generator=torch.Generator().manual_seed(seed))
    probs = warp(logits, sampling)  # [2k+1, V]
    tokens = torch.randint(0, vocab, (k,), generator=torch.Generator().manual_seed(seed + 1))
    draft = Draft(tokens=tokens, probs=probs[:k], parents=parents, kind=kind)
    return draft, probs[k:]  # p [k+1, V]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([SequoiaVerifier(), SpecInferVerifier(), TokenTreeVerifier(), GreedyVerifier()]), st.data())
def test_tree_verdicts_are_well_formed(verifier: Verifier, data) -> None:
    draft, p = data.draw(trees(verifier.accepts))
    verdict = verifier.verify(draft, p, torch.Generator().manual_seed(0))
    assert check_verdict(verdict, draft, p.shape[-1], verifier.name) is verdict
    leaf = not draft.children(verdict.accepted[-1] if verdict.accepted else -1)
    assert verdict.bonus == leaf


MALFORMED = [
    pytest.param(Verdict(accepted=(2,), next_token=0, bonus=False), id="starts-below-the-root"),
    pytest.param(Verdict(accepted=(0, 3), next_token=0, bonus=False), id="skips-a-parent"),
    pytest.param(Verdict(accepted=(0, 1), next_token=0, bonus=False), id="siblings-not-a-path"),
    pytest.param(Verdict(accepted=(4,), next_token=0, bonus=False), id="index-out-of-range"),
    pytest.param(Verdict(accepted=(-1,), next_token=0, bonus=False), id="negative-index"),
    pytest.param(Verdict(accepted=(), next_token=5, bonus=False), id="token-outside-vocabulary"),
    pytest.param(Verdict(accepted=(), next_token=-1, bonus=False), id="negative-token"),
    pytest.param(Verdict(accepted=(), next_token=torch.tensor(1), bonus=False), id="token-not-an-int"),
    pytest.param(Verdict(accepted=(0,), next_token=1, bonus=1), id="bonus-not-a-bool"),
]


@pytest.mark.parametrize("verdict", MALFORMED)
def test_check_verdict_rejects_malformed_verdicts(verdict: Verdict) -> None:
    draft = Draft(tokens=torch.tensor([0, 1, 2, 3]), probs=torch.full((4, 5), 0.2), parents=torch.tensor([-1, -1, 0, 2]), kind=W)
    with pytest.raises(SpecstackError, match="verifier 'plugin'") as error:
        check_verdict(verdict, draft, 5, "plugin")
    assert "\n" not in str(error.value)


@given(st.integers(2, 6))
def test_check_verdict_accepts_an_empty_draft_verdict(vocab: int) -> None:
    verdict = Verdict(accepted=(), next_token=vocab - 1, bonus=True)
    assert check_verdict(verdict, Draft.empty(vocab), vocab, "plugin") is verdict


# -- choosing and refusing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, expected", [(DraftKind.CHAIN, SpeculativeSamplingVerifier), (W, SequoiaVerifier),
                                            (R, SpecInferVerifier), (D, TokenTreeVerifier)], ids=lambda x: getattr(x, "value", ""))
def test_default_verifier_picks_by_kind(kind: DraftKind, expected: type) -> None:
    verifier = default_verifier(kind, SamplingConfig(temperature=0.7))
    assert type(verifier) is expected and kind in verifier.accepts
    assert type(default_verifier(kind, GREEDY)) is GreedyVerifier


def test_accepted_kinds() -> None:
    assert SpeculativeSamplingVerifier.accepts == {DraftKind.CHAIN}
    assert GreedyVerifier.accepts == TokenTreeVerifier.accepts == set(DraftKind)
    assert SequoiaVerifier.accepts == {DraftKind.CHAIN, W} and SpecInferVerifier.accepts == {DraftKind.CHAIN, R}


def test_speculative_sampling_refuses_a_tree() -> None:
    draft = Draft(tokens=torch.tensor([0, 1]), probs=torch.full((2, 3), 1 / 3), parents=torch.tensor([-1, -1]), kind=W)
    with pytest.raises(SpecstackError, match="speculative"):
        SpeculativeSamplingVerifier().verify(draft, torch.full((3, 3), 1 / 3), torch.Generator())
    mislabelled = Draft(tokens=torch.tensor([0, 1]), probs=torch.full((2, 3), 1 / 3), parents=torch.tensor([-1, -1]))
    with pytest.raises(SpecstackError, match="tree"):
        SpeculativeSamplingVerifier().verify(mislabelled, torch.full((3, 3), 1 / 3), torch.Generator())


def test_a_tree_verifier_refuses_a_kind_it_cannot_verify() -> None:
    draft = Draft(tokens=torch.tensor([0, 0]), probs=torch.full((2, 3), 1 / 3), parents=torch.tensor([-1, -1]), kind=R)
    with pytest.raises(SpecstackError, match="sequoia"):
        SequoiaVerifier().verify(draft, torch.full((3, 3), 1 / 3), torch.Generator())


def test_an_empty_draft_gives_a_bonus_token_from_the_root() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0]])
    for verifier in (SequoiaVerifier(), SpecInferVerifier(), TokenTreeVerifier()):
        assert verifier.verify(Draft.empty(3), p, torch.Generator()) == Verdict(accepted=(), next_token=1, bonus=True)
