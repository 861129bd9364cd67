"""TriForce's retrieval cache (Sun et al., 2024, "TriForce", Section 4.1)."""

from __future__ import annotations

import torch

from .errors import SpecstackError
from .policies import GatheringPolicy, _positive_int


class Retrieval(GatheringPolicy):
    """Chunk-wise retrieval from the full KV cache.

    The committed keys are cut into chunks of ``chunk_size`` positions. For layer l and KV head h,
    chunk c scores

        s[l, h, c] = q̄[l, h] · mean_{t ∈ c} k[l, h, t],

    the attention logit between the current query and the chunk's mean key, where q̄ pools (averages)
    the query heads that share KV head h (grouped-query attention). The first chunk (attention sinks)
    and the incomplete last chunk are always kept; the best-scoring chunks fill the rest of
    ``budget`` positions. Tokens after the gather are appended behind the gathered ones; the view is
    gathered again after ``stride`` appended tokens, when the rolling acceptance of this level's
    drafts falls below ``refresh_below``, or when the ``reserve`` of speculative slots runs out.
    """

    name = "retrieval"

    def __init__(self, *, budget: int = 1024, chunk_size: int = 8, stride: int = 64, reserve: int = 32, refresh_below: float = 0.0) -> None:
        self.budget = _positive_int("budget", budget)
        self.chunk_size = _positive_int("chunk_size", chunk_size)
        self.stride = _positive_int("stride", stride)
        self.reserve = _positive_int("reserve", reserve)
        if budget % chunk_size or budget < 2 * chunk_size:
            raise SpecstackError(f"retrieval budget {budget} is not allowed with chunk_size {chunk_size}; use a multiple of the chunk size, at least two chunks")
        if not 0.0 <= refresh_below <= 1.0:
            raise SpecstackError(f"refresh_below {refresh_below!r} is not allowed; use a rate in [0, 1]")
        self.refresh_below = refresh_below

    def capacity(self, max_length: int) -> int:
        return min(max_length, self.budget + self.stride + self.reserve)

    def needs_refresh(self, appended: int, acceptance: float | None) -> bool:
        return appended >= self.stride or (acceptance is not None and acceptance < self.refresh_below)

    def gather(self, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        layers, heads, context, dim = keys.shape
        if self.budget > context:
            raise SpecstackError(f"retrieval budget {self.budget} is larger than the {context}-token context; use a budget of at most {context - context % self.chunk_size}")
        chunks = context // self.chunk_size
        query = queries.reshape(layers, heads, -1, dim).float().mean(2)  # [L, H, D]; pooled over each GQA group
        scores = torch.stack([self._chunk_scores(keys[layer, :, : chunks * self.chunk_size], query[layer]) for layer in range(layers)])  # [L, H, C]
        scores[..., 0] = float("inf")  # the sink chunk is always kept
        tail = context - chunks * self.chunk_size
        best = scores.topk((self.budget - tail) // self.chunk_size, dim=-1).indices.sort(dim=-1).values  # [L, H, k]
        offsets = torch.arange(self.chunk_size, device=keys.device)  # [S]
        slots = (best[..., None] * self.chunk_size + offsets).flatten(-2)  # [L, H, k*S]
        recent = torch.arange(chunks * self.chunk_size, context, device=keys.device).expand(layers, heads, tail)  # [L, H, tail]
        return torch.cat([slots, recent], dim=-1)  # [L, H, K]

    def _chunk_scores(self, keys: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """One layer at a time, so that the float32 copy is a layer's, not the cache's: keys [H, C*S, D],
        query [H, D] -> the logit of each chunk's mean key [H, C]."""
        heads, length, dim = keys.shape
        means = keys.reshape(heads, length // self.chunk_size, self.chunk_size, dim).float().mean(2)  # [H, C, D]
        return (means @ query[..., None])[..., 0]  # [H, C]
