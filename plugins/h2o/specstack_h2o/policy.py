"""H2O: Heavy-Hitter Oracle eviction (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models")."""

from __future__ import annotations

import torch

from specstack import CacheState, Capability, EvictionPolicy, SpecstackError


class H2O(EvictionPolicy):
    """Keep the heavy hitters and a recent window, per layer and KV head, within ``budget`` entries.

    A slot's score is the attention it has accumulated since it was written,

        a[l, h, j] = Σ_t Σ_{q ∈ group(h)} softmax(q_t · K[l, h]ᵀ / √d)[j],

    summed over every token t that attended to it and over the query heads q sharing KV head h.
    When the cache is full, each (layer, head) keeps the ``recent`` newest slots and the
    ``budget - recent`` older slots with the largest a; the rest are evicted and never come back.
    Eviction runs once every ``reserve`` tokens (``reserve=1`` evicts one token per step as in the
    paper; larger values amortise the copy). Scores include tokens that were drafted and later
    rejected, as they were attended to by the level's own forward passes.
    """

    name = "h2o"
    requires = frozenset({Capability.ATTENTION_WEIGHTS})

    def __init__(self, *, budget: int = 512, recent: int | None = None, reserve: int = 16) -> None:
        recent = budget // 2 if recent is None else recent
        if not isinstance(budget, int) or budget < 2:
            raise SpecstackError(f"h2o budget {budget!r} is not allowed; use an integer >= 2")
        if not isinstance(recent, int) or not 1 <= recent <= budget:
            raise SpecstackError(f"h2o recent window {recent!r} is not allowed; use an integer in [1, budget={budget}]")
        if not isinstance(reserve, int) or reserve < 1:
            raise SpecstackError(f"h2o reserve {reserve!r} is not allowed; use an integer >= 1")
        self.budget, self.recent, self.reserve = budget, recent, reserve

    def capacity(self, max_length: int) -> int:
        return min(max_length, self.budget + self.reserve)

    def select(self, state: CacheState) -> torch.Tensor:
        n = state.positions.shape[0]
        keep = min(self.budget, state.room, n)
        recent = min(self.recent, keep)
        older = state.attention[..., : n - recent]  # [L, H, n - recent]
        heavy = older.topk(keep - recent, dim=-1).indices.sort(dim=-1).values  # [L, H, keep - recent]
        window = torch.arange(n - recent, n, device=heavy.device).expand(*heavy.shape[:2], recent)  # [L, H, recent]
        return torch.cat([heavy, window], dim=-1)  # [L, H, keep]
