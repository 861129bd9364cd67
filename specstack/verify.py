"""Verifiers: pure functions of probabilities and a ``torch.Generator``.

No model and no global random state is involved: a verifier sees the draft (tokens, the proposal
distribution ``q`` and, for a tree, each token's parent), the verifying level's distribution ``p``
at the root and after every draft token, and an explicit generator.

Chains are verified by :class:`SpeculativeSamplingVerifier` (vectorised) and trees by the
subclasses of :class:`TreeVerifier`, which walk the tree once and differ only in ``step``: what
happens at one node, given ``p`` and ``q`` there and the tokens of its children. Which verifier is
lossless depends on how the siblings were drawn (:class:`~specstack.types.DraftKind`);
:func:`default_verifier` picks it.
"""

from __future__ import annotations

import abc
from typing import Callable, ClassVar

import attrs
import torch

from .errors import SpecstackError
from .sampling import SamplingConfig, draw, first_argmax, sample
from .types import Capability, Draft, DraftKind, Verdict


class Verifier(abc.ABC):
    """Accepts or rejects a draft.

    ``verify(draft, p, generator)`` gets ``p`` [k+1, V]: row 0 is the verifying level's distribution
    at the root (after the committed prefix), row i + 1 its distribution after draft token i (the
    context is the prefix plus ``draft.path(i)``). It returns a :class:`Verdict` whose emitted tokens
    (``tokens[accepted]``, then ``next_token``) are distributed exactly as ``p`` would generate them
    autoregressively, provided the draft's kind is in ``accepts``.
    """

    name: ClassVar[str]
    accepts: ClassVar[frozenset[DraftKind]] = frozenset({DraftKind.CHAIN})  # kinds verified losslessly
    requires: ClassVar[frozenset[Capability]] = frozenset()  # what the verifying level's model must provide

    def check_sampling(self, sampling: SamplingConfig) -> None:
        """Raise :class:`~specstack.errors.SpecstackError` if this verifier cannot honour ``sampling``."""

    def check_draft(self, draft: Draft) -> None:
        """Raise :class:`~specstack.errors.SpecstackError` unless ``draft``'s kind is in ``accepts``."""
        if draft.kind not in self.accepts:
            kinds = ", ".join(sorted(kind.value for kind in self.accepts))
            raise SpecstackError(f"verifier '{self.name}' verifies {kinds} drafts losslessly, not a {draft.kind.value} draft")

    @abc.abstractmethod
    def verify(self, draft: Draft, p: torch.Tensor, generator: torch.Generator) -> Verdict:
        ...


def _chain_length(verifier: Verifier, draft: Draft) -> int:
    """len(draft), once ``verifier`` has checked its kind and that it is a chain (one error line otherwise)."""
    verifier.check_draft(draft)
    if not _is_chain(draft):
        raise SpecstackError(f"verifier '{verifier.name}' verifies chains; this draft is a tree")
    return len(draft)


def _is_chain(draft: Draft) -> bool:
    """Whether every token's parent is the token before it (parents None, or spelled out)."""
    return draft.parents is None or bool((draft.parents == torch.arange(len(draft), device=draft.parents.device) - 1).all())


class GreedyVerifier(Verifier):
    """Accept while the draft token is the verifier's argmax; then emit the argmax.

    On a tree, follow the argmax path: at each node descend into the (first) child whose token is
    ``argmax p``; where there is none, emit the argmax. The output equals argmax decoding of the
    verifying level token for token, whatever the draft, so every kind is accepted.
    """

    name = "greedy"
    accepts = frozenset(DraftKind)

    def check_sampling(self, sampling: SamplingConfig) -> None:
        if not sampling.deterministic:
            raise SpecstackError(
                f"verifier 'greedy' needs temperature 0 or coupled sampling, got temperature {sampling.temperature}; use 'speculative' to sample"
            )

    def verify(self, draft: Draft, p: torch.Tensor, generator: torch.Generator) -> Verdict:
        best = first_argmax(p)  # [k+1]
        if draft.parents is None:
            agree = (draft.tokens == best[: len(draft)]).long()  # [k]
            m = agree.cumprod(dim=0).sum()  # []
            m, token = torch.stack([m, best[m]]).tolist()  # the round's one host synchronisation
            return Verdict(accepted=tuple(range(m)), next_token=token, bonus=m == len(draft))
        return self._walk(draft, best.tolist())

    @staticmethod
    def _walk(draft: Draft, best: list[int]) -> Verdict:
        node, accepted, tokens = -1, [], draft.tokens.tolist()
        while children := draft.children(node):
            match = next((child for child in children if tokens[child] == best[node + 1]), None)
            if match is None:
                return Verdict(accepted=tuple(accepted), next_token=best[node + 1], bonus=False)
            node = match
            accepted.append(node)
        return Verdict(accepted=tuple(accepted), next_token=best[node + 1], bonus=True)


