"""Synthetic language models with known distributions, for tests and examples.

A :class:`SyntheticLM` maps the tokens it can see to a fixed pseudo-random logit vector: the same
visible context always gives the same distribution, so the exact probability of any continuation
can be computed (:func:`sequence_probabilities`) and compared with what a stack generates. A draft
is made correlated with a target through ``base``; ``support`` restricts the tokens a model can emit.

Its cache is the real :class:`~specstack.kvstore.KVStore` (one layer, one head): keys are fixed
random token embeddings and each value carries its token id, so every cache policy (eviction,
per-head eviction, gathering, attention-weighted, sparse attention) runs on it exactly as on a
transformer, and what a token "sees" is the set of slots its attention may reach.

Its hidden state (``Capability.HIDDEN_STATES``) is another hash-seeded vector of the visible context,
and its output head a fixed random matrix: enough for a drafter that reads hidden states (Medusa's
heads) to draft from them, well or badly, while the logits stay the known ones.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from .attention import attention_weights
from .batch import TokenBatch
from .kvstore import KVStore
from .sampling import SamplingConfig, warp
from .types import Capability

# Hidden states are seeded by this integer beside the model's seed and the context, so that they come
# from another stream than the logits. Integers hash the same in every process; strings do not
# (PYTHONHASHSEED), which once made the hidden states, and a test's power, change from run to run.
HIDDEN_STREAM = 0x6869_6464_656E  # "hidden" in ASCII


@attrs.define(eq=False, kw_only=True)
class SyntheticLM:
    """A prefix-hash language model over a small vocabulary.

    ``logits_for(context)`` is ``sharpness * N(0, 1)`` drawn from a generator seeded by a hash of
    ``(seed, context)``; with ``base`` set it is ``base.logits_for(context) + noise * that``. Tokens
    outside ``support`` get -inf.
    """

    vocab_size: int
    seed: int = 0
    sharpness: float = 1.0
    base: "SyntheticLM | None" = None
    noise: float = 1.0
    support: tuple[int, ...] | None = None
    max_length: int = 4096
    tokenizer_id: str | None = "synthetic"
    capabilities: frozenset[Capability] = frozenset(Capability)
    head_dim: int = 4
    hidden_size: int = 8
    device: torch.device = attrs.field(default="cpu", converter=torch.device)  # where its KV cache and logits live
    token_rank: torch.Tensor | None = None  # [V] token ids, most frequent first: what a draft vocabulary takes (draft_vocabulary)
    _embeddings: torch.Tensor = attrs.field(init=False)  # [2, V, D]: key and query embedding of each token
    _head: torch.Tensor = attrs.field(init=False)  # [V, H]: the output head hidden states are read through
    _drawn: dict[tuple, torch.Tensor] = attrs.field(init=False, factory=dict)  # (what, context) -> its logits [V] or hidden state [H], drawn once: tests ask again and again

    def __attrs_post_init__(self) -> None:
        generator = torch.Generator(device="cpu").manual_seed(self.seed)
        self._embeddings = torch.randn(2, self.vocab_size, self.head_dim, generator=generator, device="cpu")  # [2, V, D]
        self._head = torch.randn(self.vocab_size, self.hidden_size, generator=generator, device="cpu")  # [V, H]

    def hidden_for(self, context: Sequence[int]) -> torch.Tensor:
        """[H] the hidden state after ``context``: hash-seeded, like the logits (a copy: the caller may change it)."""
        return self._once("hidden", tuple(context), self._draw_hidden)

    def _once(self, what: str, context: tuple[int, ...], draw) -> torch.Tensor:
        if (what, context) not in self._drawn:
            self._drawn[what, context] = draw(context)
        return self._drawn[what, context].clone()

    def _draw_hidden(self, context: tuple[int, ...]) -> torch.Tensor:
        generator = torch.Generator(device="cpu").manual_seed(hash((HIDDEN_STREAM, self.seed, *context)) & 0x7FFF_FFFF_FFFF_FFFF)
        return torch.randn(self.hidden_size, generator=generator, device="cpu")  # [H]

    def with_vocabulary(self, rows: torch.Tensor) -> "SyntheticLM":
        """This model emitting only the tokens ``rows`` [R] (and its support): -inf logits elsewhere."""
        keep = set(rows.tolist()) & set(range(self.vocab_size) if self.support is None else self.support)
        return attrs.evolve(self, support=tuple(sorted(keep)))

    def output_logits(self, states: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, V]: the fixed output head."""
        return states.float().cpu() @ self._head.T

    def output_head(self, rows: torch.Tensor):
        """The output head's rows ``rows`` [R]: a function [n, H] -> [n, R]."""
        part = self._head[rows.cpu()]  # [R, H]
        return lambda states: states.float().cpu() @ part.T  # [n, H] -> [n, R]

    def input_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """[n] -> [n, H]: the output head's rows (tied embeddings, as SmolLM2's)."""
        return self._head[tokens.cpu()]  # [n, H]

    def logits_for(self, context: Sequence[int]) -> torch.Tensor:
        """[V] the logits after ``context`` (a copy: the caller may change it)."""
        return self._once("logits", tuple(context), self._draw_logits)

    def _draw_logits(self, context: tuple[int, ...]) -> torch.Tensor:
        generator = torch.Generator(device="cpu").manual_seed(hash((self.seed, *context)) & 0x7FFF_FFFF_FFFF_FFFF)
        logits = self.sharpness * torch.randn(self.vocab_size, generator=generator, device="cpu")  # [V]; computed on the host
        if self.base is not None:
            logits = self.base.logits_for(context) + self.noise * logits
        if self.support is not None:
            mask = torch.full((self.vocab_size,), float("-inf"), device="cpu")
            mask[list(self.support)] = 0.0
            logits = logits + mask
        return logits

    def new_cache(self, capacity: int, *, relative_positions: bool = False) -> KVStore:
        # positions play no part in a synthetic model, so cache-relative ones need no re-rotation
        return KVStore(layers=1, kv_heads=1, head_dim=self.head_dim, capacity=capacity, dtype=torch.float32, device=self.device)

    def forward(self, batch: TokenBatch, cache: KVStore) -> torch.Tensor:
        cache.begin(batch.positions)
        keys, queries = self._embeddings[:, batch.tokens]  # [T, D] each
        values = batch.tokens.float()[:, None].expand(-1, self.head_dim)  # [T, D]; the token id rides along
        keys, values = cache.write(0, keys[None].to(self.device), values[None].to(self.device))  # [1, n+T, D] on the device
        keys, values = keys.cpu(), values.cpu()  # the hash-seeded logits are computed on the host
        seen = self._visible(queries, keys, batch, cache)  # [T, n+T]
        cache.commit()
        ids = values[0, :, 0].long()  # [n+T]
        t = len(batch)
        kept = min(t, max(batch.num_logits, batch.hidden_rows)) if batch.keep_hidden else batch.num_logits  # the last rows computed
        stated = [ids[seen[i]].tolist() for i in range(t - kept, t)]  # each row's context
        contexts = stated[kept - batch.num_logits :]  # the rows scored
        logits = torch.stack([self.logits_for(c) for c in contexts]) if contexts else torch.empty(0, self.vocab_size, device="cpu")  # [num_logits, V]
        if batch.keep_hidden:
            batch.hidden = torch.stack([self.hidden_for(c) for c in stated]) if stated else torch.empty(0, self.hidden_size, device="cpu")  # [n, H]
        return logits.to(self.device)

    def _visible(self, queries: torch.Tensor, keys: torch.Tensor, batch: TokenBatch, cache: KVStore) -> torch.Tensor:
        """Which slots each new token attends to ([T, n+T] bool): the cached ones and those its batch
        lets it see, unless the level's policy restricts attention; the weights are recorded for
        policies that read them."""
        mask = batch.mask(keys.shape[1] - len(batch), 1)  # [T, n+T]
        if batch.queries is not None:
            batch.queries.record(0, 1, queries[batch.query_row][None].to(self.device))  # [1, D]; read with the keys, on the device
        if not (batch.record_attention or batch.attend is not None):
            return mask
        weights = attention_weights(queries[None], keys, mask, self.head_dim**-0.5, 1, batch.attend)  # [1, T, n+T]
        if batch.record_attention:
            cache.accumulate_attention(0, weights.sum(1).to(self.device))  # [1, n+T]
        return weights[0] > 0


