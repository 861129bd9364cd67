"""What one forward pass writes and what each of its tokens may see.

A :class:`TokenBatch` is the input of :meth:`~specstack.model.CausalLM.forward`: the new tokens,
their sequence positions, and ``sees`` [T, T], which of the new tokens each new token attends to
besides every slot already in the level's cache view. For a chain ``sees`` is lower-triangular; for
a token tree (SpecInfer, Miao et al., 2024; Sequoia, Chen et al., 2024) row i is token i's ancestors
and itself, and token i sits at position ``committed + depth(i)``, so that one forward pass scores
every root-to-leaf path of the tree as if it had been decoded on its own.

The batch also carries what the level's cache policy asked of this forward: a query log for a
gathering level below (:class:`~specstack.channels.QueryLog`), attention recording (H2O) and a
sparse attention filter (the Top-K oracle), and whether to keep the hidden states of the scored rows
(``keep_hidden``; the model leaves them in ``hidden`` for a drafter that reads them, Medusa's heads).
The attention mask is built here, once per forward, and
shared by every layer.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from .attention import Select
from .channels import QueryLog
from .types import Draft


@attrs.define(eq=False, kw_only=True)
class TokenBatch:
    """The new tokens of one forward pass (see the module docstring)."""

    tokens: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T] sequence positions
    sees: torch.Tensor  # [T, T] bool: new token i attends to new token j
    num_logits: int  # logits are returned for the last num_logits tokens
    query_row: int  # the row whose query a gathering level reads: the last committed token
    is_chain: bool  # sees is lower-triangular (a causal kernel may run without a mask)
    queries: QueryLog | None = None
    record_attention: bool = False
    attend: Select | None = None
    keep_hidden: bool = False  # asked of a model with Capability.HIDDEN_STATES
    hidden_rows: int = 0  # with keep_hidden: leave the states of the last max(num_logits, hidden_rows) tokens
    hidden: torch.Tensor | None = None  # [max(num_logits, hidden_rows), H]: left here by the model when keep_hidden is set
    _masks: dict = attrs.field(init=False, factory=dict)

    @classmethod
    def chain(cls, tokens: Sequence[int], start: int, num_logits: int, **extras) -> "TokenBatch":
        """``tokens`` at positions ``start, start+1, …``, each seeing those before it."""
        t = len(tokens)
        host = torch.device("cpu")  # a batch is host metadata; the model moves what it needs
        return cls(tokens=torch.tensor(tokens, dtype=torch.long, device=host), positions=torch.arange(start, start + t, device=host),  # [T], [T]
                   sees=torch.ones(t, t, dtype=torch.bool, device=host).tril(), num_logits=num_logits, query_row=t - 1, is_chain=True, **extras)

    @classmethod
    def tree(cls, tail: Sequence[int], start: int, draft: Draft, **extras) -> "TokenBatch":
        """A chain ``tail`` (the committed tokens not yet in the cache, at least one) followed by the
        token tree of ``draft``; logits for the last tail token and for every tree node ([k+1, V])."""
        c, k, host = len(tail), len(draft), torch.device("cpu")
        parents = draft.parent_index().tolist()
        sees = torch.zeros(c + k, c + k, dtype=torch.bool, device=host)  # [T, T]
        sees[:c, :c] = torch.ones(c, c, dtype=torch.bool, device=host).tril()
        sees[c:, :c] = True  # every node sees the whole tail
        for i, parent in enumerate(parents):
            if parent >= 0:
                sees[c + i] = sees[c + parent]
            sees[c + i, c + i] = True
        positions = torch.cat([torch.arange(start, start + c, device=host), start + c + draft.depths()])  # [T]
        tokens = torch.cat([torch.tensor(tail, dtype=torch.long, device=host), draft.tokens.cpu()])  # [T]
        return cls(tokens=tokens, positions=positions, sees=sees, num_logits=k + 1, query_row=c - 1, is_chain=False, **extras)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def chain_tokens(self) -> list[int]:
        """The tokens before the tree (all of a chain batch): they extend the committed sequence."""
        return self.tokens[: self.query_row + 1].tolist()

    def mask(self, cached: int, group: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[G*T, cached+T] bool: every cached slot, then ``sees``; rows repeat per query head of a
        GQA group (row ``j*T + t`` is head j of the group, token t). Built once per forward."""
        key = (cached, group, str(device))
        if key not in self._masks:
            t = len(self)
            mask = torch.cat([torch.ones(t, cached, dtype=torch.bool, device=self.sees.device), self.sees], dim=1)  # [T, n+T]
            self._masks[key] = mask.repeat(group, 1).to(device)  # [G*T, n+T]
        return self._masks[key]