class SpeculativeSamplingVerifier(Verifier):
    """Lossless speculative sampling of a chain (Leviathan et al., 2023; Chen et al., 2023).

    For each draft token x_i ~ q_i, accept with probability min(1, p_i(x_i) / q_i(x_i)). At the first
    rejection emit a token from the residual ``normalize(max(p_i - q_i, 0))``; if all k are accepted,
    emit a bonus token from p_k. Every emitted token is then distributed exactly as p. With one-hot
    p and q (temperature 0) this is the greedy rule. Trees are refused: use a :class:`TreeVerifier`.
    """

    name = "speculative"

    def verify(self, draft: Draft, p: torch.Tensor, generator: torch.Generator) -> Verdict:
        k = _chain_length(self, draft)
        rows = torch.arange(k, device=p.device)  # [k]
        p_x = p[rows, draft.tokens]  # [k]
        q_x = draft.probs[rows, draft.tokens]  # [k]
        u = torch.rand(k, generator=generator, device=p.device)  # [k]
        accept = (u * q_x < p_x).long()  # [k]; u < p/q without dividing
        m = accept.cumprod(dim=0).sum().reshape(1)  # [1] accepted tokens
        token = draw(recovery_weights(p.index_select(0, m)[0], _proposal_row(draft, m, p)), generator)  # [1]; past the draft q = 0, the residual p: the bonus
        m, token = torch.cat([m, token]).tolist()  # the round's one host synchronisation
        return Verdict(accepted=tuple(range(m)), next_token=token, bonus=m == k)


class BlockVerifier(Verifier):
    """Block verification of a chain (Sun et al., 2024, "Block Verification Accelerates Speculative Decoding",
    Algorithm 2): the optimal lossless verification of a chain drawn from q, which decides the block as a whole.

    With x_1 … x_k drawn from q_0 … q_{k-1} and the verifying level's p_0 … p_k (p_i after x_1 … x_i), let
    w_0 = 1 and w_i = min(1, w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i)), the residual r_i = max(w_i p_i - q_i, 0) (q_k = 0)
    and its mass R_i = sum_x r_i(x), and h_i = R_i / (R_i + 1 - w_i) for 0 < i < k, h_k = w_k. Draw η_i ~ U[0, 1)
    for i = 1 … k and keep τ, the largest i with η_i < h_i (0 if none): accept x_1 … x_τ and emit a token drawn
    from r_τ normalised (from p_k when τ = k). Unlike token-by-token verification (:class:`SpeculativeSamplingVerifier`)
    a rejected token does not end the block, and a later position may still accept it with what came before. The
    emitted tokens are distributed exactly as p generates them, and a block emits at least as many tokens in
    expectation (the paper's Theorem 2); ``tests/test_block_verify.py`` enumerates both exactly. With one-hot q
    (prompt lookup) or one-hot p (temperature 0) it accepts what the token rule accepts, as often: the gain comes
    from drafts sampled from a distribution, as TriForce's levels sample at T > 0, and a draft whose every token its
    row gave probability 1 is verified by the token rule itself, whose verdicts it then shares in law. Otherwise one
    pass over [k - 1, V] more than the token rule (the residual masses R_1 … R_{k-1}), and one host synchronisation
    more (whether the rows were one-hot).
    """

    name = "block"

    def verify(self, draft: Draft, p: torch.Tensor, generator: torch.Generator) -> Verdict:
        k = _chain_length(self, draft)
        if k and bool((draft.probs[torch.arange(k, device=p.device), draft.tokens] == 1).all()):
            return SpeculativeSamplingVerifier().verify(draft, p, generator)  # one-hot rows (prompt lookup): the same verdicts' law, cheaper
        weight, hold = block_chances(draft, p)  # [k+1], [k+1]
        eta = torch.rand(k, generator=generator, device=p.device)  # [k]
        held = (eta < hold[1:]) * torch.arange(1, k + 1, device=p.device)  # [k]: i where position i holds, else 0
        tau = torch.cat([held, held.new_zeros(1)]).max().reshape(1)  # [1]: the longest block that holds
        token = draw(block_residual(draft, p, weight, tau), generator)  # [1]
        tau, token = torch.cat([tau, token]).tolist()  # the round's one host synchronisation
        return Verdict(accepted=tuple(range(tau)), next_token=token, bonus=tau == k)


