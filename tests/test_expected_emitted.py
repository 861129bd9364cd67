"""``expected_emitted``: the tokens a round emits in expectation under a tree verifier, checked against the closed
form on chains and against the verifiers' own draws on trees."""

from __future__ import annotations

import math

import pytest
import torch

from specstack.sampling import draw_without_replacement
from specstack.types import Draft, DraftKind
from specstack.verify import SequoiaVerifier, SpecInferVerifier, TokenTreeVerifier, expected_emitted

V = 6
PARENTS = [-1, -1, 0, 0, 1, 2]  # two children of the root, two of node 0, one each of nodes 1 and 2


def _rows(count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(count, V, generator=generator), dim=-1)  # [count, V]


def _tree(kind: DraftKind, seed: int) -> Draft:
    """A tree of ``PARENTS`` whose siblings share their parent's q row: drawn without replacement (Sequoia's kind),
    with replacement (SpecInfer's), or the top ranks (deterministic)."""
    q, generator = _rows(len(PARENTS) + 1, seed), torch.Generator().manual_seed(seed + 1)
    tokens = [0] * len(PARENTS)
    for parent in [-1, *range(len(PARENTS))]:
        children = [i for i, p in enumerate(PARENTS) if p == parent]
        if not children:
            continue
        row = q[parent + 1]
        if kind is DraftKind.TREE_WITHOUT_REPLACEMENT:
            picks = draw_without_replacement(row, len(children), generator).tolist()
        elif kind is DraftKind.TREE_WITH_REPLACEMENT:
            picks = torch.multinomial(row, len(children), replacement=True, generator=generator).tolist()
        else:
            picks = row.topk(len(children)).indices.tolist()
        for child, token in zip(children, picks):
            tokens[child] = token
    probs = torch.stack([q[p + 1] for p in PARENTS])  # [k, V]: each node's parent's row
    return Draft(tokens=torch.tensor(tokens), probs=probs, kind=kind, parents=torch.tensor(PARENTS))


def test_a_chain_under_the_token_tree_rule_emits_one_plus_its_path_products() -> None:
    p = _rows(4, seed=3)  # [k+1, V]
    tokens = torch.tensor([1, 4, 2])
    chain = Draft(tokens=tokens, probs=torch.nn.functional.one_hot(tokens, V).float())
    accepted = [float(p[i, tokens[i]]) for i in range(3)]
    closed = 1 + accepted[0] + accepted[0] * accepted[1] + accepted[0] * accepted[1] * accepted[2]
    assert expected_emitted(TokenTreeVerifier(), chain, p) == pytest.approx(closed, abs=1e-6)


@pytest.mark.parametrize(("verifier", "kind"), [
    (SequoiaVerifier(), DraftKind.TREE_WITHOUT_REPLACEMENT),
    (SpecInferVerifier(), DraftKind.TREE_WITH_REPLACEMENT),
    (TokenTreeVerifier(), DraftKind.TREE_DETERMINISTIC),
], ids=["sequoia", "specinfer", "token-tree"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_expectation_matches_the_verifiers_own_draws(verifier, kind: DraftKind, seed: int) -> None:
    """The mean of 1 + the accepted path's length over 6,000 verifies, within five standard errors."""
    draft, p = _tree(kind, seed), _rows(len(PARENTS) + 1, seed + 50)
    generator = torch.Generator().manual_seed(seed + 7)
    emitted = torch.tensor([1.0 + len(verifier.verify(draft, p, generator).accepted) for _ in range(6000)])
    error = float(emitted.std()) / math.sqrt(len(emitted))
    assert abs(expected_emitted(verifier, draft, p) - float(emitted.mean())) < 5 * error + 1e-9
