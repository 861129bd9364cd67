"""The Medusa drafter: candidates from heads on the hidden state of the level it drafts for.

Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads". The level above scores a round and commits tokens; its last hidden state h_q at position q
reaches this drafter through a :class:`~specstack.channels.HiddenStateChannel` (the level opens it;
this drafter reads nothing else of it). Through that level's own LM head, h_q predicts x_{q+1} and
head k's state predicts x_{q+k+1}. Usually the last token of the prefix is the one the level has just
emitted and not yet fed, so q = len(prefix) - 2 and head 1 drafts the next token; right after a
prefill q = len(prefix) - 1 and the LM head itself drafts it.

Chained heads (one head applied step after step, :mod:`specstack_medusa.heads`) draft the same tree
of rank paths, but a node's candidates are ranks of the state its parent's token leads to, so the
tree is expanded depth by depth (one pass of the output head per depth).

The draft is a token tree of rank paths (:mod:`specstack_medusa.tree`): deterministic candidates
(``TREE_DETERMINISTIC``), verified losslessly by the greedy verifier at temperature 0 and by the
token-tree verifier above it. (Medusa's "typical acceptance" is not offered: it changes the output
distribution.) When the level holds no state for the prefix (a cache adopted from another stack;
the level above rejected what the level emitted), the draft is empty and the level samples one
token on its own, which gives the state for the next round.
"""

from __future__ import annotations

from typing import ClassVar, Sequence

import attrs
import torch

from specstack import Draft, LevelStats, SpecstackError
from specstack.channels import HiddenStateChannel
from specstack.drafters import ACCEPTANCE_WEIGHT, RETRY, Drafter
from specstack.types import Capability, DraftKind

from .heads import HeadsInfo, MedusaHeads, load_heads, shipped_heads, synthetic_heads
from .tree import DepthCalibration, choose_paths, confident_nodes, parents_of, path_probabilities, paying_nodes

UNTRAINED_ACCURACY = (0.5, 0.1, 0.05)  # rank accuracies assumed for heads that carry no measurement
MIN_PROB = 0.1  # the default min_prob: measured best or within 0.03x of it among 0-0.3 in fp32 (docs/medusa.md)


