"""Attention with the extras some cache policies need, shared by every model backend.

Plain attention is one fused kernel call and tells nothing about where the attention went. Two
kinds of policies need more, and declare it as a capability:

* ``Capability.ATTENTION_WEIGHTS`` (H2O): the attention mass each cached slot has received,
  accumulated per layer and KV head (:meth:`KVStore.accumulate_attention`);
* ``Capability.SPARSE_ATTENTION`` (the Top-K oracle): the policy chooses, for every new query, which
  cached slots it may attend to, from that query's own attention weights.

:func:`attention_weights` computes the weights explicitly for those levels; the fast fused path is
used everywhere else.
"""

from __future__ import annotations

from typing import Callable

import torch

Select = Callable[[torch.Tensor], torch.Tensor]  # pooled weights [Hkv, T, n] -> allowed [Hkv, T, n]


def attention_weights(query: torch.Tensor, key: torch.Tensor, allowed: torch.Tensor, scale: float, group: int,
                      select: Select | None = None) -> torch.Tensor:
    """Softmax attention weights [Hkv, G*T, n] (float32).

    ``query`` [Hkv, G*T, D] holds the G query heads of each KV head folded into the query length
    (row ``j*T + t`` is head j of the group, token t); ``key`` [Hkv, n, D]; ``allowed`` [G*T, n] is the
    causal mask. With ``select``, each token's weights pooled over its group (summed) go to the policy,
    which returns the slots that token may attend to; the weights are then renormalised over those.
    """
    logits = (query.float() @ key.float().transpose(1, 2)) * scale  # [Hkv, G*T, n]
    logits = logits.masked_fill(~allowed, float("-inf"))
    if select is None:
        return logits.softmax(-1)
    heads, rows, n = logits.shape
    pooled = logits.softmax(-1).reshape(heads, group, rows // group, n).sum(1)  # [Hkv, T, n]
    chosen = select(pooled)  # [Hkv, T, n] bool
    return logits.masked_fill(~chosen.repeat(1, group, 1), float("-inf")).softmax(-1)  # [Hkv, G*T, n]

