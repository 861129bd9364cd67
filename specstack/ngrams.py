"""Where the n-grams of a growing text occurred: the index that prompt lookup (:class:`~specstack.drafters.PromptLookupDrafter`)
and lookup trees (the sequoia plugin's ``lookup-tree``) search, kept in step with the text in O(γ) a round, and the
ranking of a match's earlier occurrences by how far back they agree with the text."""

from __future__ import annotations

from typing import Iterator, Sequence

import attrs
import numpy as np

from .types import SeenTokens, TokenView

LOOKBACK = 32  # tokens compared backwards from an earlier occurrence of the matched n-gram (the drafters' ``lookback``)
CANDIDATES = 16  # the latest occurrences compared, so that a round's lookup costs O(CANDIDATES x lookback), never O(context)


@attrs.define(eq=False, kw_only=True)
class NgramIndex:
    """Maps every n-gram of ``min_ngram`` … ``max_ngram`` tokens of the text seen so far to the positions where its
    occurrences end (ascending). :meth:`catch_up` indexes only the tokens appended since the last call and unindexes
    those rolled back (:class:`~specstack.types.SeenTokens` finds which): O(γ) a round, no scan of the context."""

    max_ngram: int
    min_ngram: int
    _seen: SeenTokens = attrs.field(init=False, factory=SeenTokens)  # the tokens indexed
    _ends: dict[tuple[int, ...], list[int]] = attrs.field(init=False, factory=dict)  # n-gram -> where its occurrences end, ascending

    def clear(self) -> None:
        self._seen.truncate(0)
        self._ends.clear()

    def catch_up(self, prefix: TokenView) -> int:
        """Make the index that of ``prefix``: unindex the seen tokens it does not share, index its new ones. -> How
        many leading tokens it shared with the text indexed before."""
        common = self._seen.common_prefix(prefix)
        seen = self._seen.array()  # [m]
        for key, end in self._ngrams(seen, range(seen.shape[0] - 1, common - 1, -1)):  # newest first: the last entry of its list
            ends = self._ends[key]
            ends.pop()
            if not ends:
                del self._ends[key]
        tokens = prefix.array()  # [n]
        for key, end in self._ngrams(tokens, range(common, tokens.shape[0])):
            self._ends.setdefault(key, []).append(end)
        self._seen.become(prefix)
        return common

    def earlier(self, seq: np.ndarray, size: int) -> list[int]:
        """Where the latest CANDIDATES earlier occurrences of ``seq``'s last ``size`` tokens end, ascending (``seq`` is
        the text indexed; its suffix itself is left out)."""
        ends = self._ends.get(tuple(seq[seq.shape[0] - size :].tolist()), [])
        return ends[-1 - CANDIDATES : -1]

    def _ngrams(self, seq: np.ndarray, ends: range) -> Iterator[tuple[tuple[int, ...], int]]:
        """(n-gram, end) for each n-gram of ``seq`` that ends at a position in ``ends``, in that order."""
        if not ends:
            return
        base = max(0, min(ends) + 1 - self.max_ngram)
        window = seq[base : max(ends) + 1].tolist()
        for end in ends:
            for size in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                yield tuple(window[end + 1 - size - base : end + 1 - base]), end


def agreements(seq: np.ndarray, ends: Sequence[int], lookback: int) -> list[int]:
    """For each earlier position in ``ends``, how many tokens up to it equal ``seq``'s last ones, counted at most
    ``lookback`` tokens back: O(len(ends) x lookback), a few microseconds for CANDIDATES of them."""
    back = min(lookback, seq.shape[0])
    tail = seq[seq.shape[0] - back :][::-1].tolist()  # [b] the text's last tokens, the last first
    counts = []
    for end in ends:
        before = seq[max(0, end + 1 - back) : end + 1][::-1].tolist()  # [<= b] the tokens up to end, the last first
        count = 0
        while count < len(before) and before[count] == tail[count]:
            count += 1
        counts.append(count)
    return counts


def by_agreement(seq: np.ndarray, ends: Sequence[int], lookback: int) -> list[int]:
    """``ends`` (ascending) reordered: the longest agreement with ``seq``'s last tokens first (:func:`agreements`), ties
    the latest first; ``lookback=0``: the latest first."""
    if not lookback:
        return list(reversed(ends))
    return [end for _, end in sorted(zip(agreements(seq, ends, lookback), ends), reverse=True)]
