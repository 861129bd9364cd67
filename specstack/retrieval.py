"""TriForce's retrieval cache (Sun et al., 2024, "TriForce", Section 4.1)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .channels import chunk_means
from .errors import SpecstackError
from .policies import GatheringPolicy, _positive_int

AUTO = "auto"  # a budget that scales with the context
AUTO_SHARE = 16  # with budget="auto": gather about 1/16 of the context (the paper: 4K of 120K; here 512 of ~8K)
STRIDE = 8  # appended tokens after which the view is gathered again, at the next round of the full-cache level


class Retrieval(GatheringPolicy):
    """Chunk-wise retrieval from the full KV cache.

    The committed keys are cut into chunks of ``chunk_size`` positions. For layer l and KV head h,
    chunk c scores

        s[l, h, c] = q̄[l, h] · mean_{t ∈ c} k[l, h, t],

    the attention logit between the current query and the chunk's mean key, where q̄ pools (averages)
    the query heads that share KV head h (grouped-query attention). The first chunk (attention sinks)
    and the incomplete last chunk are always kept; the best-scoring chunks fill the rest of
    ``budget`` positions. Tokens after the gather are appended behind the gathered ones; the view is
    gathered again after ``stride`` appended tokens or when the rolling acceptance of this level's
    drafts falls below ``refresh_below`` (either at the next point where the full cache holds the
    context, the start of a round of its level, so that a gather never makes that level run a forward
    of its own), or when the ``reserve`` of speculative slots runs out. Scoring with the query of
    the latest token matters: at 448 slots of 7,000 tokens, re-gathering every 8 tokens instead of
    every 64 raised the acceptance of the view's 6-token drafts from 0.748 to 0.823 (Austen) and from
    0.691 to 0.833 (KJV) (``examples/paper/view_freshness.toml``, docs/results.md).

    ``budget="auto"`` (the default) scales the budget with the context at every gather: about
    1/16 of it in whole chunks, at least two chunks; a context shorter than two chunks is kept whole.
    Its narrow method is :meth:`gather_chunks`, which scores chunk means: through
    :meth:`~specstack.channels.FullCacheChannel.gather` it gets the means the channel keeps running
    (only new or rewritten chunks computed); :meth:`gather` computes them all from the keys.
    """

    name = "retrieval"

    def __init__(self, *, budget: int | str = AUTO, chunk_size: int = 8, stride: int = STRIDE, reserve: int = 32, refresh_below: float = 0.0) -> None:
        self.chunk_size = _positive_int("chunk_size", chunk_size)
        self.budget = _budget(budget, self.chunk_size)
        self.stride = _positive_int("stride", stride)
        self.reserve = _positive_int("reserve", reserve)
        if not 0.0 <= refresh_below <= 1.0:
            raise SpecstackError(f"refresh_below {refresh_below!r} is not allowed; use a rate in [0, 1]")
        self.refresh_below = refresh_below

    def capacity(self, max_length: int) -> int:
        most = _scaled(max_length, self.chunk_size) if self.budget == AUTO else self.budget  # the auto budget grows with the context
        return min(max_length, most + self.stride + self.reserve)

    def needs_refresh(self, appended: int, acceptance: float | None) -> bool:
        return appended >= self.stride or (acceptance is not None and acceptance < self.refresh_below)

    def budget_for(self, context: int) -> int:
        """The positions gathered from a ``context``-token context."""
        if self.budget == AUTO:
            return _scaled(context, self.chunk_size)
        if self.budget > context:
            raise SpecstackError(f"retrieval budget {self.budget} is larger than the {context}-token context; use a budget of at most {context - context % self.chunk_size}, or 'auto'")
        return self.budget

    def gather(self, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """From the committed keys [L, H, h, D]: their chunk means, computed here (the channel keeps them
        running instead, :meth:`gather_chunks`)."""
        return self.gather_chunks(chunk_means(keys, self.chunk_size), queries, keys.shape[2])

    def gather_chunks(self, means: torch.Tensor, queries: torch.Tensor, context: int) -> torch.Tensor:
        """The slots to gather from a ``context``-token context, given the mean key of each of its
        complete chunks [L, H, C, D] (float32) and the last query of each layer [L, Hq, D]: [L, H, K],
        or the whole context [context] when it is shorter than two chunks."""
        budget = self.budget_for(context)
        if context < 2 * self.chunk_size:  # no chunk to choose: keep everything
            return torch.arange(context, device=means.device)  # [K]
        layers, heads, chunks, dim = means.shape
        query = queries.reshape(layers, heads, -1, dim).float().mean(2)  # [L, H, D]; pooled over each GQA group
        scores = (query[..., None, :] @ means.transpose(-1, -2))[..., 0, :]  # [L, H, C]; a row times the means: half the time of means @ query here
        scores[..., 0] = float("inf")  # the sink chunk is always kept
        tail = context - chunks * self.chunk_size
        best = best_sorted(scores, (budget - tail) // self.chunk_size)  # [L, H, k]
        offsets = torch.arange(self.chunk_size, device=means.device)  # [S]
        slots = (best[..., None] * self.chunk_size + offsets).flatten(-2)  # [L, H, k*S]
        recent = torch.arange(chunks * self.chunk_size, context, device=means.device).expand(layers, heads, tail)  # [L, H, tail]
        return torch.cat([slots, recent], dim=-1)  # [L, H, K]


def best_sorted(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of each row's ``count`` highest scores, in ascending order ([..., C] -> [..., count] int64; NaN counts
    as highest, as in ``torch.topk``; which of several equal scores at the cut is kept may differ between the two ways).
    On the CPU numpy's partition finds them: at 32,000 tokens (90 rows of 4,096 chunk scores, 255 kept) 0.9 ms against
    3.1-3.5 for ``topk`` and a sort (docs/benchmarks.md, "A re-gather's copy in place and its selection by partition")."""
    if scores.device.type != "cpu" or scores.dtype != torch.float32:
        return scores.topk(count, dim=-1, sorted=False).indices.sort(dim=-1).values  # [..., count]
    chosen = np.argpartition(scores.numpy(), scores.shape[-1] - count, axis=-1)[..., scores.shape[-1] - count :]  # [..., count]
    chosen.sort(axis=-1)
    return torch.from_numpy(chosen.astype(np.int64, copy=False))  # [..., count]


def _budget(budget: Any, chunk_size: int) -> int | str:
    if budget == AUTO:
        return AUTO
    if not isinstance(budget, int) or isinstance(budget, bool) or budget % chunk_size or budget < 2 * chunk_size:
        raise SpecstackError(f"retrieval budget {budget!r} is not allowed with chunk_size {chunk_size}; use a positive multiple of chunk_size, at least two chunks ({2 * chunk_size}), or 'auto'")
    return budget


def _scaled(context: int, chunk_size: int) -> int:
    """'auto': about context/16 in whole chunks, at least two chunks, at most the complete chunks of
    ``context``; all of a context shorter than two chunks. Non-decreasing in ``context``, so the
    budget at the model's window bounds every gather."""
    if context < 2 * chunk_size:
        return context
    share = chunk_size * ((2 * context + AUTO_SHARE * chunk_size) // (2 * AUTO_SHARE * chunk_size))  # context/16, rounded to chunks
    return min(context - context % chunk_size, max(2 * chunk_size, share))
