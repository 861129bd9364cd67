"""Verifiers: pure functions of probabilities and a ``torch.Generator``.

No model and no global random state is involved: a verifier sees the draft (tokens and the
proposal distribution ``q``), the verifying level's distribution ``p`` at every draft position plus
one, and an explicit generator.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

from .sampling import SamplingConfig, sample
from .types import Draft, Verdict


class Verifier(abc.ABC):
    """Accepts or rejects a draft.

    ``verify(draft, p, generator)`` gets ``p`` [k+1, V], where row i is the verifying level's
    distribution for draft position i (row k is for the token after the whole draft), and returns a
    :class:`Verdict`. The emitted tokens (accepted ones, then ``next_token``) must be distributed
    exactly as ``p`` would have generated them autoregressively.
    """

    name: ClassVar[str]

    def check_sampling(self, sampling: SamplingConfig) -> None:
        """Raise :class:`~specstack.errors.SpecstackError` if this verifier cannot honour ``sampling``."""

    @abc.abstractmethod
    def verify(self, draft: Draft, p: torch.Tensor, generator: torch.Generator) -> Verdict:
        ...


class GreedyVerifier(Verifier):
    """Accept while the draft token is the verifier's argmax; then emit the argmax.

    The output equals argmax decoding of the verifying level token for token.
    """

    name = "greedy"

    def check_sampling(self, sampling: SamplingConfig) -> None:
        from .errors import SpecstackError

        if not sampling.greedy:
            raise SpecstackError(
                f"verifier 'greedy' needs temperature 0, got {sampling.temperature}; use 'speculative' to sample"
            )

    def verify(self, draft: Draft, p: torch.Tensor, generator: torch.Generator) -> Verdict:
        best = p.argmax(dim=-1)  # [k+1]
        agree = (draft.tokens == best[: len(draft)]).long()  # [k]
        m = int(agree.cumprod(dim=0).sum())
        return Verdict(accepted=tuple(range(m)), next_token=int(best[m]), bonus=m == len(draft))


class SpeculativeSamplingVerifier(Verifier):
    """Lossless speculative sampling (Leviathan et al., 2023; Chen et al., 2023).

    For each draft token x_i ~ q_i, accept with probability min(1, p_i(x_i) / q_i(x_i)). At the first
    rejection emit a token from the residual ``normalize(max(p_i - q_i, 0))``; if all k are accepted,
    emit a bonus token from p_k. Every emitted token is then distributed exactly as p. With one-hot
    p and q (temperature 0) this is the greedy rule.
    """

    name = "speculative"

    def verify(self, draft: Draft, p: torch.Tensor, generator: torch.Generator) -> Verdict:
        k = len(draft)
        rows = torch.arange(k)
        p_x = p[rows, draft.tokens]  # [k]
        q_x = draft.probs[rows, draft.tokens]  # [k]
        u = torch.rand(k, generator=generator)  # [k]
        accept = (u * q_x < p_x).long()  # [k]; u < p/q without dividing
        m = int(accept.cumprod(dim=0).sum())
        if m == k:
            return Verdict(accepted=tuple(range(k)), next_token=sample(p[k], generator), bonus=True)
        residual = recovery_distribution(p[m], draft.probs[m])  # [V]
        return Verdict(accepted=tuple(range(m)), next_token=sample(residual, generator), bonus=False)


def recovery_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) for one position ([V], [V] -> [V]).

    A rejection implies p(x) < q(x) for the drafted x, so the residual has positive mass in exact
    arithmetic; if rounding leaves none, p and q agree to float precision and p itself is returned.
    """
    residual = (p - q).clamp_min(0.0)  # [V]
    total = residual.sum()
    return residual / total if total > 0 else p