def greedy_decode(model: SyntheticLM, prompt: Sequence[int], max_new_tokens: int, stop_tokens: Sequence[int] = ()) -> list[int]:
    """Plain argmax decoding with the full context: the reference for greedy losslessness."""
    out: list[int] = []
    while len(out) < max_new_tokens:
        out.append(int(model.logits_for([*prompt, *out]).argmax()))
        if out[-1] in stop_tokens:
            break
    return out


def sequence_probabilities(
    model: SyntheticLM, prompt: Sequence[int], length: int, sampling: SamplingConfig, stop_tokens: Sequence[int] = ()
) -> dict[tuple[int, ...], float]:
    """Exact probability of every continuation of ``prompt`` of ``length`` tokens (shorter if it ends
    in a stop token), under ``warp(model logits)`` with the full context."""
    result: dict[tuple[int, ...], float] = {(): 1.0}
    finished: dict[tuple[int, ...], float] = {}
    for _ in range(length):
        grown: dict[tuple[int, ...], float] = {}
        for seq, prob in result.items():
            probs = warp(model.logits_for([*prompt, *seq]), sampling.marginal)  # [V]; a coupled draw is a sample of it
            for token in torch.nonzero(probs).flatten().tolist():
                target = finished if token in stop_tokens else grown
                target[(*seq, token)] = prob * float(probs[token])
        result = grown
    return {**result, **finished}

