"""A certificate for greedy output that differs from autoregressive decoding in bf16.

In fp32 every stack's greedy output equals the target's own greedy decoding token for token
(``tests/test_real_model.py``). In bf16 it need not: a verifying level scores T tokens in one forward
pass, autoregressive decoding one, and the two round differently, so at a near-tie the argmax can
flip. This module tells such a flip from a bug.

At the first position i where a stack's greedy output differs from autoregressive decoding, with P
the prompt plus the i tokens both emitted:

- ``l1`` [V]: the logits autoregressive decoding computed there, recomputed the way it computes them
  (the prompt in one forward, then one token per forward over the KV cache);
- ``m = l1[a] - l1[s]``: how far the stack's token s is below the autoregressive choice a;
- ``d = max_v |lT[v] - l1[v]|``: the largest difference measured between ``l1`` and the logits
  ``lT`` that a T-token computation gives at the same position, for the verify widths T, computed
  three ways (:meth:`GreedyReference.gaps`): one T-token forward ending there, one starting there
  (both over the autoregressive cache), and everything after the prefill fed T tokens at a time (as
  a stack whose rounds all have width T writes its cache). They are tried cheapest first, until one
  explains the margin.

The certificate holds when ``0 <= m <= 2 d``: a rounding difference of d in each logit can move the
two apart by 2 d, so the flip is explained by the two computations' rounding. A stale cache, a wrong
row or a wrong mask moves logits by whole units, not by a rounding step, and fails it. Everything is
computed by the target's own forward (any :class:`~specstack.model.CausalLM`), so the check holds
for whatever attention kernel the model uses.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import attrs
import torch

from ..errors import SpecstackError
from ..model import CachedModel, CausalLM
from ..policies import FullCache
from ..sampling import SamplingConfig, warp
from ..stack import PREFILL_CHUNK, SpeculationStack, prefill_ends
from ..types import LevelStats

WIDTHS = (2, 3, 4, 5, 6, 7, 8, 16)  # verify widths (γ + 1) of the registered stacks, and a wide tree


@attrs.frozen(kw_only=True)
class Certificate:
    """The verdict on one stack's greedy output against autoregressive decoding."""

    diverged_at: int | None  # index into the generated tokens of the first difference; None: none
    reference_token: int | None = None  # a: autoregressive decoding's token there
    stack_token: int | None = None  # s: the stack's token there
    margin: float = 0.0  # m = l1[a] - l1[s]
    rounding: float = 0.0  # d: the largest max_v |lT - l1| measured
    width: int | None = None  # the T that gave d
    way: str | None = None  # how that lT was computed: "end", "start" or "rounds" (GreedyReference.gaps)
    holds: bool = True

    def describe(self) -> str:
        if self.diverged_at is None:
            return "identical to autoregressive decoding"
        verdict = "holds" if self.holds else "FAILS"
        return (f"first divergence at token {self.diverged_at}: autoregressive {self.reference_token}, stack "
                f"{self.stack_token}; margin {self.margin:.4g}, rounding gap {self.rounding:.4g} (T = {self.width}, "
                f"{self.way}): certificate {verdict} (needs 0 <= margin <= 2 x gap)")