def _size(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecstackError(f"medusa {attribute.name} {value!r} is not allowed; use an integer >= 1")


def _probability(instance, attribute, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
        raise SpecstackError(f"medusa {attribute.name} {value!r} is not allowed; use a number from 0 (keep every node) up to but not including 1")


def _draft_vocab(instance, attribute, value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= instance.vocab):
        raise SpecstackError(f"medusa draft_vocab {value!r} is not allowed; use 0 (the whole vocabulary) or an integer from 1 to {instance.vocab}")


@attrs.define(eq=False, kw_only=True)
class MedusaDrafter(Drafter):
    """Level 0 of the ``medusa`` stacks: ``tree_size`` candidates from ``heads`` (a file, the name of heads
    shipped for the embedded default, ``parallel`` (the default) or ``chained``, or loaded
    :class:`MedusaHeads`), at most ``top_k`` ranks per head. With ``draft_vocab`` = R > 0 the candidates
    come from the R tokens the target emitted most often in the heads' training data (FR-Spec, Zhao et
    al., 2025): the output head then computes R logits instead of V, and the draft's distributions are
    zero elsewhere. Deterministic trees are verified without them, so the output is unchanged. 0 drafts
    from the whole vocabulary; None (the default) takes the heads file's own ``draft_vocab``. With
    ``min_prob`` > 0 a round drafts only the nodes whose path probability under the heads is at least
    that (EAGLE-2's confidence, :func:`~specstack_medusa.tree.confident_nodes`): verify rows for
    candidates the heads doubt are not paid for, and a round they doubt entirely is a plain step.
    Which nodes are drafted never changes the output, only its cost.

    Once priced (:meth:`price`: the tuner tells it what the level above's forward of 1, 2, … tokens costs), a
    round drafts only the nodes that pay (:func:`~specstack_medusa.tree.paying_nodes`): the likeliest ones, as
    many as maximise the tokens a round emits per second, each node's chance of acceptance taken as its path
    probability times its depth's calibration (:class:`~specstack_medusa.tree.DepthCalibration`: how often the
    level above accepted a node at that depth against the path probabilities it was shown there). What is drafted
    depends on earlier rounds only, never on the level's draws in this one, so verification stays exact."""

    name: ClassVar[str] = "medusa"
    requires: ClassVar[frozenset[Capability]] = frozenset({Capability.HIDDEN_STATES})
    draft_kind: ClassVar[DraftKind] = DraftKind.TREE_DETERMINISTIC

    vocab: int
    heads: str | MedusaHeads | None = None
    tree_size: int = attrs.field(default=4, validator=_size)  # measured best of 2, 4, 8 on this CPU (docs/results.md)
    top_k: int = attrs.field(default=8, validator=_size)
    draft_vocab: int | None = attrs.field(default=None, validator=_draft_vocab)
    min_prob: float = attrs.field(default=MIN_PROB, validator=_probability)  # drop nodes the heads give a lower path probability
    stats: LevelStats = attrs.field(factory=lambda: LevelStats(name="medusa"))
    _channel: HiddenStateChannel | None = attrs.field(init=False, default=None)
    _trees: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = attrs.field(init=False, factory=dict)  # first head -> (depth, rank, parent) per node
    _verify_seconds: tuple[float, ...] = attrs.field(init=False, default=())  # the level above's forward of 1, 2, … tokens (price); (): no pricing
    _calibration: DepthCalibration = attrs.field(init=False, factory=lambda: DepthCalibration(weight=ACCEPTANCE_WEIGHT, retry=RETRY))

    _model: MedusaHeads = attrs.field(init=False)
    _output: object = attrs.field(init=False, default=None)  # [n, H] -> [n, R] logits: the level's output head, or its draft_vocab rows
    _rows: torch.Tensor | None = attrs.field(init=False, default=None)  # [R] the token id of each logit column; None: all V

    def __attrs_post_init__(self) -> None:
        self._model = self.heads if isinstance(self.heads, MedusaHeads) else load_heads(self.heads or shipped_heads())
        if self.info.vocab_size != self.vocab:
            raise SpecstackError(f"medusa heads were trained for a vocabulary of {self.info.vocab_size} tokens but the target has {self.vocab}; "
                                 f"train heads for this target with `specstack train medusa`")
        if self.draft_vocab is None:
            self.draft_vocab = min(self.info.draft_vocab, self.vocab)
        if self.draft_vocab and self._model.token_rank is None:
            raise SpecstackError(f"medusa draft_vocab={self.draft_vocab} needs heads that carry the target's token ranking; "
                                 f"these do not: retrain them with `specstack train medusa`, or use draft_vocab=0")

    @classmethod
    def conformance_instance(cls, vocab: int) -> "MedusaDrafter":
        """Random heads with token input (as the shipped heads) for the conformance suite's synthetic models (hidden size 8)."""
        return cls(vocab=vocab, heads=synthetic_heads(vocab, token_input=True), tree_size=8)

    @property
    def info(self) -> HeadsInfo:
        return self._model.info

    @property
    def vocab_size(self) -> int:
        return self.vocab

    @property
    def step(self) -> int:
        return self.info.heads + 1

    def attach_hidden_states(self, channel: HiddenStateChannel) -> None:
        if channel.hidden_size != self.info.hidden_size:
            raise SpecstackError(f"medusa heads read hidden states of size {self.info.hidden_size} but the level they draft for has {channel.hidden_size}; "
                                 f"train heads for this target with `specstack train medusa`")
        self._channel = channel
        self._model.to(channel.device)
        self._output, self._rows = channel.output_logits, None
        if self.draft_vocab:
            self._rows = self._model.token_rank[: self.draft_vocab].to(channel.device)  # [R]
            self._output = channel.output_head(self._rows)

    def price(self, verify_seconds: Sequence[float]) -> bool:
        self._verify_seconds = tuple(verify_seconds)
        self.reset()
        return True

    def reset(self) -> None:
        self._calibration = DepthCalibration(weight=ACCEPTANCE_WEIGHT, retry=RETRY)  # equal seeds, equal drafts

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            self._calibration.observe(accepted)

    def propose(self, prefix: Sequence[int], n: int) -> Draft:
        self._calibration.show([], [], [])  # until a priced draft is made
        if self._channel is None:
            raise SpecstackError("the medusa drafter reads the hidden states of the level above it; use it at level 0 of a stack")
        found = self._channel.latest(prefix)
        if found is None or n < 1:
            return Draft.empty(self.vocab, device=self._channel.device)
        position, state = found
        first = len(prefix) - 1 - position  # 0: the LM head drafts the next token; 1: head 1 does
        draft = self._draft(state, prefix[-1] if first == 1 else None, first, n)
        self.stats.drafted += len(draft)
        return draft

    def _draft(self, state: torch.Tensor, after: int | None, first: int, n: int) -> Draft:
        """The tree of candidates at most ``n`` deep for head ``first`` on (depth 0), from the hidden state
        ``state`` [H] and ``after``, the token after its position when the prefix holds it."""
        depth, rank, parents = self._tree(first)
        k = int((depth < n).sum())  # nodes are ordered by depth: the first k are the ones that fit
        if k == 0:  # no rank of the first head was ever right: nothing worth drafting
            return Draft.empty(self.vocab, device=self._channel.device)
        depth, rank, parents = depth[:k], rank[:k], parents[:k]
        with torch.inference_mode():
            nodes = self._chained_nodes if self.info.chained else self._parallel_nodes
            tokens, probs = nodes(state, after, first, depth.to(state.device), rank.to(state.device), parents.to(state.device))  # [k], [k, V]
        draft = Draft(tokens=tokens, probs=probs, parents=parents.to(state.device), kind=self.draft_kind)
        return self._chosen(draft, depth.tolist(), parents.tolist()) if self.min_prob > 0 or self._verify_seconds else draft

    def _chosen(self, draft: Draft, depths: list[int], parents: list[int]) -> Draft:
        """The subtree of ``draft`` (its nodes' ``depths`` and ``parents``, on the host) worth verifying, possibly empty:
        the nodes with path probability >= ``min_prob`` and, once priced, of those the ones that pay."""
        node_probs = draft.probs.gather(1, draft.tokens[:, None])[:, 0].tolist()  # [k] each node's probability of its own token
        kept = confident_nodes(node_probs, parents, self.min_prob)
        if self._verify_seconds:
            kept = self._paying(path_probabilities(node_probs, parents), depths, parents, kept)
        if not kept:
            return Draft.empty(self.vocab, device=draft.device)
        return draft.subtree(torch.tensor(kept, dtype=torch.long, device="cpu"))  # [k']

    def _paying(self, path: list[float], depths: list[int], parents: list[int], kept: list[int]) -> list[int]:
        """Of the nodes ``kept``, those that pay at the priced costs by their calibrated chances; the calibration is
        shown them, and moves the depths where none paid back toward 1."""
        paying = paying_nodes(self._calibration.reach(path, depths, parents), kept, self._verify_seconds)
        self._calibration.show(path, depths, paying)
        self._calibration.priced_out({depths[i] for i in kept} - {depths[i] for i in paying})
        return paying

    def _parallel_nodes(self, state, after, first, depth, rank, parents) -> tuple[torch.Tensor, torch.Tensor]:
        """Parallel heads: every node's token is a rank of its depth's head, whatever its parent; the
        output head runs once for all depths. -> tokens [k], and the distribution each was drawn from [k, V]."""
        d = int(depth[-1]) + 1
        states = torch.cat([state[None], self._head_states(state, after)])  # [K+1, H]
        ranks, rows = self._candidates(states[first : first + d])  # [d, top_k], [d, V]
        return ranks[depth, rank], rows[depth]  # [k], [k, V]

    def _chained_nodes(self, state, after, first, depth, rank, parents) -> tuple[torch.Tensor, torch.Tensor]:
        """Chained heads: a node's children are ranks of the state that its parent's token leads to
        (one step of the head per depth, one pass of the output head per depth, over that depth's
        parents). -> tokens [k], and the distribution each was drawn from [k, V]."""
        frontier = state[None] if first == 0 else self._step(state[None], torch.tensor([after], device=state.device))  # [1, H]: depth 0's parent
        tokens = torch.empty(depth.shape[0], dtype=torch.long, device=state.device)  # [k]
        probs = torch.empty(depth.shape[0], self.vocab, dtype=torch.float32, device=state.device)  # [k, V]
        low, last = 0, int(depth[-1])  # the first node of the depth before; the deepest depth
        for d in range(last + 1):
            at = (depth == d).nonzero()[:, 0]  # [m] this depth's nodes (contiguous)
            slot = parents[at] - low if d > 0 else torch.zeros_like(at)  # [m] each node's parent's row of frontier
            ranks, rows = self._candidates(frontier)  # [f, top_k], [f, V]
            tokens[at] = ranks[slot, rank[at]]
            probs[at] = rows[slot]
            if d < last:
                frontier = self._step(frontier[slot], tokens[at])  # [m, H]: the states this depth's tokens lead to
            low = int(at[0])
        return tokens, probs

    def _candidates(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[f, H] states -> their ``top_k`` candidate tokens [f, top_k] (best first) and their distributions
        [f, V] over the draft vocabulary (zero outside it)."""
        logits = self._output(states)  # [f, R]
        top = logits.topk(min(self.top_k, logits.shape[-1])).indices  # [f, top_k]
        rows = torch.softmax(logits, dim=-1)  # [f, R]
        if self._rows is None:
            return top, rows
        spread = rows.new_zeros(rows.shape[0], self.vocab).index_copy_(1, self._rows, rows)  # [f, V]
        return self._rows[top], spread

    def _step(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Chained heads' one step: [m, H] states and [m] the tokens after them -> [m, H] the next states."""
        embedded = self._embedded(tokens)  # [m, H]
        return self._model.step(states.to(embedded.dtype), embedded).to(states.dtype)  # [m, H]

    def _embedded(self, tokens: torch.Tensor) -> torch.Tensor:
        """[m] token ids -> [m, H] the level's input embeddings of them, in the heads' dtype."""
        return self._channel.input_embeddings(tokens).to(next(self._model.parameters()).dtype)  # [m, H]

    def _head_states(self, state: torch.Tensor, after: int | None) -> torch.Tensor:
        """[H] the level's state at q -> [K, H] the heads' states. Heads with token input also read the
        embedding of x_{q+1}: ``after`` when the prefix holds it, else the level's own greedy choice
        from ``state`` (the LM head's top-1, which the tree takes as certain)."""
        dtype = next(self._model.parameters()).dtype
        embedded = None
        if self.info.token_input:
            if after is None:
                after = int(self._channel.output_logits(state[None]).argmax())
            embedded = self._embedded(torch.tensor([after], device=self._channel.device))  # [1, H]
        return self._model(state[None].to(dtype), embedded)[:, 0].to(state.dtype)  # [K, H]

    def _tree(self, first: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[k] depth, rank and parent of every node of the tree of rank paths when head ``first`` drafts
        depth 0 (nodes ordered by depth): the LM head's top-1 is the level's own greedy choice, so it is
        taken as certain. Built once per ``first``."""
        if first not in self._trees:
            measured = [list(row) for row in self.info.accuracy] or [list(UNTRAINED_ACCURACY)] * self.info.heads
            table = [row[: min(self.top_k, self.vocab)] for row in ([[1.0]] + measured)[first:]]
            paths = choose_paths(table, self.tree_size)
            host = torch.device("cpu")
            self._trees[first] = (torch.tensor([len(p) - 1 for p in paths], dtype=torch.long, device=host),  # [k]
                                  torch.tensor([p[-1] for p in paths], dtype=torch.long, device=host),  # [k]
                                  torch.tensor(parents_of(paths), dtype=torch.long, device=host))  # [k]
        return self._trees[first]

    def level_stats(self) -> list[LevelStats]:
        return [self.stats]
