"""Testing aids exported for plugin authors.

* :mod:`specstack.testing.conformance`: the conformance suite every registered component passes;
  run it on your installed plugin with ``pytest --pyargs specstack.testing.conformance -k <name>``.
* Statistical helpers for testing losslessness (below).

:func:`chi_square_pvalue` compares sampled outcomes with their exact probabilities. Bins whose
expected count is below 5 are pooled (the usual validity rule), and an outcome with exact
probability 0 that was nevertheless observed gives p-value 0: the sampler is provably wrong.
:func:`stack_pvalue` applies it to a stack's continuations of a prompt under a synthetic target.
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Iterable, Mapping

import torch


SAMPLES = 1500  # continuations drawn per sampled-losslessness check
ALPHA = 1e-4  # such a check fails below this p-value


def stack_pvalue(stack, target, sampling, prompt, *, length: int = 3, samples: int = SAMPLES, stop_tokens=()) -> float:
    """The chi-square p-value of ``samples`` continuations of ``prompt`` (``length`` tokens each, shorter
    after one of the stack's ``stop_tokens``) that ``stack`` generates, against their exact probabilities
    under the synthetic ``target`` (:func:`specstack.synthetic.sequence_probabilities`) warped by ``sampling``."""
    from ..synthetic import sequence_probabilities

    exact = sequence_probabilities(target, list(prompt), length, sampling, stop_tokens=stop_tokens)
    drawn = [stack.generate(list(prompt), length).tokens for _ in range(samples)]
    return chi_square_pvalue(drawn, exact)


def chi_square_pvalue(samples: Iterable[Hashable], exact: Mapping[Hashable, float], *, min_expected: float = 5.0) -> float:
    """P-value of Pearson's chi-square goodness-of-fit test of ``samples`` against ``exact``."""
    counts = Counter(samples)
    n = sum(counts.values())
    if any(exact.get(outcome, 0.0) <= 0.0 for outcome in counts):
        return 0.0
    observed, expected = _pooled_bins(counts, exact, n, min_expected)
    if len(observed) < 2:
        return 1.0
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(statistic / 2, dtype=torch.float64)))


def _pooled_bins(counts: Counter, exact: Mapping[Hashable, float], n: int, min_expected: float) -> tuple[list[float], list[float]]:
    observed, expected = [], []
    pooled_o = pooled_e = 0.0
    for outcome, prob in exact.items():
        if prob * n >= min_expected:
            observed.append(float(counts.get(outcome, 0)))
            expected.append(prob * n)
        else:
            pooled_o += counts.get(outcome, 0)
            pooled_e += prob * n
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    return observed, expected


def total_variation(samples: Iterable[Hashable], exact: Mapping[Hashable, float]) -> float:
    """Total-variation distance between the empirical distribution of ``samples`` and ``exact``."""
    counts = Counter(samples)
    n = sum(counts.values())
    outcomes = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(o, 0) / n - exact.get(o, 0.0)) for o in outcomes)