@attrs.define(eq=False)
class GreedyReference:
    """Autoregressive greedy decoding of ``target`` after ``prompt``, replayed to give its logits.

    ``tokens`` is autoregressive decoding's output. The replay runs lazily, one token per forward as
    autoregressive decoding does, and checks each token is the argmax it recomputes (and that logits
    computed twice are equal); one reference certifies any number of stacks' outputs.

    ``decoded_by``, the stack that decoded ``tokens`` (the autoregressive stack, after its own chunked
    prefill of ``prompt``), lends its cache of the prompt: the replay copies it instead of paying a
    prefill of its own (about 5 minutes at 32K tokens in bf16 on the AVX2 host). Its prefill ran the
    same forwards in the same chunks, so the copied keys and values are the ones a prefill here would
    write, bit for bit (``tests/test_bf16_certificate.py``).
    """

    target: CausalLM
    prompt: list[int] = attrs.field(converter=list)
    tokens: list[int] = attrs.field(converter=list)
    widths: tuple[int, ...] = WIDTHS
    prefill_chunk: int = PREFILL_CHUNK  # the stacks' (SpeculationStack.prefill_chunk)
    decoded_by: SpeculationStack | None = attrs.field(default=None, kw_only=True)  # lends its cache of the prompt
    _lm: CachedModel = attrs.field(init=False)  # the target over its full cache
    _exact: int = attrs.field(init=False)  # the cache's positions below this hold autoregressive KV
    _rows: list[torch.Tensor] = attrs.field(init=False, factory=list)  # l1 of each generated token

    def __attrs_post_init__(self) -> None:
        self._lm = CachedModel(self.target, FullCache(), LevelStats(name="autoregressive replay"))
        lender = self._lender()
        if lender is not None:
            self._lm.adopt(lender, self.prompt)
        else:
            for end in prefill_ends(len(self.prompt), self.prefill_chunk):  # the prefill, as a stack's: chunked
                self._lm.logits(self.prompt[:end], 1)  # (one 32K-token forward keys the cache with other bf16 roundings)
        self._exact = len(self.prompt) - 1  # decoding feeds the prompt's last token again, alone

    def _lender(self) -> CachedModel | None:
        """``decoded_by``'s cache of the prompt, whose copy is this replay's prefill; None where no stack
        was given. A stack whose top level is not this target over a complete cache, or that prefills in
        other chunks, cannot lend it (its keys would not be the replay's bits) and is refused."""
        if self.decoded_by is None:
            return None
        cache = self.decoded_by.top_cache
        if self.decoded_by.prefill_chunk != self.prefill_chunk or cache is None or not self._lm.can_adopt(cache):
            raise SpecstackError(f"the replay can copy the prompt's cache only from a stack whose top level runs this target over its full cache, "
                                 f"prefilled in chunks of {self.prefill_chunk} tokens")
        return cache

    def certify(self, output: Sequence[int]) -> Certificate:
        """The certificate for ``output``, a stack's greedy output after the same prompt. Gaps are
        measured cheapest first until one explains the margin (all of them when none does)."""
        output = list(output)
        i = next((j for j, (a, s) in enumerate(zip(self.tokens, output)) if a != s), None)
        if i is None:
            return Certificate(diverged_at=None)
        a, s = self.tokens[i], output[i]
        l1 = self.logits(i)  # [V]
        margin = float(l1[a] - l1[s])
        rounding, width, way = 0.0, None, None
        for how, size, gap in self.gaps(i):
            if width is None or gap > rounding:
                rounding, width, way = gap, size, how
            if 0 <= margin <= 2 * rounding:
                break
        return Certificate(diverged_at=i, reference_token=a, stack_token=s, margin=margin, rounding=rounding,
                           width=width, way=way, holds=0 <= margin <= 2 * rounding)

    def logits(self, i: int) -> torch.Tensor:
        """[V]: the logits autoregressive decoding computed for generated token ``i``."""
        self._replay(len(self.prompt) + i)
        return self._rows[i]

    def gaps(self, i: int) -> Iterator[tuple[str, int, float]]:
        """``(way, T, max_v |lT - l1|)`` at generated token ``i`` for every verify width T, lT computed
        ``end``: by one T-token forward ending there, ``start``: by one starting there (both over the
        autoregressive cache), ``rounds``: with everything after the prefill fed T tokens at a time."""
        l1 = self.logits(i)  # [V]
        for width in self.widths:
            for how in ("end", "start"):
                row = self._one_forward(i, width, how)
                if row is not None:
                    yield how, width, float((row - l1).abs().max())
        for width in self.widths:
            yield "rounds", width, float((self._rounds(i, width) - l1).abs().max())

    def _one_forward(self, i: int, width: int, how: str) -> torch.Tensor | None:
        """[V]: lT from one ``width``-token forward over the autoregressive cache, ending (``end``) or
        starting (``start``) at the position that predicts generated token ``i``; None if there is none."""
        sequence = self.prompt + self.tokens
        last = len(self.prompt) + i - 1  # the position whose logits predict generated token i
        begin = last + 1 - width if how == "end" else last
        end = min(begin + width, len(sequence))
        if begin < len(self.prompt) - 1 or end - begin < 2:  # reaches into the prefill, or is one token
            return None
        self._replay(begin)
        rows = self._lm.logits(sequence[:end], end - begin)  # [≤T, V]
        self._exact = begin
        return rows[last - begin]

    def _rounds(self, i: int, width: int) -> torch.Tensor:
        """[V]: lT with every position after the prefill fed ``width`` tokens per forward."""
        sequence = self.prompt + self.tokens
        first, last = len(self.prompt) - 1, len(self.prompt) + i - 1
        for begin in range(first, last + 1, width):
            end = min(begin + width, len(sequence))
            rows = self._lm.logits(sequence[:end], end - begin)  # [≤T, V]
        self._exact = first
        return rows[last - begin]

    def _replay(self, length: int) -> None:
        """Make the cache's first ``length`` positions autoregressive KV, one token per forward."""
        sequence = self.prompt + self.tokens
        self._exact = min(self._exact, length)  # positions past it are fed again
        for end in range(self._exact + 1, length + 1):
            row = self._lm.logits(sequence[:end], 1)[0]  # [V]: after position end - 1
            g = end - len(self.prompt)  # the generated token it predicts
            if g == len(self._rows):
                chosen = int(warp(row, SamplingConfig()).argmax())
                if chosen != self.tokens[g]:
                    raise SpecstackError(f"the replay of autoregressive decoding chose {chosen} at token {g}, not {self.tokens[g]}: the reference is not reproducible")
                self._rows.append(row)
            elif not torch.equal(row, self._rows[g]):
                raise SpecstackError(f"the replay of autoregressive decoding computed other logits for token {g} the second time")
        self._exact = max(self._exact, length)


def certify(target: CausalLM, prompt: Sequence[int], reference: Sequence[int], output: Sequence[int],
            widths: tuple[int, ...] = WIDTHS) -> Certificate:
    """The certificate for one stack's greedy ``output`` against autoregressive ``reference``."""
    return GreedyReference(target, prompt, reference, widths).certify(output)