def block_chances(draft: Draft, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain's block weights w [k+1] and the chance h [k+1] that the block holds up to position i (h_0 = 0), as
    :class:`BlockVerifier` defines them. w_i = min(1, w_{i-1} ρ_i) (ρ_i = p_{i-1}(x_i) / q_{i-1}(x_i)) is
    exp(S_i - max_{j <= i} S_j) for S_i = sum_{j <= i} log ρ_j (S_0 = 0): a clamped product without a loop."""
    k = len(draft)
    rows = torch.arange(k, device=p.device)  # [k]
    ratio = p[rows, draft.tokens] / draft.probs[rows, draft.tokens].clamp_min(torch.finfo(p.dtype).tiny)  # [k]
    logs = torch.cat([ratio.new_zeros(1), ratio.log().cumsum(0)])  # [k+1]: S_0 … S_k
    weight = (logs - logs.cummax(0).values).exp()  # [k+1]: w_0 = 1 … w_k
    inner = weight[1:k]  # [k-1]: w_1 … w_{k-1}, the positions whose residual decides h
    mass = (p[1:k] * inner[:, None] - draft.probs[1:k].to(p.dtype)).clamp_min_(0.0).sum(-1)  # [k-1]: R_1 … R_{k-1}
    spare = mass + 1 - inner  # [k-1]
    hold = torch.where(spare > 0, mass / spare.clamp_min(torch.finfo(p.dtype).tiny), 0.0)  # [k-1]
    return weight, torch.cat([weight.new_zeros(1), hold, weight[k:] if k else weight[:0]])  # [k+1], [k+1]: 0, h_1 … h_{k-1}, h_k = w_k


def block_residual(draft: Draft, p: torch.Tensor, weight: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """The unnormalised distribution r_τ = max(w_τ p_τ - q_τ, 0) [V] the next token is drawn from after a block of
    ``tau`` [1] accepted tokens (q_k = 0: p_k itself when τ = k; p_τ where rounding leaves r_τ no mass), chosen on
    the device. Rows of [V] only: temporaries of [k + 1, V] cost page faults on the CPU, more than the arithmetic."""
    p_tau = p.index_select(0, tau)[0]  # [V]
    residual = (p_tau * weight.index_select(0, tau) - _proposal_row(draft, tau, p)).clamp_min_(0.0)  # [V]
    return torch.where(residual.sum() > 0, residual, p_tau)  # [V]


def _proposal_row(draft: Draft, m: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """q_m [V], the row draft token m + 1 was drawn from, chosen on the device by ``m`` [1]; zeros past the draft
    (m = k), where the residual is p itself (the bonus)."""
    k = len(draft)
    return draft.probs.index_select(0, m.clamp(max=k - 1))[0] * (m < k) if k else torch.zeros_like(p[0])  # [V]


def recovery_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) for one position ([V], [V] -> [V]).

    A rejection implies p(x) < q(x) for the drafted x, so the residual has positive mass in exact
    arithmetic; if rounding leaves none, p and q agree to float precision and p itself is returned.
    """
    weights = recovery_weights(p, q)  # [V]
    return weights / weights.sum()  # [V]


def recovery_weights(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0) for one position ([V], [V] -> [V]), or p where rounding leaves it no mass: the residual
    unnormalised, as :func:`~specstack.sampling.draw` takes it (one pass over the vocabulary fewer)."""
    residual = (p - q).clamp_min_(0.0)  # [V]
    return torch.where(residual.sum() > 0, residual, p)  # [V]; decided on the device, no synchronisation


# -- trees -----------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True, eq=False)
class NodeOutcome:
    """What a tree verifier does at one node with m children, as probabilities.

    ``accept[j]`` is the probability that the walk descends into child j (the rejections of the
    children before it included), and ``residual`` the distribution ``next_token`` is drawn from when
    no child is accepted, which happens with probability ``1 - accept.sum()``.
    """

    accept: torch.Tensor  # [m]
    residual: torch.Tensor  # [V]


class TreeVerifier(Verifier):
    """Verifies a token tree by walking it from the root.

    At a node, ``step`` turns p's row there, the children's shared q row and their tokens into a
    :class:`NodeOutcome`; the walk draws one of its m + 1 outcomes: descend into child j, or stop and
    draw ``next_token`` from the residual. At a node without children the bonus token is drawn from
    p's row. Subclasses implement ``step`` only. A chain is the tree where each node has one child,
    and an empty draft gives a bonus token from ``p[0]``.
    """

    @abc.abstractmethod
    def step(self, p_row: torch.Tensor, q_row: torch.Tensor, tokens: torch.Tensor) -> NodeOutcome:
        """``p_row`` [V] and ``q_row`` [V] at a node, ``tokens`` [m] its children's, in draft order."""

    def verify(self, draft: Draft, p: torch.Tensor, generator: torch.Generator) -> Verdict:
        self.check_draft(draft)
        node, accepted = -1, []
        while children := draft.children(node):
            outcome = self.step(p[node + 1], draft.probs[children[0]], draft.tokens[children])  # siblings share q
            choice = _choose(outcome.accept, generator)
            if choice == len(children):
                return Verdict(accepted=tuple(accepted), next_token=sample(outcome.residual, generator), bonus=False)
            node = children[choice]
            accepted.append(node)
        return Verdict(accepted=tuple(accepted), next_token=sample(p[node + 1], generator), bonus=True)


def expected_emitted(verifier: TreeVerifier, draft: Draft, p: torch.Tensor) -> float:
    """The tokens a round emits in expectation when ``verifier`` judges ``draft`` against the level's rows ``p``
    [k+1, V]: one (the token after the accepted path) plus, for each node, the chance that the walk accepts it, the
    product of the verifier's chances of descending along the node's path (:meth:`TreeVerifier.step`). Exact for one
    draft; over rounds of drawn drafts, an unbiased estimate of the drafter's figure."""
    reach, total = {-1: 1.0}, 1.0
    for node in [-1, *range(len(draft))]:  # a parent comes before its children
        children = draft.children(node)
        if children and reach.get(node):
            accept = verifier.step(p[node + 1], draft.probs[children[0]], draft.tokens[children]).accept.tolist()  # [m]
            for child, chance in zip(children, accept):
                reach[child] = reach[node] * chance
                total += reach[child]
    return total


def _choose(accept: torch.Tensor, generator: torch.Generator) -> int:
    """Draw j with probability accept[j], or m (stop) with the rest."""
    stop = (1 - accept.sum()).reshape(1)  # [1]
    weights = torch.cat([accept, stop]).clamp_min(0.0)  # [m+1]; rounding may leave tiny negatives
    return int(torch.multinomial(weights, 1, generator=generator))


def multi_step_sampling(
    p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, after_rejection: Callable[[torch.Tensor, int], torch.Tensor]
) -> NodeOutcome:
    """Speculative sampling over siblings, tried in order ([V], [V], [m] -> NodeOutcome).

    Child x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)); on rejection
    p_{j+1} = normalize(max(p_j - q_j, 0)) and q_{j+1} = after_rejection(q_j, x_j); the residual
    is p_{m+1}. A child whose token q_j cannot draw was picked deterministically (a drafter drawing
    without replacement whose support ran out), so q_j is taken as one-hot on it.
    """
    accept, reach = [], 1.0  # reach: probability that every earlier child was rejected
    for x in tokens.tolist():
        proposal = q if q[x] > 0 else torch.nn.functional.one_hot(torch.tensor(x, device=q.device), q.shape[0]).to(q)  # [V]
        ratio = min(1.0, float(p[x] / proposal[x]))
        accept.append(reach * ratio)
        reach *= 1.0 - ratio
        p = recovery_distribution(p, proposal)  # [V]
        q = after_rejection(q, x)  # [V]
    return NodeOutcome(accept=torch.tensor(accept, dtype=p.dtype, device=p.device), residual=p)


def without_token(q: torch.Tensor, x: int) -> torch.Tensor:
    """q with x's mass removed and renormalised; all zeros once nothing is left ([V] -> [V])."""
    q = q.clone()
    q[x] = 0.0
    total = q.sum()
    return q / total if total > 0 else q


class SequoiaVerifier(TreeVerifier):
    """Sequoia's verification of trees whose siblings were drawn without replacement (Chen et al.,
    2024, "Sequoia: Scalable, Robust, and Hardware-aware Speculative Decoding", sampling without
    replacement).

    Children are tried in order: accept x_j if r * q_j(x_j) < p_j(x_j) (r ~ U[0, 1)); on rejection
    p_{j+1} = normalize(max(p_j - q_j, 0)) and q_{j+1} = normalize(q_j with x_j removed), the
    distribution the next sibling was drawn from. If every child fails, sample from p_{m+1}.
    """

    name = "sequoia"
    accepts = frozenset({DraftKind.CHAIN, DraftKind.TREE_WITHOUT_REPLACEMENT})

    def step(self, p_row: torch.Tensor, q_row: torch.Tensor, tokens: torch.Tensor) -> NodeOutcome:
        return multi_step_sampling(p_row, q_row, tokens, after_rejection=without_token)


class SpecInferVerifier(TreeVerifier):
    """Multi-step speculative sampling for trees whose siblings were drawn independently, with
    replacement, from the same q: multi-step speculative sampling (Miao et al., 2024, "SpecInfer:
    Accelerating Large Language Model Serving with Tree-based Speculative Inference and Verification").

    As :class:`SequoiaVerifier`, except that q is never renormalised: accept x_j if
    r * q(x_j) < p_j(x_j); on rejection p_{j+1} = normalize(max(p_j - q, 0)).
    """

    name = "specinfer"
    accepts = frozenset({DraftKind.CHAIN, DraftKind.TREE_WITH_REPLACEMENT})

    def step(self, p_row: torch.Tensor, q_row: torch.Tensor, tokens: torch.Tensor) -> NodeOutcome:
        return multi_step_sampling(p_row, q_row, tokens, after_rejection=lambda q, x: q)


class TokenTreeVerifier(TreeVerifier):
    """Verifies a candidate tree by drawing one target sample per node and walking the tree: draw
    x ~ p at the node, descend into the (first) child whose token is x, else emit x (the lossless
    rule for deterministic candidate trees noted for Medusa, Cai et al., 2024, and Sequoia's greedy
    tree, Chen et al., 2024).

    As a node outcome: accept[j] = p(x_j) for the first child with each token (0 for a repeat), and
    residual = normalize(p restricted to tokens no child has). It ignores q, so it is lossless for
    any draft; it only pays off when the candidates are likely under p.
    """

    name = "token-tree"
    accepts = frozenset(DraftKind)

    def step(self, p_row: torch.Tensor, q_row: torch.Tensor, tokens: torch.Tensor) -> NodeOutcome:
        first = torch.tensor([x not in tokens[:j].tolist() for j, x in enumerate(tokens.tolist())], device=tokens.device)  # [m]
        accept = torch.where(first, p_row[tokens], 0.0)  # [m]
        rest = p_row.index_fill(0, tokens, 0.0)  # [V]
        total = rest.sum()
        return NodeOutcome(accept=accept, residual=rest / total if total > 0 else p_row)  # p_row: never drawn


def check_verdict(verdict: Verdict, draft: Draft, vocab_size: int, verifier_name: str) -> Verdict:
    """Return ``verdict`` if it is well formed for ``draft``, else raise a one-line SpecstackError:
    ``accepted`` must be a root path of the draft, ``next_token`` an int in [0, vocab_size) and
    ``bonus`` a bool."""
    problem = _verdict_problem(verdict, draft, vocab_size)
    if problem:
        raise SpecstackError(f"verifier '{verifier_name}' returned a bad verdict: {problem}")
    return verdict


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _verdict_problem(verdict: Verdict, draft: Draft, vocab_size: int) -> str | None:
    if not isinstance(verdict.accepted, (tuple, list)):
        return f"accepted {verdict.accepted!r} is not a tuple of draft indices"
    accepted, parents = list(verdict.accepted), draft.parent_index().tolist()
    if not all(_is_int(i) and 0 <= i < len(draft) for i in accepted):
        return f"accepted {accepted!r} has an index outside the draft's {len(draft)} tokens"
    if [parents[i] for i in accepted] != [-1, *accepted][: len(accepted)]:
        return f"accepted {accepted!r} is not a path from the root of the draft (parents {parents})"
    if not (_is_int(verdict.next_token) and 0 <= verdict.next_token < vocab_size):
        return f"next_token {verdict.next_token!r} is not a token id in [0, {vocab_size})"
    if not isinstance(verdict.bonus, bool):
        return f"bonus {verdict.bonus!r} is not a bool"
    return None


_SAMPLING_VERIFIERS: dict[DraftKind, type[Verifier]] = {
    DraftKind.CHAIN: SpeculativeSamplingVerifier,
    DraftKind.TREE_WITHOUT_REPLACEMENT: SequoiaVerifier,
    DraftKind.TREE_WITH_REPLACEMENT: SpecInferVerifier,
    DraftKind.TREE_DETERMINISTIC: TokenTreeVerifier,
}


def default_verifier(kind: DraftKind, sampling: SamplingConfig) -> Verifier:
    """The lossless verifier for drafts of ``kind``: greedy at temperature 0, else by kind."""
    return GreedyVerifier() if sampling.deterministic else _SAMPLING_VERIFIERS[kind]()
