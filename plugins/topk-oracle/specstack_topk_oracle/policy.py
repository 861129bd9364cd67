"""The Top-K oracle (Sun et al., 2024, "TriForce", Table 1): exact top-K attention at every step."""

from __future__ import annotations

import torch

from specstack import Capability, GatheringPolicy, SpecstackError


class TopKOracle(GatheringPolicy):
    """Every new query attends to exactly the ``budget`` slots with the largest attention weights.

    The view holds the whole committed context, copied from the full cache one level up (so its KV
    entries are exact) every ``stride`` tokens, plus the tokens appended since. For each token t,
    layer l and KV head h, the weights pooled over the query heads of the group,

        w[l, h, t] = Σ_{q ∈ group(h)} softmax(q_t · K[l, h]ᵀ / √d),

    choose the ``budget`` slots the token attends to, and its attention is renormalised over them.
    No selection policy with the same budget can see more of the attention mass, which makes this the
    reference upper bound; it reads every key at every step, so it is slow by design and exists for
    measurement.
    """

    name = "topk-oracle"
    requires = frozenset({Capability.KEYS, Capability.SPARSE_ATTENTION})

    def __init__(self, *, budget: int = 512, stride: int = 64) -> None:
        if not isinstance(budget, int) or budget < 1:
            raise SpecstackError(f"topk-oracle budget {budget!r} is not allowed; use an integer >= 1")
        if not isinstance(stride, int) or stride < 1:
            raise SpecstackError(f"topk-oracle stride {stride!r} is not allowed; use an integer >= 1")
        self.budget, self.stride = budget, stride

    def capacity(self, max_length: int) -> int:
        return max_length

    def needs_refresh(self, appended: int, acceptance: float | None) -> bool:
        return appended >= self.stride

    def gather(self, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        return torch.arange(keys.shape[2], device=keys.device)  # [h]: the whole committed context, every layer and head

    def attend(self, weights: torch.Tensor) -> torch.Tensor:
        top = weights.topk(min(self.budget, weights.shape[-1]), dim=-1).indices  # [H, T, K]
        return torch.zeros_like(weights, dtype=torch.bool).scatter_(-1, top, True)  # [H, T, n]
