"""Quest-style page selection (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient
Long-Context LLM Inference"), written from scratch as a specstack plugin."""

import torch

from specstack import GatheringPolicy, SpecstackError
from specstack.hookspecs import hookimpl


class Quest(GatheringPolicy):
    """Keep the pages whose keys can score highest against the current query.

    Keys are cut into pages of ``page_size``; page p of layer l and KV head h keeps the elementwise
    minimum m and maximum M of its keys, and its score is an upper bound of q · k over the page,

        u[l, h, p] = Σ_{q ∈ group(h)} Σ_d max(q_d m_d, q_d M_d),

    The best pages fill ``budget`` slots (the incomplete last page is always kept); the view is
    gathered again every ``stride`` tokens.
    """

    name = "quest"

    def __init__(self, *, budget: int = 512, page_size: int = 16, stride: int = 16):
        if not isinstance(budget, int) or not isinstance(page_size, int) or not 1 <= page_size <= budget:
            raise SpecstackError(f"quest budget {budget!r} / page_size {page_size!r} are not allowed; use integers with 1 <= page_size <= budget")
        self.budget, self.page_size, self.stride = budget, page_size, stride

    def capacity(self, max_length):
        return min(max_length, self.budget + self.stride + 32)  # room for the tokens until the next gather

    def needs_refresh(self, appended, acceptance):
        return appended >= self.stride

    def gather(self, keys, queries):
        layers, heads, context, dim = keys.shape
        size, pages = self.page_size, context // self.page_size
        paged = keys[:, :, : pages * size].reshape(layers, heads, pages, size, dim).float()  # [L, H, P, S, D]
        low, high = paged.amin(3)[:, :, None], paged.amax(3)[:, :, None]  # [L, H, 1, P, D]
        q = queries.reshape(layers, heads, -1, 1, dim).float()  # [L, H, G, 1, D]
        bound = torch.maximum(q * low, q * high).sum(-1).sum(2)  # [L, H, P]
        tail = context - pages * size
        best = bound.topk(min(pages, (self.budget - tail) // size), dim=-1).indices.sort(dim=-1).values  # [L, H, k]
        slots = (best[..., None] * size + torch.arange(size, device=keys.device)).flatten(-2)  # [L, H, k*S]
        return torch.cat([slots, torch.arange(pages * size, context, device=keys.device).expand(layers, heads, tail)], dim=-1)  # [L, H, K]


@hookimpl
def specstack_cache_policies():
    return [Quest]
