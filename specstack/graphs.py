"""CUDA graphs for the fixed-shape forwards of a transformers model, as TriForce's own code uses.

On a GPU, a forward of a few tokens through a small model (the draft) or over a small cache view (the
retrieval level) costs more in launching kernels from Python than in running them. A CUDA graph
records the kernels of one forward once and replays them with a single launch. A graph fixes every
tensor's address and shape, so a graphed forward differs from the eager one in three ways, all
decided here:

* the inputs (tokens, rotary positions, how many slots the store holds) are copied into static
  buffers before each replay;
* each layer's new keys and values are written with ``index_copy_`` at slots computed on the device
  from that slot count, not through a Python slice (:meth:`KVStore.write_at`);
* attention reads the store's whole buffer [H, C, D] under a mask [T, C] that hides the slots past
  each new token, also computed on the device.

Attention then costs as much as the store's capacity, not its length, so only stores of bounded
capacity are graphed (a StreamingLLM window, a retrieval view; :data:`MAX_CAPACITY`), and only chain
forwards of a few tokens (:data:`MAX_TOKENS`): the draft's steps and a retrieval level's verifies.
One graph is captured per store and shape, on first use, and replayed afterwards.
"""

from __future__ import annotations

import weakref
from typing import Callable

import attrs
import torch

from .batch import TokenBatch
from .kvstore import KVStore

MAX_TOKENS = 16  # longer forwards (prompt chunks) run eagerly
MAX_CAPACITY = 16384  # stores with more slots (a full cache) run eagerly

Run = Callable[[KVStore, torch.Tensor, torch.Tensor, "StaticView", int], torch.Tensor]  # (store, tokens, rope, view, L) -> [L, V]


@attrs.frozen(kw_only=True, eq=False)
class StaticView:
    """What the attention of a graphed forward reads: the slots its T new tokens are written to and,
    per query row of a folded GQA group, which of the store's C slots it sees."""

    slots: torch.Tensor  # [T] long, on the device
    visible: torch.Tensor  # [G*T, C] bool: row j*T + t is head j of the group, token t


def chain_view(length: torch.Tensor, offsets: torch.Tensor, every_slot: torch.Tensor, group: int) -> StaticView:
    """The view of a chain of T new tokens written after ``length`` [1] occupied slots, from device
    tensors only (so a graph can capture it): ``offsets`` = arange(T), ``every_slot`` = arange(C)."""
    slots = length + offsets  # [T]
    visible = (every_slot[None, :] <= slots[:, None]).repeat(group, 1)  # [G*T, C]: the cached slots and the chain so far
    return StaticView(slots=slots, visible=visible)


@attrs.define(eq=False, kw_only=True)
class CapturedForward:
    """One captured forward: T new tokens appended to one store, the logits of the last L."""

    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [1, T] long
    rope: torch.Tensor  # [1, T] long: rotary positions
    length: torch.Tensor  # [1] long: slots occupied before the forward
    logits: torch.Tensor  # [L, V] float32
    constants: tuple[torch.Tensor, ...]  # other tensors the graph reads: they must live as long as it does

    def replay(self, batch: TokenBatch, rope: torch.Tensor, length: int) -> torch.Tensor:
        self.tokens.copy_(batch.tokens[None], non_blocking=True)
        self.rope.copy_(rope[None], non_blocking=True)
        self.length.fill_(length)
        self.graph.replay()
        return self.logits.clone()  # [L, V]; the next replay overwrites the static output


@attrs.define(eq=False)
class ForwardGraphs:
    """The captured forwards of one model, per store and shape. Graphs of one model share a memory
    pool (they never run at the same time), and die with the store whose buffers they captured."""

    run: Run
    group: int  # query heads per KV head
    _pool: object = None
    _graphs: weakref.WeakKeyDictionary = attrs.field(init=False, factory=weakref.WeakKeyDictionary)
    replays: int = 0

    @staticmethod
    def applies(batch: TokenBatch, store: KVStore) -> bool:
        """Whether this forward may be graphed: a short chain over a bounded CUDA store, with nothing
        asked of its attention (no query log, attention weights or sparse attention) nor its hidden states."""
        plain = batch.queries is None and not batch.record_attention and batch.attend is None and not batch.keep_hidden
        return store.keys.is_cuda and batch.is_chain and plain and len(batch) <= MAX_TOKENS and store.capacity <= MAX_CAPACITY

    def forward(self, batch: TokenBatch, store: KVStore, rope: torch.Tensor) -> torch.Tensor:
        """Replay (capturing first, once per shape) the forward of ``batch`` into ``store``: [L, V]."""
        shapes = self._graphs.setdefault(store, {})
        shape = (len(batch), batch.num_logits)
        if shape not in shapes:
            shapes[shape] = self._capture(store, *shape)
        self.replays += 1
        return shapes[shape].replay(batch, rope, store.length)

    def _capture(self, store: KVStore, t: int, num_logits: int) -> CapturedForward:
        device = store.keys.device
        tokens = torch.zeros(1, t, dtype=torch.long, device=device)  # [1, T]
        rope = torch.zeros(1, t, dtype=torch.long, device=device)  # [1, T]
        length = torch.full((1,), store.length, dtype=torch.long, device=device)  # [1]
        offsets = torch.arange(t, device=device)  # [T]
        every_slot = torch.arange(store.capacity, device=device)  # [C]

        def forward() -> torch.Tensor:
            return self.run(store, tokens, rope, chain_view(length, offsets, every_slot, self.group), num_logits)  # [L, V]

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside the graph: lazy initialisation must not be captured
            forward()  # writes past the store's length only, where the real forward writes next
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = forward()  # [L, V]
        return CapturedForward(graph=graph, tokens=tokens, rope=rope, length=length, logits=logits, constants=(offsets, every_slot))
